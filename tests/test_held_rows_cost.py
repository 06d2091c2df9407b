"""`bench/held_rows_cost.py`: bad arguments name the flag; a run writes a row per batch size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "held_rows_cost.py"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "4,x"], "--batch takes an integer"),
        (["--batch", "0"], "--batch must be >= 1"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--draft-every", "-1"], "--draft-every must be >= 0"),
        (["--reply", "0"], "--reply must be >= 1"),
    ],
)
def test_bad_arguments_name_the_flag(args, message, capsys):
    """In this process: the script's interpreter start (~15 s of imports) is paid once, by
    the run below."""
    sys.path.insert(0, str(SCRIPT.parent))
    import held_rows_cost

    with pytest.raises(SystemExit) as exit_:
        held_rows_cost.main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_run_times_both_kinds_of_step_and_drops_finished_rows(tmp_path):
    out = tmp_path / "cost.json"
    args = ["--batch", "1,3", "--steps", "200", "--reply", "5", "--out", str(out)]
    subprocess.run([sys.executable, str(SCRIPT), *args], check=True, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 3]
    for row in rows:
        assert row["width1_step_us"] > 0 and row["drafting_step_us"] > 0
        assert 0 < row["peak_held_rows"] <= 4096
    assert rows[1]["dropped_rows"] == 0  # 200 steps of 3 rows never fill the ring
