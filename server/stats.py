"""`GET /dflash/stats`: τ, per-position acceptance, tokens/s and verify width, as JSON.

`GET /dflash/stats/series` gives throughput and τ over time for the status page.

Computed in the HTTP process from the same Prometheus counters the scheduler exports
(`dflash_sglang.metrics`), read from SGLang's multiprocess metric files, so the JSON and
any dashboard agree by construction. A sampler keeps recent snapshots so a request can ask
for the last N request-steps as well as everything since start.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Query

from dflash_sglang import metrics
from dflash_sglang.proposals import SOURCES

logger = logging.getLogger(__name__)

GENERATED_TOKENS = "sglang:generation_tokens_total"
SAMPLE_INTERVAL_S = 1.0
HISTORY = 3600


@dataclass(frozen=True)
class Snapshot:
    time: float
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    drafts_by_source: dict[str, float] = field(default_factory=dict)
    accepted_by_source: dict[str, float] = field(default_factory=dict)
    predicted_by_source: dict[str, float] = field(default_factory=dict)  # planner's expectation
    request_steps: float = 0.0
    steps: float = 0.0
    plain_steps: float = 0.0
    width_sum: float = 0.0  # the per-step verify width histogram's sum and count
    width_count: float = 0.0
    generated_tokens: float = 0.0
    verify_width: float | None = None
    shared_tokens: float | None = None  # the shared suffix lookup's size (a gauge)
    step_time: dict[str, dict] = field(default_factory=dict)  # `metrics.step_time_sums`

    def tokens_since(self, old: Snapshot) -> float:
        """Output tokens after `old`. SGLang's generation counter moves only when a request
        finishes; each speculative request-step emits accepted + 1 tokens as it happens, so
        with speculation on the step counters give a rate that does not jump at request ends."""
        if self.request_steps > 0:
            return (self.request_steps + self.accepted) - (old.request_steps + old.accepted)
        return self.generated_tokens - old.generated_tokens


_TOTALS = {
    metrics.DRAFTS: "drafts",
    metrics.DRAFT_TOKENS: "draft_tokens",
    metrics.ACCEPTED: "accepted",
    metrics.REQUEST_STEPS: "request_steps",
    metrics.STEPS: "steps",
    metrics.PLAIN_STEPS: "plain_steps",
    metrics.STEP_WIDTH + "_sum": "width_sum",
    metrics.STEP_WIDTH + "_count": "width_count",
    GENERATED_TOKENS: "generated_tokens",
}


_GAUGES = {metrics.VERIFY_WIDTH: "verify_width", metrics.SHARED_TOKENS: "shared_tokens"}


def snapshot_from_samples(samples: list[tuple[str, dict, float]], now: float) -> Snapshot:
    """Fold Prometheus samples (name, labels, value) into one snapshot; labels are summed."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    by_source: dict[str, dict[str, float]] = {
        metrics.DRAFTS: {},
        metrics.ACCEPTED: {},
        metrics.PREDICTED_ACCEPTED: {},
    }
    gauges: dict[str, float] = {}
    for name, labels, value in samples:
        if name == metrics.ACCEPTED_PER_POS:
            k = int(labels["position"])
            per_pos[k] = per_pos.get(k, 0.0) + value
        elif name in _GAUGES:
            gauges[_GAUGES[name]] = value
        elif name in _TOTALS:
            totals[_TOTALS[name]] = totals.get(_TOTALS[name], 0.0) + value
        if name in by_source and "source" in labels:
            source = by_source[name]
            source[labels["source"]] = source.get(labels["source"], 0.0) + value
    return Snapshot(
        time=now,
        step_time=metrics.step_time_sums(samples),
        accepted_per_pos=per_pos,
        drafts_by_source=by_source[metrics.DRAFTS],
        accepted_by_source=by_source[metrics.ACCEPTED],
        predicted_by_source=by_source[metrics.PREDICTED_ACCEPTED],
        **gauges,
        **totals,
    )


def _delta(new: dict[str, float], old: dict[str, float], key: str) -> float:
    return new.get(key, 0.0) - old.get(key, 0.0)


def _mean_width(new: Snapshot, old: Snapshot) -> float | None:
    """Over the histogram's own count: a scrape never splits one observation's sum and count
    by a whole step, as it can split two counters the step bumps one after the other."""
    count = new.width_count - old.width_count
    return (new.width_sum - old.width_sum) / count if count else None


def _step_time(new: Snapshot, old: Snapshot) -> dict[str, dict]:
    """Mean measured and predicted step time per option over (old, new]."""
    zero = {"steps": 0.0, "measured": 0.0, "predicted": 0.0}
    sums = {
        option: {k: v - old.step_time.get(option, zero)[k] for k, v in row.items()}
        for option, row in new.step_time.items()
    }
    return metrics.step_time_means(sums)


def _tau_by_source(
    new: Snapshot, old: Snapshot, accepted: dict[str, float], accepted_old: dict[str, float]
) -> dict[str, float | None]:
    """τ per source over (old, new] with `accepted` tokens per source (accepted, or expected)."""
    return {
        source: metrics.tau(
            _delta(accepted, accepted_old, source),
            _delta(new.drafts_by_source, old.drafts_by_source, source),
        )
        for source in SOURCES
    }


