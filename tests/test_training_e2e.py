"""The training CLI end to end on a tiny random target: generate through a real server, cache
features, train (resumably, deterministically), export, and serve the result in DFLASH_X."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from dflash_sglang import draft_vocab
from dflash_sglang.draft_vocab import most_frequent
from dflash_sglang.drafter import DFlashDrafter
from dflash_sglang.loadtest import server_metrics
from dflash_sglang.options import DEFAULT_PROMPT_VOCAB
from dflash_sglang.reference import ReferenceDecoder
from dflash_sglang.training.__main__ import main
from dflash_sglang.training.data import read_samples
from tests.server import PURE_DFLASH, Server

pytestmark = pytest.mark.server
PROMPTS, NEW = 16, 40
SHAPE = ["--num-layers", "2", "--block-size", "4", "--target-layer-ids", "0,2"]
TRAIN = ["--batch-size", "4", "--num-anchors", "32", "--lr", "5e-3", "--threads", "2"]


@pytest.fixture(scope="module")
def run(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = str(models["target"])
    data = root / "data.jsonl"
    gen = ["generate", "--target", target, "--out", str(data), "--num-prompts", str(PROMPTS)]
    gen += ["--max-new-tokens", str(NEW), "--max-prompt-tokens", "48", "--batch-size", "8"]
    assert main([*gen, "--threads", "1", "--dtype", "float32"]) == 0
    feats = root / "features"
    assert main(["features", "--target", target, "--data", str(data),
                 "--features-dir", str(feats), "--dtype", "float32", *SHAPE]) == 0  # fmt: skip
    return {"root": root, "target": target, "data": data, "features": feats}


def _train(run, out, *extra):
    args = ["train", "--target", run["target"], "--features-dir", str(run["features"])]
    return main([*args, "--out", str(out), *SHAPE, *TRAIN, "--epochs", "150", *extra])


def _tau(target_dir, drafter_dir, samples) -> float:
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    decoder = ReferenceDecoder(target, DFlashDrafter.load(drafter_dir))
    lengths = []
    for s in samples:
        lengths += decoder.generate(s["prompt_ids"], NEW).acceptance_lengths
    return sum(lengths) / len(lengths)


def _serve_and_compare(run, drafter_dir, samples, log_path, prompt_vocab=None) -> None:
    """Serve `drafter_dir` under DFLASH_X (SGLang's upstream DFlashDraftModel loads it) and
    check the server accepts exactly what the reference loop accepts, request by request.
    `prompt_vocab`: `--dflash-prompt-vocab` on both sides (None: both defaults)."""
    args = ["--model-path", run["target"], "--dtype", "float32", "--max-total-tokens", "4096"]
    draft = ["--speculative-draft-model-path", str(drafter_dir), *PURE_DFLASH]
    if prompt_vocab is not None:
        draft += ["--dflash-prompt-vocab", str(prompt_vocab)]
    server = Server([*args, *draft], log_path)
    try:
        # The drafter's block runs compiled on CPU by default: this pins it to the reference.
        assert "Draft block forward: compiled" in log_path.read_text()
        target = AutoModelForCausalLM.from_pretrained(run["target"], dtype=torch.float32).eval()
        vocab = DEFAULT_PROMPT_VOCAB if prompt_vocab is None else prompt_vocab
        decoder = ReferenceDecoder(target, DFlashDrafter.load(drafter_dir), vocab)
        for s in samples:
            meta = server.generate(input_ids=s["prompt_ids"], max_new_tokens=NEW, ignore_eos=True)
            ref = decoder.generate(s["prompt_ids"], NEW)
            assert meta["meta_info"]["spec_verify_ct"] == len(ref.acceptance_lengths)
            assert meta["output_ids"] == ref.tokens
    finally:
        server.stop()


def _drafts_by_source(server: Server, samples) -> tuple[list, dict[tuple[str, str], float]]:
    """(output ids and verify steps per request, {(counter, source): delta}) of `samples`,
    then of a second turn after each of the first three: its prompt is the first turn's
    prompt and reply (a radix-cache hit, the reply's draft KV included) and a new question."""
    before = server_metrics.scrape(server.url)
    results = []
    for s in samples:
        meta = server.generate(input_ids=s["prompt_ids"], max_new_tokens=NEW, ignore_eos=True)
        results.append((meta["output_ids"], meta["meta_info"]["spec_verify_ct"]))
    for (first, _), s, question in zip(results[:3], samples, samples[3:], strict=False):
        turn = [*s["prompt_ids"], *first, *question["prompt_ids"][:8]]
        meta = server.generate(input_ids=turn, max_new_tokens=NEW, ignore_eos=True)
        assert meta["meta_info"]["cached_tokens"] >= len(s["prompt_ids"]) + len(first) // 2
        results.append((meta["output_ids"], meta["meta_info"]["spec_verify_ct"]))
    deltas = server_metrics.counter_deltas(before, server_metrics.scrape(server.url))
    counts = {
        (name, source): deltas.get(server_metrics.sample_key(name, {"source": source}), 0)
        for name in ("dflash_num_drafts_total", "dflash_num_accepted_tokens_total")
        for source in ("dflash", "suffix")
    }
    return results, counts


def _deferred_injection_drafts_as_immediate(run, drafter_dir, samples, log_dir) -> None:
    """Suffix proposals taken whenever one exists, the DFlash block otherwise: the drafter
    runs on some steps only, so rows of the steps between wait in `HeldRows` (the default
    on CPU), and second turns read the first turns' replies from the radix cache. Every
    DFlash proposal must still see the draft KV it would have seen with injection every
    step: the same steps and acceptance per source."""
    args = ["--model-path", run["target"], "--dtype", "float32", "--max-total-tokens", "4096"]
    args += ["--speculative-draft-model-path", str(drafter_dir)]
    args += ["--dflash-adaptive", "off", "--dflash-suffix", "always"]
    got = {}
    for name, extra in (("deferred", []), ("every_step", ["--dflash-defer-injection", "0"])):
        server = Server([*args, *extra], log_dir / f"{name}.log")
        try:
            got[name] = _drafts_by_source(server, samples)
        finally:
            server.stop()
    assert got["deferred"] == got["every_step"]
    counts = got["deferred"][1]
    # Steps that did not draft (one request at a time, its suffix proposal taken), and
    # drafts the target accepted: deferred rows were written before the drafter ran.
    assert counts["dflash_num_drafts_total", "suffix"] > 0, counts
    assert counts["dflash_num_accepted_tokens_total", "dflash"] > 0, counts


def test_generated_data_is_the_targets_greedy_output(run):
    samples = read_samples(run["data"])
    assert len(samples) == PROMPTS and len({s["id"] for s in samples}) == PROMPTS
    target = AutoModelForCausalLM.from_pretrained(run["target"], dtype=torch.float32).eval()
    assert all(len(x["prompt_ids"]) <= 48 for x in samples)
    for s in samples[:4]:
        ids = torch.tensor([s["prompt_ids"]])
        plain = target.generate(ids, max_new_tokens=len(s["response_ids"]), do_sample=False)
        assert plain[0, ids.shape[1] :].tolist() == s["response_ids"]


def test_sampled_replies_are_new_samples_of_the_same_prompts(run, tmp_path):
    """`--temperature` > 0: one more reply per prompt and draw, under its own id, so a mix
    takes the greedy and sampled replies of one prompt together; a draw resumes by id."""
    greedy = {s["id"]: s for s in read_samples(run["data"])}
    args = ["--model-path", run["target"], "--dtype", "float32", "--max-total-tokens", "4096"]
    server = Server([*args, "--speculative-algorithm", "NONE"], tmp_path / "plain.log")
    out = tmp_path / "sampled.jsonl"
    gen = ["generate", "--target", run["target"], "--out", str(out), "--num-prompts", "4"]
    gen += ["--max-new-tokens", str(NEW), "--max-prompt-tokens", "48", "--batch-size", "4"]
    gen += ["--server-url", server.url, "--temperature", "1"]
    try:
        for draw in ("0", "1", "1"):  # the second draw 1 finds its four replies done
            assert main([*gen, "--draw", draw]) == 0
    finally:
        server.stop()
    rows = read_samples(out)
    assert len(rows) == 8
    by_prompt: dict[str, list[list[int]]] = {}
    for row in rows:
        prompt, temperature, draw = row["id"].rsplit("-", 2)
        assert temperature == "t1" and draw in {"0", "1"}
        assert row["prompt_ids"] == greedy[prompt]["prompt_ids"]
        by_prompt.setdefault(prompt, []).append(row["response_ids"])
    assert len(by_prompt) == 4
    # A random tiny target samples almost uniformly: two draws of 40 tokens never agree,
    # and neither is the greedy reply.
    for prompt, (a, b) in by_prompt.items():
        assert a != b and greedy[prompt]["response_ids"] not in (a, b)
    mixed = tmp_path / "mixed.jsonl"
    assert main(["mix", str(run["data"]), str(out), "--seed", "0", "--out", str(mixed)]) == 0
    assert len(read_samples(mixed)) == PROMPTS + 8


def test_generate_refuses_a_draw_without_sampling(run, tmp_path, capsys):
    base = ["generate", "--target", run["target"], "--out", str(tmp_path / "g.jsonl")]
    for extra, message in (
        (["--draw", "1"], "--draw: only sampled replies"),
        (["--temperature", "-1"], "--temperature and --draw must be >= 0"),
        (["--temperature", "1", "--responses", "dataset"], "--temperature: only --responses"),
    ):
        assert main([*base, *extra]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "g.jsonl").exists()


def test_training_raises_tau_and_the_server_agrees(run, models, tmp_path):
    out = run["root"] / "full"
    assert _train(run, out) == 0
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.5 * log[0]["loss"]
    samples = read_samples(run["data"])[:6]
    tau = _tau(run["target"], out / "drafter", samples)
    assert tau > 1.3, f"τ {tau:.2f} on its own training prompts"

    _serve_and_compare(run, out / "drafter", samples, tmp_path / "server.log")
    _deferred_injection_drafts_as_immediate(run, out / "drafter", samples, tmp_path)


@pytest.fixture(scope="module")
def straight(run) -> Path:
    """12 uninterrupted steps, checkpointed every 4: the trained drafter later tests load,
    so each of them also runs alone."""
    out = run["root"] / "straight"
    assert _train(run, out, "--max-steps", "12", "--save-every", "4") == 0
    return out


def test_resumed_training_equals_uninterrupted(run, straight):
    resumed = run["root"] / "resumed"
    assert _train(run, resumed, "--max-steps", "5", "--save-every", "4") == 0
    assert _train(run, resumed, "--max-steps", "12", "--save-every", "4") == 0
    a = torch.load(straight / "checkpoint.pt", weights_only=False)
    b = torch.load(resumed / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 12
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key


def test_online_features_train_the_same_way(run, tmp_path):
    """The GPU recipe's path (--data: features computed per batch) runs the same loop."""
    args = ["train", "--target", run["target"], "--data", str(run["data"])]
    assert main([*args, "--out", str(tmp_path), *SHAPE, *TRAIN, "--max-steps", "3"]) == 0
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    assert (tmp_path / "drafter" / "model.safetensors").exists()


def test_target_labels_train_from_the_cli(run, tmp_path):
    """--labels target (the labels for generate --responses dataset) runs the same loop."""
    assert _train(run, tmp_path, "--labels", "target", "--distill", "0.5", "--max-steps", "3") == 0
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(r["loss"] > 0 for r in log)
    assert (tmp_path / "drafter" / "model.safetensors").exists()
    assert "later_kept" not in log[0]


def test_consistent_labels_train_from_the_cli(run, tmp_path):
    """--consistent-labels logs the share of later-slot labels kept on the target's path."""
    args = ["--labels", "target", "--consistent-labels", "--max-steps", "2"]
    assert _train(run, tmp_path, *args) == 0
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(0 <= r["later_kept"] <= 1 for r in log)


def test_rollout_labels_train_from_the_cli(run, tmp_path):
    """--labels rollout rolls the target out from every anchor (online features only): every
    later slot in the draft vocabulary keeps its loss, unlike --consistent-labels."""
    args = ["train", "--target", run["target"], "--data", str(run["data"]), "--out", str(tmp_path)]
    args += [*SHAPE, *TRAIN, "--labels", "rollout", "--distill", "0.5", "--max-steps", "2"]
    assert main(args) == 0
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(r["later_kept"] > 0.5 for r in log)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert state["config"]["labels"] == "rollout" and state["config"]["rollout_depth"] == 3


def test_a_drafter_retrains_at_another_block_size(run, straight, tmp_path):
    """--init-drafter keeps its drafter's block size unless --block-size names another: the
    same weights then train, and are written, at that size."""
    drafter = straight / "drafter"
    args = ["train", "--target", run["target"], "--features-dir", str(run["features"])]
    args += [*TRAIN, "--init-drafter", str(drafter), "--max-steps", "2"]
    assert main([*args, "--out", str(tmp_path / "same")]) == 0
    assert DFlashDrafter.load(tmp_path / "same" / "drafter").config.block_size == 4
    assert main([*args, "--out", str(tmp_path / "b3"), "--block-size", "3"]) == 0
    retrained = DFlashDrafter.load(tmp_path / "b3" / "drafter")
    assert retrained.config.block_size == 3
    assert DFlashDrafter.load(drafter).config.block_size == 4  # the source is untouched
    state = torch.load(tmp_path / "b3" / "checkpoint.pt", weights_only=False)
    assert state["draft_config"]["block_size"] == 3


def test_yardstick_from_the_cli(run, straight, tmp_path):
    """The slot-1 yardstick and the drafter's slot 1, scored on the same held-out positions."""
    out = tmp_path / "yardstick.json"
    drafter = straight / "drafter"
    args = ["yardstick", "--target", run["target"], "--features-dir", str(run["features"])]
    args += ["--heldout-features", str(run["features"]), "--drafter", str(drafter)]
    assert main([*args, "--epochs", "2", "--out", str(out)]) == 0
    entry = json.loads(out.read_text())[run["features"].name]
    assert 0 < entry["yardstick_top1"] <= 1 and 0 <= entry["drafter_slot1"] <= 1


def test_export_round_trip(run, straight, tmp_path):
    ckpt = straight / "checkpoint.pt"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "x")]) == 0
    exported = DFlashDrafter.load(tmp_path / "x")
    state = torch.load(ckpt, weights_only=False)["model"]
    for key, value in exported.state_dict().items():
        assert torch.equal(value, state[key].to(torch.bfloat16).float()), key


