"""The launcher: argument defaults (pure) and fail-fast errors (real processes, no server)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash_sglang import suffix_corpus
from dflash_sglang.launch_server import (
    LaunchError,
    checked_corpus,
    flag_value,
    resolve_args,
    with_default_corpus,
)
from dflash_sglang.options import SpecOptions


def test_defaults_are_added_only_when_absent():
    args = resolve_args(
        ["--model-path", "m", "--speculative-draft-model-path", "d"], "cpu", None, None
    )
    assert flag_value(args, "--speculative-algorithm") == "DFLASH_X"
    assert flag_value(args, "--device") == "cpu"
    assert flag_value(args, "--host") == "127.0.0.1"
    assert flag_value(args, "--attention-backend") == "dflash_cpu"
    assert "--enable-metrics" in args and "--sleep-on-idle" in args
    kept = resolve_args(
        [
            "--model-path",
            "m",
            "--host=0.0.0.0",
            "--attention-backend",
            "torch_native",
            "--device",
            "cuda",
        ],
        "cpu",
        None,
        None,
    )
    assert flag_value(kept, "--host") == "0.0.0.0"
    assert flag_value(kept, "--attention-backend") == "torch_native"
    assert flag_value(kept, "--device") == "cuda"
    assert (
        flag_value(resolve_args(["--model-path", "m"], "cuda", None, None), "--attention-backend")
        == "flashinfer"
    )


def test_none_serves_the_same_model_without_speculation():
    args = resolve_args(
        [
            "--model-path",
            "m",
            "--speculative-draft-model-path",
            "d",
            "--speculative-algorithm",
            "none",
        ],
        "cpu",
        None,
        None,
    )
    assert flag_value(args, "--speculative-algorithm") is None
    assert flag_value(args, "--speculative-draft-model-path") is None


def test_embedded_default_target_and_draft():
    args = resolve_args([], "cpu", "/cache/target", "/pkg/draft")
    assert flag_value(args, "--model-path") == "/cache/target"
    assert flag_value(args, "--speculative-draft-model-path") == "/pkg/draft"
    assert flag_value(args, "--speculative-algorithm") == "DFLASH_X"
    no_draft = resolve_args([], "cpu", "/cache/target", None)
    assert flag_value(no_draft, "--speculative-algorithm") is None


def test_the_embedded_target_starts_warm_from_its_bundled_corpus(tmp_path, capsys):
    bundled = str(suffix_corpus.bundled())
    assert with_default_corpus(SpecOptions()).suffix_warm == bundled
    cold = SpecOptions(suffix_shared=0)
    assert with_default_corpus(cold) == cold  # nothing to fill
    relative = tmp_path / "past.jsonl"
    relative.write_text('{"prompt": "a", "response": "b"}\n')
    assert checked_corpus(SpecOptions(suffix_warm=str(relative))).suffix_warm == str(relative)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n')
    with pytest.raises(LaunchError):
        checked_corpus(SpecOptions(suffix_warm=str(bad)))
    err = capsys.readouterr().err
    assert "error: --dflash-suffix-warm: " in err and "bad.jsonl:1: a record needs" in err


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash_sglang.launch_server", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda m, t: ["--model-path", str(t / "missing")], "is not a directory"),
        (
            lambda m, t: ["--model-path", str(m["target"]), "--speculative-algorithm", "DFLASH_X"],
            "needs --speculative-draft-model-path",
        ),
        (
            lambda m, t: [
                "--model-path",
                str(m["target"]),
                "--speculative-draft-model-path",
                str(_bad_draft(m, t)),
            ],
            "hidden size mismatch",
        ),
        (
            lambda m, t: ["--model-path", str(m["target"]), "--max-total-tokens", "lots"],
            "--max-total-tokens",
        ),
        (lambda m, t: ["--dflash-widths", "1,x"], "--dflash-widths"),
        (lambda m, t: ["--dflash-adaptive", "maybe"], "--dflash-adaptive"),
        (lambda m, t: ["--dflash-cpu-compile", "yes"], "--dflash-cpu-compile"),
        (lambda m, t: ["--dflash-cpu-freeze", "maybe"], "--dflash-cpu-freeze"),
        (lambda m, t: ["--dflash-cpu-attention", "fast"], "--dflash-cpu-attention"),
        (lambda m, t: ["--dflash-cpu-arena-cache", "yes"], "--dflash-cpu-arena-cache"),
        (lambda m, t: ["--dflash-suffix-max-match", "0"], "--dflash-suffix-max-match"),
        (
            lambda m, t: ["--dflash-suffix-warm", str(t / "absent.jsonl")],
            "--dflash-suffix-warm: ",
        ),
        (
            lambda m, t: ["--dflash-suffix-shared", "0", "--dflash-suffix-warm", "x.jsonl"],
            "--dflash-suffix-warm needs the shared suffix lookup",
        ),
        (
            lambda m, t: ["--dflash-suffix", "off", "--dflash-suffix-shared", "4096"],
            "--dflash-suffix-shared needs --dflash-suffix on",
        ),
        (
            # The tiny draft's block is 4: a width of 8 cannot be verified.
            lambda m, t: [
                "--model-path",
                str(m["target"]),
                "--speculative-draft-model-path",
                str(m["draft"]),
                "--dflash-widths",
                "1,8",
            ],
            "--dflash-widths 8 exceeds the block size 4",
        ),
    ],
)
def test_bad_launches_fail_fast_naming_the_problem(models, tmp_path, make_args, message):
    done = _launch(*make_args(models, tmp_path))
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr


def _bad_draft(models, tmp_path):
    d = tmp_path / "bad_draft"
    d.mkdir()
    (d / "model.safetensors").write_bytes((models["draft"] / "model.safetensors").read_bytes())
    config = json.loads((models["draft"] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"hidden_size": 96}))
    return d


def test_help_shows_ours_and_sglangs():
    done = _launch("--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--dflash-cache-dir" in done.stdout and "--dflash-adaptive" in done.stdout
    assert "--speculative-algorithm" in done.stdout and "--max-total-tokens" in done.stdout
