from dataclasses import asdict

import pytest

from dflash_sglang.metrics import step_stats


def test_step_stats_count_like_vllm():
    stats = step_stats([3, 0, 1], verify_width=4)
    assert asdict(stats) == {
        "num_drafts": 3,
        "num_draft_tokens": 9,
        "num_accepted_tokens": 4,
        "accepted_per_pos": [2, 1, 1],
    }
    assert stats.mean_acceptance_length == pytest.approx(1 + 4 / 3)


def test_per_position_counts_never_increase_and_sum_to_accepted():
    stats = step_stats([5, 2, 7, 0, 7], verify_width=8)
    pos = stats.accepted_per_pos
    assert all(a >= b for a, b in zip(pos, pos[1:], strict=False))
    assert sum(pos) == stats.num_accepted_tokens


def test_empty_step_and_bad_input():
    assert step_stats([], verify_width=16).mean_acceptance_length == 1.0
    with pytest.raises(ValueError, match="accepted 4 drafts of 3"):
        step_stats([4], verify_width=4)