def test_bad_arguments_fail_with_the_flag(run, straight, tmp_path, capsys):
    assert main(["train", "--features-dir", str(tmp_path / "nope"), "--out", "x"]) == 2
    assert "--features-dir" in capsys.readouterr().err
    assert main(["train", "--out", "x"]) == 2
    assert "--features-dir" in capsys.readouterr().err
    bad_mask = ["--target", run["target"], "--mask-token-id", "100000"]
    assert main(["train", "--features-dir", str(run["features"]), "--out", "x", *bad_mask]) == 2
    assert "--mask-token-id" in capsys.readouterr().err
    args = ["evaluate", "--target", run["target"], "--drafter", str(tmp_path)]
    assert main(args) == 2
    assert "--drafter" in capsys.readouterr().err
    assert main([*args, "--baseline-url", "http://127.0.0.1:1"]) == 2
    assert "--baseline-url" in capsys.readouterr().err
    assert main([*args, "--spread", "--features-dir", str(run["features"])]) == 2
    assert "--spread" in capsys.readouterr().err
    assert main([*args[:-2], "--drafter", str(straight / "drafter"),
                 "--features-dir", str(tmp_path / "nope")]) == 2  # fmt: skip
    assert "--features-dir" in capsys.readouterr().err
    gen = ["generate", "--out", str(tmp_path / "x"), "--prompt-set", "mt_bench"]
    assert main([*gen, "--responses", "dataset"]) == 2
    assert "--prompt-set mt_bench has no replies" in capsys.readouterr().err
    assert main([*gen, "--all-turns"]) == 2
    assert "--all-turns" in capsys.readouterr().err
    assert main([*gen, "--prompts-file", str(run["data"])]) == 2
    assert "--prompts-file: replaces --prompt-set" in capsys.readouterr().err
    assert main([*gen[:3], "--prompts-file", str(tmp_path / "none.jsonl")]) == 2
    assert "--prompts-file" in (err := capsys.readouterr().err) and "no such file" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    assert main([*gen[:3], "--prompts-file", str(bad)]) == 2
    assert "--prompts-file:" in (err := capsys.readouterr().err) and "line 1" in err
    assert _train(run, tmp_path, "--rope-theta", "-1") == 2
    assert "--rope-theta" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--out", "x", "--num-prompts", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["train", "--data", "x", "--out", "y", "--consistent-labels"])
    assert exc.value.code == 2
    assert "--consistent-labels needs --labels target" in capsys.readouterr().err
    assert _train(run, tmp_path, "--labels", "rollout") == 2
    assert "from each anchor: give --data" in capsys.readouterr().err
    online = ["train", "--target", run["target"], "--data", str(run["data"]), "--out", "y"]
    assert main([*online, *SHAPE, "--labels", "rollout", "--rollout-depth", "4"]) == 2
    assert "--rollout-depth must be < the block size 4" in capsys.readouterr().err
    for bad, message in (
        (["--rollout-depth", "2"], "--rollout-depth needs --labels rollout"),
        (["--labels", "rollout", "--rollout-depth", "0"], "--rollout-depth must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            main(["train", "--data", "x", "--out", "y", *bad])
        assert message in capsys.readouterr().err


def test_restricted_vocabulary_drafter_serves_in_dflash_x(run, tmp_path):
    out = run["root"] / "vocab"
    assert _train(run, out, "--max-steps", "60", "--draft-vocab-size", "64") == 0
    drafter = DFlashDrafter.load(out / "drafter")
    assert drafter.draft_vocab_ids is not None and len(drafter.draft_vocab_ids) == 64
    responses = [s["response_ids"] for s in read_samples(run["data"])]
    assert drafter.draft_vocab_ids.tolist() == most_frequent(responses, 64).tolist()

    samples = read_samples(run["data"])[:4]
    _serve_and_compare(run, out / "drafter", samples, tmp_path / "s.log")

    # --dflash-prompt-vocab (default on) and off, with every token the responses copy from
    # the prompts taken out of the draft vocabulary: the server accepts exactly what the
    # reference loop accepts either way (that the prompt tokens change acceptance is pinned
    # on the reference loop, tests/test_teacher_forced.py; this tiny drafter rarely lands one).
    in_prompts = {t for s in samples for t in s["prompt_ids"]}
    drop = {t for s in samples for t in s["response_ids"] if t in in_prompts}  # all copied
    assert drop
    without = _without_tokens(out / "drafter", tmp_path / "d", drop)
    _serve_and_compare(run, without, samples, tmp_path / "e.log")
    _serve_and_compare(run, without, samples, tmp_path / "e0.log", 0)


def _without_tokens(drafter_dir, out_dir, drop: set[int]):
    """A copy of a restricted-vocabulary drafter whose vocabulary lacks `drop` (same size)."""
    shutil.copytree(drafter_dir, out_dir)
    for file in out_dir.glob("*.safetensors"):
        tensors = load_file(str(file))
        original = tensors[draft_vocab.KEY].tolist()
        ids = [i for i in original if i not in drop]
        spare = [i for i in range(max(original)) if i not in drop and i not in ids]
        tensors[draft_vocab.KEY] = torch.tensor(sorted(ids + spare[: len(original) - len(ids)]))
        save_file(tensors, str(file), metadata={"format": "pt"})
    return out_dir
