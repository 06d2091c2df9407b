"""`bench/peers.py`: a level's throughput over its slices, whole-run and steady."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _peers():
    sys.path.insert(0, str(BENCH))
    import peers

    return peers


def _user(starts: list[float], seconds: float, tokens: int = 11) -> list[dict]:
    return [
        dict(t_start=t, t_end=t + seconds, output_tokens=tokens, ttft_s=0.0, tpot_s=0.1, error=None)
        for t in starts
    ]


def test_level_row_adds_the_slices_steady_windows():
    peers = _peers()
    # Slice 1: two users, 10 and 5 tok/s, window [1, 4] (38 tokens, as in the loadtest test).
    one = _user([0.0, 1.0, 2.0], 1.0) + _user([0.0, 2.0, 4.0], 2.0)
    # Slice 2: the same users in lockstep at 10 tok/s: window [1, 2], 2 x 10 tokens + 2 firsts.
    two = _user([10.0, 11.0, 12.0], 1.0) + _user([10.0, 11.0, 12.0], 1.0)
    arm = peers.Arm("ours_dx", slices=[one, two])
    row = peers.level_row(arm, 2)
    # Whole run: 132 tokens over 6 + 3 seconds of slices.
    assert row.stats.output_tok_s == pytest.approx(132 / 9)
    assert row.stats.steady_tok_s == pytest.approx((38 + 22) / (3 + 1))


def test_a_level_too_short_for_a_steady_window_reports_none():
    peers = _peers()
    arm = peers.Arm("ours_plain", slices=[_user([0.0], 1.0) + _user([0.0], 1.0)])
    assert peers.level_row(arm, 2).stats.steady_tok_s is None
