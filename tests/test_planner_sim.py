"""`bench/planner_sim.py`: bad arguments name the flag; a run writes every cell."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "planner_sim.py"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--openings", "8,x"], "--openings must be comma-separated integers"),
        (["--openings", "-1"], "--openings must be >= 0"),
    ],
)
def test_bad_arguments_name_the_flag(args, message):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
    assert done.returncode == 2
    assert message in done.stderr


def test_a_run_writes_every_planner_opening_and_curve(tmp_path):
    out = tmp_path / "sim.json"
    cmd = [sys.executable, str(SCRIPT), "--seeds", "1", "--openings", "0", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    cells = {(r["planner"], r["curve"]): r["ratios"][0] for r in json.loads(out.read_text())}
    assert len(cells) == 5 * 3
    # A drafter that accepts nothing: fixed widths pay for every block, the planner does not.
    assert cells[("fixed width 4", "random")] < 0.8 < 0.95 < cells[("default", "random")]
