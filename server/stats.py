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
    generated_tokens: float = 0.0
    verify_width: float | None = None

    def tokens_since(self, old: Snapshot) -> float:
        """Output tokens after `old`. SGLang's generation counter moves only when a request
        finishes; each speculative step emits accepted + 1 tokens as it happens, so with
        speculation on the step counters give a rate that does not jump at request ends."""
        if self.drafts > 0:
            return (self.drafts + self.accepted) - (old.drafts + old.accepted)
        return self.generated_tokens - old.generated_tokens


def snapshot_from_samples(samples: list[tuple[str, dict, float]], now: float) -> Snapshot:
    """Fold Prometheus samples (name, labels, value) into one snapshot; labels are summed."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    width = None
    for name, labels, value in samples:
        if name == "dflash_num_accepted_tokens_per_pos_total":
            k = int(labels["position"])
            per_pos[k] = per_pos.get(k, 0.0) + value
        elif name == "dflash_verify_width":
            width = value
        else:
            totals[name] = totals.get(name, 0.0) + value
    return Snapshot(
        time=now,
        drafts=totals.get("dflash_num_drafts_total", 0.0),
        draft_tokens=totals.get("dflash_num_draft_tokens_total", 0.0),
        accepted=totals.get("dflash_num_accepted_tokens_total", 0.0),
        accepted_per_pos=per_pos,
        generated_tokens=totals.get(GENERATED_TOKENS, 0.0),
        verify_width=width,
    )


def summarize(new: Snapshot, old: Snapshot | None) -> dict:
    """Stats over (old, new]; with no `old`, since start. τ includes the bonus token."""
    base = old or Snapshot(time=new.time)
    drafts = new.drafts - base.drafts
    accepted = new.accepted - base.accepted
    draft_tokens = new.draft_tokens - base.draft_tokens
    seconds = new.time - base.time
    positions = sorted(new.accepted_per_pos)
    return {
        "request_steps": drafts,
        "tau": 1.0 + accepted / drafts if drafts else None,
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
    }


def oldest_within_steps(history: list[Snapshot], new: Snapshot, steps: int) -> Snapshot | None:
    """The latest snapshot at least `steps` request-steps before `new` (else the oldest)."""
    for snap in reversed(history):
        if new.drafts - snap.drafts >= steps:
            return snap
    return history[0] if history else None


def series(snapshots: list[Snapshot], step_s: float) -> list[dict]:
    """Throughput and τ per interval of at least `step_s` seconds, oldest first.

    Intervals are measured between recorded snapshots, so a missed sample widens one
    interval instead of inventing a spike.
    """
    points: list[dict] = []
    start = snapshots[0] if snapshots else None
    for snap in snapshots[1:]:
        seconds = snap.time - start.time
        if seconds < step_s:
            continue
        drafts = snap.drafts - start.drafts
        points.append(
            {
                "time": snap.time,
                "output_tokens_per_s": snap.tokens_since(start) / seconds,
                "tau": 1.0 + (snap.accepted - start.accepted) / drafts if drafts else None,
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
        while True:
            try:
                # SGLang sets the directory while launching, after we are installed.
                if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
                    self.record(read_snapshot())
            except Exception:  # noqa: BLE001 - a bad scrape must not end the sampler
                logger.exception("dflash stats: reading the metric files failed")
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
