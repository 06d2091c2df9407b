"""One sweep level's client-side numbers, computed exactly from its per-request records."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MIN_STEADY_SECONDS = 2.0  # a shorter steady window says too little to report


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


def steady_window(sent: Sequence[float], users: int) -> tuple[float, float]:
    """(first refill, last send) from the times prompts were sent, in order: the window in
    which every closed-loop user has a request in flight, the opening burst of `users` sends
    behind it and the drain, when users run out of prompts one by one, after it. Empty
    (both ends the last send) when no user sent a second prompt."""
    return sent[min(users, len(sent) - 1)], sent[-1]


def streamed_by(record: dict[str, Any], moment: float) -> float:
    """Output tokens a request had streamed by `moment`, linear from its first token to its
    last (records keep no per-token times)."""
    if record["error"] or record["ttft_s"] is None:
        return 0.0
    first, last, tokens = (
        record["t_start"] + record["ttft_s"],
        record["t_end"],
        record["output_tokens"],
    )
    if moment < first:
        return 0.0
    if moment >= last or last <= first:
        return float(tokens)
    return 1.0 + (tokens - 1) * (moment - first) / (last - first)


def steady(records: Sequence[dict[str, Any]], users: int) -> tuple[float, float]:
    """(tokens, seconds) streamed while every one of `users` closed-loop users had a request
    in flight (`steady_window`): throughput without the opening burst and the drain, whose
    length depends on how far the users' requests drift apart."""
    if not records:
        return 0.0, 0.0
    start, end = steady_window(sorted(r["t_start"] for r in records), users)
    tokens = sum(streamed_by(r, end) - streamed_by(r, start) for r in records)
    return tokens, end - start


@dataclass(frozen=True)
class LevelStats:
    """Throughput is total output tokens over the level's wall time (first request sent to
    last request done); steady throughput the same inside `steady_window` (None when not
    asked for, or when the window is shorter than `MIN_STEADY_SECONDS`); latencies in
    milliseconds over the successful requests."""

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
    steady_tok_s: float | None = None


def steady_rate(tokens: float, seconds: float) -> float | None:
    """Tokens per second over a steady window, None when it is too short to say."""
    return tokens / seconds if seconds >= MIN_STEADY_SECONDS else None


def summarize(
    records: Sequence[dict[str, Any]], planned: int, users: int | None = None
) -> LevelStats:
    """`users`: the closed-loop users that sent `records`, for the steady throughput."""
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
        steady_tok_s=steady_rate(*steady(records, users)) if users else None,
    )
