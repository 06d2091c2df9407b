from dataclasses import replace

import pytest

from dflash_sglang.server.stats import (
    Snapshot,
    oldest_within_steps,
    series,
    snapshot_from_samples,
    summarize,
)


def _samples(
    drafts, accepted, per_pos, generated, steps=None, plain=0, suffix=(0, 0), shared=(0, 0)
):
    """One scrape: `drafts`/`accepted` by the DFlash block, `suffix` and `shared` =
    (drafts, accepted) by the own-text and shared lookups, `plain` request-steps at width 1
    (one request per step)."""
    request_steps = drafts + suffix[0] + shared[0] + plain
    lookups = {"suffix": suffix, "shared": shared}
    return [
        ("dflash_num_drafts_total", {"source": "dflash"}, drafts),
        ("dflash_num_draft_tokens_total", {"source": "dflash"}, drafts * 3),
        ("dflash_num_accepted_tokens_total", {"source": "dflash"}, accepted),
        *[("dflash_num_drafts_total", {"source": k}, v[0]) for k, v in lookups.items()],
        *[("dflash_num_draft_tokens_total", {"source": k}, v[0] * 3) for k, v in lookups.items()],
        *[("dflash_num_accepted_tokens_total", {"source": k}, v[1]) for k, v in lookups.items()],
        *[
            ("dflash_num_accepted_tokens_per_pos_total", {"position": str(k)}, v)
            for k, v in enumerate(per_pos)
        ],
        ("dflash_num_request_steps_total", {}, request_steps),
        ("dflash_num_steps_total", {}, request_steps if steps is None else steps),
        ("dflash_num_plain_steps_total", {}, plain),
        ("dflash_step_verify_width_sum", {}, 4.0 * (drafts + suffix[0] + shared[0]) + plain),
        ("dflash_step_verify_width_count", {}, request_steps if steps is None else steps),
        ("sglang:generation_tokens_total", {"model_name": "m"}, generated),
        ("dflash_verify_width", {}, 4.0),
        ("dflash_suffix_shared_tokens", {}, 1000.0),
    ]


def test_since_start_and_window():
    old = snapshot_from_samples(_samples(10, 12, [8, 3, 1], 40), now=100.0)
    new = snapshot_from_samples(_samples(30, 22, [16, 5, 1], 100), now=110.0)
    start = summarize(new, None)
    assert start["tau"] == pytest.approx(1 + 22 / 30)
    assert start["acceptance_rate"] == pytest.approx(22 / 90)
    assert start["acceptance_by_position"] == pytest.approx([16 / 30, 5 / 30, 1 / 30])
    assert start["output_tokens_per_s"] is None and start["verify_width"] == 4.0
    assert start["suffix_shared_tokens"] == 1000.0
    window = summarize(new, old)
    assert window["request_steps"] == 20
    assert window["tau"] == pytest.approx(1 + 10 / 20)
    assert window["acceptance_by_position"] == pytest.approx([8 / 20, 2 / 20, 0.0])
    # With speculation, tokens/s counts what steps emit (request-steps + accepted).
    assert window["output_tokens_per_s"] == pytest.approx((20 + 10) / 10)
    assert window["mean_verify_width"] == 4.0 and window["speculation_off_share"] == 0.0


def test_tau_per_source_plain_steps_and_mean_width():
    old = snapshot_from_samples(_samples(10, 5, [5], 0), now=0.0)
    new = snapshot_from_samples(
        _samples(20, 10, [12], 0, plain=10, suffix=(10, 20), shared=(5, 5)), now=10.0
    )
    window = summarize(new, old)
    assert window["tau_by_source"] == {"dflash": 1.5, "suffix": 3.0, "shared": 2.0, "tree": None}
    assert window["drafts_by_source"] == {"dflash": 10, "suffix": 10, "shared": 5, "tree": 0}
    assert window["tau"] == pytest.approx(1 + 30 / 25)
    # 35 steps: 25 at width 4, 10 at width 1 (speculation off).
    assert window["mean_verify_width"] == pytest.approx(110 / 35)
    assert window["speculation_off_share"] == pytest.approx(10 / 35)
    # Every request-step emits its accepted tokens plus a bonus, width 1 included.
    assert window["output_tokens_per_s"] == pytest.approx((35 + 30) / 10)


