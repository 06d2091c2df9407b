import pytest

from dflash_sglang.server.stats import (
    Snapshot,
    oldest_within_steps,
    series,
    snapshot_from_samples,
    summarize,
)


def _samples(drafts, accepted, per_pos, generated):
    return [
        ("dflash_num_drafts_total", {}, drafts),
        ("dflash_num_draft_tokens_total", {}, drafts * 3),
        ("dflash_num_accepted_tokens_total", {}, accepted),
        *[
            ("dflash_num_accepted_tokens_per_pos_total", {"position": str(k)}, v)
            for k, v in enumerate(per_pos)
        ],
        ("sglang:generation_tokens_total", {"model_name": "m"}, generated),
        ("dflash_verify_width", {}, 4.0),
    ]


def test_since_start_and_window():
    old = snapshot_from_samples(_samples(10, 12, [8, 3, 1], 40), now=100.0)
    new = snapshot_from_samples(_samples(30, 22, [16, 5, 1], 100), now=110.0)
    start = summarize(new, None)
    assert start["tau"] == pytest.approx(1 + 22 / 30)
    assert start["acceptance_rate"] == pytest.approx(22 / 90)
    assert start["acceptance_by_position"] == pytest.approx([16 / 30, 5 / 30, 1 / 30])
    assert start["output_tokens_per_s"] is None and start["verify_width"] == 4.0
    window = summarize(new, old)
    assert window["request_steps"] == 20
    assert window["tau"] == pytest.approx(1 + 10 / 20)
    assert window["acceptance_by_position"] == pytest.approx([8 / 20, 2 / 20, 0.0])
    # With speculation, tokens/s counts what steps emit (drafts + accepted), not finishes.
    assert window["output_tokens_per_s"] == pytest.approx((20 + 10) / 10)


def test_window_picks_the_latest_snapshot_far_enough_back():
    history = [Snapshot(time=t, drafts=d) for t, d in [(1, 0), (2, 50), (3, 90), (4, 99)]]
    new = Snapshot(time=5, drafts=100)
    assert oldest_within_steps(history, new, 10).drafts == 90
    assert oldest_within_steps(history, new, 60).drafts == 0
    assert oldest_within_steps(history, new, 1000).drafts == 0
    assert oldest_within_steps([], new, 10) is None


def test_nothing_drafted_gives_no_ratios():
    empty = summarize(Snapshot(time=1.0), None)
    assert empty["tau"] is None and empty["acceptance_rate"] is None


def test_series_rates_between_recorded_snapshots():
    snaps = [
        Snapshot(time=0.0),
        Snapshot(time=1.0, drafts=2, accepted=2, generated_tokens=10),
        Snapshot(time=2.0, drafts=4, accepted=6, generated_tokens=30),
        Snapshot(time=5.0, drafts=4, accepted=6, generated_tokens=30),
    ]
    points = series(snaps, step_s=2.0)
    assert [p["time"] for p in points] == [2.0, 5.0]
    assert points[0]["output_tokens_per_s"] == pytest.approx((4 + 6) / 2)
    assert points[0]["tau"] == pytest.approx(1 + 6 / 4)
    assert points[1] == {"time": 5.0, "output_tokens_per_s": 0.0, "tau": None}
    assert series(snaps[:1], step_s=1.0) == []


def test_without_speculation_tokens_come_from_the_generation_counter():
    old, new = Snapshot(time=0.0, generated_tokens=5), Snapshot(time=4.0, generated_tokens=25)
    assert summarize(new, old)["output_tokens_per_s"] == pytest.approx(5.0)
