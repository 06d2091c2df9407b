"""`bench/machine_drift.py`: block medians of a fixed load, and its argument checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / "machine_drift.py"), *args], capture_output=True, text=True
    )


def test_writes_one_positive_median_per_block(tmp_path):
    out = tmp_path / "drift.json"
    done = _run("--blocks", "2", "--iters", "1", "--threads", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    blocks = json.loads(out.read_text())["block_ms"]
    assert len(blocks) == 2 and all(ms > 0 for ms in blocks)
    assert "max/min" in done.stdout


def test_bad_arguments_name_the_flags():
    done = _run("--blocks", "0")
    assert done.returncode == 2
    assert "--blocks, --iters and --threads must be positive" in done.stderr
