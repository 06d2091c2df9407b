"""`bench/planner_replay.py`: bad arguments name the flag; a replay decodes every token and
follows its tables (a drafter that always hits pays, one that never hits is left alone)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "planner_replay.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def _tables(path: Path, hit: int) -> Path:
    """Two replies per set of 120 distinct tokens each; the DFlash block accepts `hit`
    drafts at every position."""
    rows = [
        {
            "source": name,
            "prompt_ids": [1, 2, 3],
            "response_ids": list(range(45000 + 120 * k, 45120 + 120 * k)),
            "dflash": [hit + 1] * 119,
        }
        for k, name in enumerate(["mt_bench", "mt_bench", "math", "math"])
    ]
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--tables", "nope.json.gz"], "--tables nope.json.gz: no such file"),
        (["tables", "--data", "nope.jsonl", "--out", "x"], "--data nope.jsonl: no such file"),
        (["tables", "--drafter", "nope", "--out", "x"], "--drafter nope: no drafter there"),
        (["tables", "--prompt-vocab", "-1", "--out", "x"], "--prompt-vocab must be >= 0"),
    ],
)
def test_bad_arguments_name_the_flag(args, message):
    done = _run(*args)
    assert done.returncode == 2
    assert message in done.stderr


def test_bad_seeds_sets_and_base_name_the_flag(tmp_path):
    tables = str(_tables(tmp_path / "t.json.gz", 3))
    for args, message in [
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--sets", "math,humaneval"], "--sets: ['humaneval'] not in"),
        (["--base", "no-such-revision"], "--base no-such-revision"),
        (["--variants", "nope"], "--variants: unknown ['nope']"),
    ]:
        done = _run("run", "--tables", tables, "--sets", "mt_bench,math", *args)
        assert done.returncode != 0 and message in done.stderr, done.stderr


@pytest.mark.parametrize("hit, faster", [(15, True), (0, False)])
def test_a_replay_decodes_every_token_and_follows_its_tables(tmp_path, hit, faster):
    tables = str(_tables(tmp_path / "t.json.gz", hit))
    out = tmp_path / "replay.json"
    done = _run(
        "run", "--tables", tables, "--sets", "mt_bench,math", "--seeds", "2", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    arms = json.loads(out.read_text())["arms"]
    for row in arms["this tree"].values():
        assert row["tokens"] == 2 * 120 - 2  # each reply's first token comes from prefill
        dflash = row["sources_seed0"].get("dflash")
        if faster:  # the whole block hits: the planner drafts and verifies wide
            assert row["x_plain"]["mean"] > 3.0 and dflash["tau"] > 8.0
        else:  # nothing hits and nothing repeats: about plain decoding, never much below
            assert 0.9 < row["x_plain"]["range"][0] <= row["x_plain"]["mean"] < 1.0


def test_committed_tables_replay_the_committed_heldout_replies():
    """The v47 tables are the 80-prompt held-out sets' replies, in order, with one DFlash
    acceptance length per response token but the last (each in 1..16)."""
    root = SCRIPT.parents[1]
    from dflash_sglang.training.data import read_samples

    heldout = [
        s
        for s in read_samples(root / "bench" / "drafter" / "heldout_greedy_80.jsonl.gz")
        if s["response_ids"]
    ]
    with gzip.open(root / "bench" / "proposers" / "replay_tables_v47.json.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == len(heldout) == 240
    for row, sample in zip(rows, heldout, strict=True):
        assert (row["source"], row["prompt_ids"]) == (sample["source"], sample["prompt_ids"])
        assert row["response_ids"] == sample["response_ids"][: len(row["response_ids"])]
        assert len(row["dflash"]) == len(row["response_ids"]) - 1
        assert all(1 <= n <= 16 for n in row["dflash"])


def test_hindsight_bounds_the_planner(tmp_path):
    """Knowing each step's outcome, the hindsight arm is never slower than the planner."""
    tables = str(_tables(tmp_path / "t.json.gz", 3))
    out = tmp_path / "replay.json"
    args = ["run", "--tables", tables, "--sets", "mt_bench,math", "--seeds", "2"]
    done = _run(*args, "--variants", "hindsight", "--out", str(out))
    assert done.returncode == 0, done.stderr
    arms = json.loads(out.read_text())["arms"]
    for name in ("mt_bench", "math"):
        planner, bound = arms["this tree"][name], arms["hindsight"][name]
        assert bound["x_plain"]["mean"] > planner["x_plain"]["mean"] > 1.0
        assert bound["sources_seed0"]["dflash"]["tau"] > 3.9  # 3 drafts + bonus; fewer at the end
