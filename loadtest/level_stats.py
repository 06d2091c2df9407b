"""One sweep level's client-side numbers, computed exactly from its per-request records."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); None
    for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class LevelStats:
    """Throughput is total output tokens over the level's wall time (first request sent to
    last request done); latencies in milliseconds over the successful requests."""

    requests: int  # finished (ok or failed)
    errors: int
    unfinished: int  # planned but cut off by the level's time limit
    no_text: int  # succeeded but streamed no text (TTFT/TPOT unknown for them)
    duration_s: float
    output_tokens: int
    output_tok_s: float
    mean_output_tokens: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None


def summarize(records: Sequence[dict[str, Any]], planned: int) -> LevelStats:
    ok = [r for r in records if not r["error"]]
    duration = (
        max(r["t_end"] for r in records) - min(r["t_start"] for r in records) if records else 0.0
    )
    tokens = sum(r["output_tokens"] for r in ok)
    ttft_ms = [r["ttft_s"] * 1000 for r in ok if r["ttft_s"] is not None]
    tpot_ms = [r["tpot_s"] * 1000 for r in ok if r["tpot_s"] is not None]
    return LevelStats(
        requests=len(records),
        errors=len(records) - len(ok),
        unfinished=max(planned - len(records), 0),
        no_text=sum(1 for r in ok if r["ttft_s"] is None),
        duration_s=duration,
        output_tokens=tokens,
        output_tok_s=tokens / duration if duration > 0 else 0.0,
        mean_output_tokens=tokens / len(ok) if ok else None,
        ttft_p50_ms=percentile(ttft_ms, 50),
        ttft_p99_ms=percentile(ttft_ms, 99),
        tpot_p50_ms=percentile(tpot_ms, 50),
        tpot_p99_ms=percentile(tpot_ms, 99),
    )
