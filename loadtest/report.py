"""A sweep's rows (one per server × level) and their CSV and JSON files."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .level_stats import LevelStats

CSV_COLUMNS = [
    "server", "concurrency", "requests", "errors", "unfinished", "duration_s",
    "output_tokens", "output_tok_s", "steady_tok_s", "speedup", "mean_output_tokens",
    "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "tau", "no_text",
]  # fmt: skip


@dataclass
class LevelRow:
    """One server at one concurrency level. `speedup`: this server's output tok/s over the
    baseline's at the same level (None on the baseline's own rows)."""

    server: str
    url: str
    concurrency: int
    planned: int
    stats: LevelStats
    tau: float | None
    metrics_delta: dict[str, float] | None  # None: the server exports no /metrics
    gauges_after: dict[str, float] | None
    records_file: str
    speedup: float | None = None

    def flat(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "concurrency": self.concurrency,
            **asdict(self.stats),
            "tau": self.tau,
            "speedup": self.speedup,
        }


def set_speedups(rows: list[LevelRow], baseline: str) -> None:
    """Every server's output tok/s over the baseline's at the same level."""
    base = {r.concurrency: r.stats.output_tok_s for r in rows if r.server == baseline}
    for row in rows:
        if row.server != baseline and base.get(row.concurrency):
            row.speedup = row.stats.output_tok_s / base[row.concurrency]


def write_csv(rows: list[LevelRow], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(v) for k, v in row.flat().items()})


def write_json(rows: list[LevelRow], config: dict[str, Any], path: Path) -> None:
    levels = [
        row.flat()
        | {
            "url": row.url,
            "planned": row.planned,
            "records_file": row.records_file,
            "metrics_delta": row.metrics_delta,
            "gauges_after": row.gauges_after,
        }
        for row in rows
    ]
    path.write_text(json.dumps({"config": config, "levels": levels}, indent=2) + "\n")


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else value