def test_what_the_planner_expected_beside_tau_per_source():
    expected = [
        ("dflash_predicted_accepted_tokens_total", {"source": "dflash"}, 16.0),
        ("dflash_predicted_accepted_tokens_total", {"source": "suffix"}, 15.0),
    ]
    samples = _samples(20, 10, [12], 0, suffix=(10, 20)) + expected
    start = summarize(snapshot_from_samples(samples, now=1.0), None)
    assert start["tau_by_source"]["dflash"] == 1.5 and start["tau_by_source"]["suffix"] == 3.0
    assert start["predicted_tau_by_source"] == {
        "dflash": 1.8,
        "suffix": 2.5,
        "shared": None,
        "tree": None,
    }


def test_window_picks_the_latest_snapshot_far_enough_back():
    history = [Snapshot(time=t, request_steps=d) for t, d in [(1, 0), (2, 50), (3, 90), (4, 99)]]
    new = Snapshot(time=5, request_steps=100)
    assert oldest_within_steps(history, new, 10).request_steps == 90
    assert oldest_within_steps(history, new, 60).request_steps == 0
    assert oldest_within_steps(history, new, 1000).request_steps == 0
    assert oldest_within_steps([], new, 10) is None


def test_nothing_drafted_gives_no_ratios():
    empty = summarize(Snapshot(time=1.0), None)
    assert empty["tau"] is None and empty["acceptance_rate"] is None
    assert empty["tau_by_source"] == dict.fromkeys(("dflash", "suffix", "shared", "tree"))


def test_series_rates_between_recorded_snapshots():
    busy = Snapshot(
        time=2.0,
        drafts=4,
        accepted=6,
        request_steps=6,
        steps=6,
        plain_steps=2,
        width_sum=18,
        width_count=6,
        generated_tokens=30,
    )
    snaps = [
        Snapshot(time=0.0),
        Snapshot(time=1.0, drafts=2, accepted=2, request_steps=2, generated_tokens=10),
        busy,
        replace(busy, time=5.0),  # then idle: no counter moved
    ]
    points = series(snaps, step_s=2.0)
    assert [p["time"] for p in points] == [2.0, 5.0]
    assert points[0]["output_tokens_per_s"] == pytest.approx((6 + 6) / 2)
    assert points[0]["tau"] == pytest.approx(1 + 6 / 4)
    assert points[0]["mean_verify_width"] == 3.0
    assert points[0]["speculation_off_share"] == pytest.approx(2 / 6)
    assert points[1] == {
        "time": 5.0,
        "output_tokens_per_s": 0.0,
        "tau": None,
        "mean_verify_width": None,
        "speculation_off_share": None,
    }
    assert series(snaps[:1], step_s=1.0) == []


def test_without_speculation_tokens_come_from_the_generation_counter():
    old, new = Snapshot(time=0.0, generated_tokens=5), Snapshot(time=4.0, generated_tokens=25)
    assert summarize(new, old)["output_tokens_per_s"] == pytest.approx(5.0)


def _step_times(steps_w1, steps_w4):
    """Step-time histogram samples: width-1 steps of 20 ms predicted at 25, width-4 drafting
    steps of 30 ms predicted at 25."""
    rows = {("1", "off"): (steps_w1, 0.020, 0.025), ("4", "on"): (steps_w4, 0.030, 0.025)}
    return [
        sample
        for (width, drafter), (n, measured, predicted) in rows.items()
        for sample in (
            ("dflash_step_seconds_count", {"width": width, "drafter": drafter}, n),
            ("dflash_step_seconds_sum", {"width": width, "drafter": drafter}, n * measured),
            (
                "dflash_predicted_step_seconds_sum",
                {"width": width, "drafter": drafter},
                n * predicted,
            ),
        )
    ]


def test_step_time_by_option_over_the_window():
    old = snapshot_from_samples(_samples(10, 5, [5], 0) + _step_times(0, 10), now=0.0)
    new = snapshot_from_samples(_samples(20, 10, [12], 0) + _step_times(5, 10), now=10.0)
    plain = {"steps": 5, "measured_ms": 20.0, "predicted_ms": 25.0}
    since_start = summarize(new, None)["step_time_by_option"]
    assert list(since_start) == ["w1", "w4+draft"]
    assert since_start["w1"] == pytest.approx(plain)
    assert since_start["w4+draft"] == pytest.approx(
        {"steps": 10, "measured_ms": 30.0, "predicted_ms": 25.0}
    )
    window = summarize(new, old)["step_time_by_option"]  # only plain-decoding steps ran in it
    assert list(window) == ["w1"] and window["w1"] == pytest.approx(plain)
