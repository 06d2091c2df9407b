"""`bench/acceptance_bursts.py`: the walk's step pairs, the skip-after-miss policy's cost,
and bad arguments named by their flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _module():
    sys.path.insert(0, str(BENCH))
    import acceptance_bursts

    return acceptance_bursts


def test_walk_pairs_follow_the_greedy_walk():
    # acceptance length (bonus included) at each position; the walk visits 0, 3, 4, 6
    lengths = [3, 9, 9, 1, 2, 9, 1]
    assert _module().walk_pairs(lengths) == [(3, 1), (1, 2), (2, 1)]


def test_skip_after_miss_runs_plain_steps_after_a_missed_block():
    lengths = [1, 5, 5, 5, 5, 5]
    m = _module()
    # drafting every step at width 4: a miss (1 token), then 4 + 1 capped by the end
    assert m.skip_after_miss(lengths, 4, 0, 0.5, 0.0) == (6, 4.5)
    # one plain step after the miss, then a block of 4
    assert m.skip_after_miss(lengths, 4, 1, 0.5, 0.0) == (6, 1.5 + 1.0 + 1.5)
    # the verify width's token cost counts per drafting step
    tokens, cost = m.skip_after_miss([1], 4, 0, 0.5, 0.1)
    assert tokens == 1 and cost == pytest.approx(1.8)


def test_bursts_share_after_accepted_and_missed():
    stats = _module().bursts([[2, 9, 1, 2, 9, 1]])  # steps 2, 1, 2, 1
    assert stats["steps"] == 3
    assert stats["accepted_after_accepted"] == 0.0
    assert stats["accepted_after_missed"] == 1.0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--heldout", "nopath"], "--heldout takes NAME=FEATURES_DIR"),
        (["--heldout", "a=b", "--widths", "1,4"], "--widths must be >= 2"),
        (["--heldout", "a=b", "--skips", "x"], "--skips takes an integer"),
        (["--heldout", "a=b", "--draft-cost", "-1"], "--draft-cost must be >= 0"),
        (["--heldout", "a=b", "--token-cost", "nan"], "--token-cost must be >= 0"),
    ],
)
def test_bad_arguments_name_the_flag(args, message):
    cmd = [sys.executable, str(BENCH / "acceptance_bursts.py"), "--drafter", "d", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=BENCH)
    assert done.returncode == 2
    assert message in done.stderr
