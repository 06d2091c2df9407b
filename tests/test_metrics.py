from dataclasses import asdict

import pytest

from dflash_sglang.metrics import step_stats, step_time_means, step_time_sums


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


def test_step_time_per_option_summed_over_processes():
    # width, drafter, process: steps, measured seconds, predicted seconds (summed)
    series = {
        ("4", "on", "0"): (3.0, 0.09, 0.075),
        ("4", "on", "1"): (1.0, 0.03, 0.025),
        ("16", "off", "0"): (2.0, 0.05, 0.04),
        ("1", "off", "0"): (10.0, 0.2, 0.25),
        ("2", "off", "0"): (0.0, 0.0, 0.0),  # never taken
    }
    names = ("dflash_step_seconds_count", "dflash_step_seconds_sum")
    names += ("dflash_predicted_step_seconds_sum",)
    samples = [
        (name, {"width": width, "drafter": drafter, "proc": proc}, value)
        for (width, drafter, proc), values in series.items()
        for name, value in zip(names, values, strict=True)
    ]
    samples += [
        ("dflash_step_seconds_bucket", {"width": "1", "drafter": "off", "le": "0.05"}, 10.0),
        ("dflash_predicted_step_seconds_count", {"width": "1", "drafter": "off"}, 10.0),
        ("dflash_num_steps_total", {}, 16.0),
    ]
    sums = step_time_sums(samples)
    assert sums["w4+draft"] == pytest.approx({"steps": 4.0, "measured": 0.12, "predicted": 0.1})
    means = step_time_means(sums)
    assert list(means) == ["w1", "w4+draft", "w16"]  # by width; untaken options left out
    assert means["w4+draft"] == pytest.approx(
        {"steps": 4.0, "measured_ms": 30.0, "predicted_ms": 25.0}
    )
    assert means["w1"] == pytest.approx({"steps": 10.0, "measured_ms": 20.0, "predicted_ms": 25.0})