def summarize(new: Snapshot, old: Snapshot | None) -> dict:
    """Stats over (old, new]; with no `old`, since start. τ includes the bonus token."""
    base = old or Snapshot(time=new.time)
    drafts = new.drafts - base.drafts
    accepted = new.accepted - base.accepted
    draft_tokens = new.draft_tokens - base.draft_tokens
    steps = new.steps - base.steps
    seconds = new.time - base.time
    positions = sorted(new.accepted_per_pos)

    return {
        "request_steps": new.request_steps - base.request_steps,
        "tau": metrics.tau(accepted, drafts),
        "tau_by_source": _tau_by_source(new, base, new.accepted_by_source, base.accepted_by_source),
        # What the adaptive planner expected of the proposals it chose (its estimates' bias)
        "predicted_tau_by_source": _tau_by_source(
            new, base, new.predicted_by_source, base.predicted_by_source
        ),
        "drafts_by_source": {
            source: _delta(new.drafts_by_source, base.drafts_by_source, source)
            for source in SOURCES
        },
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "acceptance_by_position": [
            (new.accepted_per_pos[k] - base.accepted_per_pos.get(k, 0.0)) / drafts
            if drafts
            else None
            for k in positions
        ],
        "output_tokens": new.generated_tokens - base.generated_tokens,
        "output_tokens_per_s": (
            new.tokens_since(base) / seconds if old is not None and seconds > 0 else None
        ),
        "seconds": seconds if old is not None else None,
        "verify_width": new.verify_width,
        "suffix_shared_tokens": new.shared_tokens,
        "mean_verify_width": _mean_width(new, base),
        "speculation_off_share": (new.plain_steps - base.plain_steps) / steps if steps else None,
        "step_time_by_option": _step_time(new, base),
    }


def oldest_within_steps(history: list[Snapshot], new: Snapshot, steps: int) -> Snapshot | None:
    """The latest snapshot at least `steps` request-steps before `new` (else the oldest)."""
    for snap in reversed(history):
        if new.request_steps - snap.request_steps >= steps:
            return snap
    return history[0] if history else None


def series(snapshots: list[Snapshot], step_s: float) -> list[dict]:
    """Per interval of at least `step_s` seconds, oldest first: throughput, τ, mean verify
    width and the share of steps with speculation off.

    Intervals are measured between recorded snapshots, so a missed sample widens one
    interval instead of inventing a spike.
    """
    points: list[dict] = []
    start = snapshots[0] if snapshots else None
    for snap in snapshots[1:]:
        seconds = snap.time - start.time
        if seconds < step_s:
            continue
        steps = snap.steps - start.steps
        points.append(
            {
                "time": snap.time,
                "output_tokens_per_s": snap.tokens_since(start) / seconds,
                "tau": metrics.tau(snap.accepted - start.accepted, snap.drafts - start.drafts),
                "mean_verify_width": _mean_width(snap, start),
                "speculation_off_share": (
                    (snap.plain_steps - start.plain_steps) / steps if steps else None
                ),
            }
        )
        start = snap
    return points


def read_snapshot() -> Snapshot:
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])
    samples = [
        (s.name, s.labels, s.value)
        for family in registry.collect()
        for s in family.samples
        if s.name.startswith("dflash_") or s.name == GENERATED_TOKENS
    ]
    return snapshot_from_samples(samples, time.time())


class StatsHistory:
    """Snapshots taken every second by a daemon thread, from launch on, for windowed stats."""

    def __init__(self) -> None:
        self.snapshots: deque[Snapshot] = deque(maxlen=HISTORY)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dflash-stats", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        failing = False
        while True:
            try:
                # SGLang sets the directory while launching, after we are installed.
                if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
                    self.record(read_snapshot())
                failing = False
            except Exception:  # noqa: BLE001 - a bad scrape must not end the sampler
                if not failing:  # once per outage, not once a second
                    logger.exception("dflash stats: reading the metric files failed")
                failing = True
            time.sleep(SAMPLE_INTERVAL_S)

    def record(self, snap: Snapshot) -> None:
        with self._lock:
            self.snapshots.append(snap)

    def series(self, seconds: float, step_s: float) -> list[dict]:
        with self._lock:
            recent = [s for s in self.snapshots if s.time >= time.time() - seconds - step_s]
        return series(recent, step_s)

    def report(self, window_steps: int) -> dict:
        now = read_snapshot()
        with self._lock:
            history = list(self.snapshots)
        return {
            "since_start": summarize(now, None),
            "window": {
                "requested_steps": window_steps,
                **summarize(now, oldest_within_steps(history, now, window_steps)),
            },
        }


METRICS_OFF = {"error": "metrics are disabled (start with --enable-metrics)"}


def install(app: FastAPI) -> None:
    """Add `/dflash/stats[/series]` to SGLang's app; they need metrics enabled for data."""
    history = StatsHistory()
    history.start()
    router = APIRouter(prefix="/dflash")

    @router.get("/stats")
    def stats(window_steps: int = Query(100, ge=1, le=10_000_000)) -> dict:
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return METRICS_OFF
        return history.report(window_steps)

    @router.get("/stats/series")
    def stats_series(
        seconds: float = Query(600.0, gt=0, le=HISTORY * SAMPLE_INTERVAL_S),
        step_s: float = Query(5.0, ge=SAMPLE_INTERVAL_S, le=600.0),
    ) -> dict:
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return METRICS_OFF
        return {"step_s": step_s, "points": history.series(seconds, step_s)}

    app.include_router(router)
