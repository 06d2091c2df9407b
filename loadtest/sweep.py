"""Throughput and latency versus concurrency, DFlash against a baseline on the same charts.

    python -m loadtest.sweep --url http://127.0.0.1:30000 --baseline-url http://127.0.0.1:30001
        --concurrency 1,2,4,8,16,32 --out results/

For each level, for each server in turn (so machine noise hits both alike): scrape
`/metrics`, run a headless locust with exactly `concurrency` users for a fixed request
count (time-limited), scrape again. Writes `sweep.csv`, `sweep.json`, the PNG charts, and
under `raw/` each level's prompts, per-request records (JSONL), locust log and CSV.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import requests

from . import prompt_sets, server_metrics
from .level_stats import summarize
from .locust_runner import LevelPlan, run_level
from .plots import write_plots
from .report import LevelRow, set_speedups, write_csv, write_json
from .server_probe import warm_up
from .sweep_args import parse_args


def requests_for(args: argparse.Namespace, concurrency: int) -> int:
    n, per_user = args.requests_per_level
    return n * concurrency if per_user else n


def run_sweep(args: argparse.Namespace) -> list[LevelRow]:
    raw = args.out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    prompts = prompt_sets.load_prompts(
        args.dataset, seed=args.seed, max_chars=args.max_prompt_chars
    )
    for url, model in args.servers.values():
        warm_up(url, model, args.warmup_requests, timeout_s=args.max_seconds_per_level)
    config = _config(args, num_prompts=len(prompts))
    rows: list[LevelRow] = []
    offset = 0
    for concurrency in args.concurrency:
        planned = requests_for(args, concurrency)
        prompts_file = raw / f"prompts_c{concurrency}.json"
        prompts_file.write_text(json.dumps(prompt_sets.level_prompts(prompts, offset, planned)))
        offset += planned
        for label, (url, model) in args.servers.items():
            plan = LevelPlan(
                url, model, concurrency, planned, args.max_tokens, args.ignore_eos,
                args.extra_body, args.max_seconds_per_level,
            )  # fmt: skip
            records_file = raw / f"{label}_c{concurrency}.jsonl"
            rows.append(_measure(label, plan, prompts_file, records_file, args.out))
            print(_progress(rows[-1]), flush=True)
        set_speedups(rows, args.baseline_label)
        write_csv(rows, args.out / "sweep.csv")
        write_json(rows, config, args.out / "sweep.json")
    write_plots(rows, args.out)
    return rows


def _measure(
    label: str, plan: LevelPlan, prompts_file: Path, records_file: Path, out: Path
) -> LevelRow:
    before = server_metrics.scrape(plan.url)
    records = run_level(plan, prompts_file, records_file)
    after = server_metrics.scrape(plan.url)
    deltas = server_metrics.counter_deltas(before, after) if before and after else None
    return LevelRow(
        server=label,
        url=plan.url,
        concurrency=plan.concurrency,
        planned=plan.num_requests,
        stats=summarize(records, plan.num_requests, plan.concurrency),
        tau=server_metrics.tau(deltas) if deltas is not None else None,
        metrics_delta=deltas,
        gauges_after=after.gauges if after else None,
        records_file=str(records_file.relative_to(out)),
    )


def _progress(row: LevelRow) -> str:
    s = row.stats
    fields = [
        f"c={row.concurrency:<3} {row.server:<10} {s.requests} req ({s.errors} err)",
        f"{s.output_tok_s:8.1f} tok/s",
        f"TTFT p50 {_ms(s.ttft_p50_ms)}",
        f"TPOT p50 {_ms(s.tpot_p50_ms)}",
        f"tau {row.tau:.2f}" if row.tau is not None else "tau -",
    ]
    return " | ".join(fields)


def _ms(value: float | None) -> str:
    return f"{value:7.1f} ms" if value is not None else "      - ms"


def _config(args: argparse.Namespace, num_prompts: int) -> dict[str, Any]:
    keys = ("concurrency", "max_tokens", "ignore_eos", "extra_body", "dataset",
            "max_prompt_chars", "seed", "warmup_requests", "max_seconds_per_level")  # fmt: skip
    n, per_user = args.requests_per_level
    return {k: getattr(args, k) for k in keys} | {
        "servers": {label: {"url": u, "model": m} for label, (u, m) in args.servers.items()},
        "measured": [args.label, *(label for label, _ in args.also)],
        "baseline": args.baseline_label if args.baseline_url else None,
        "requests_per_level": f"{n}x" if per_user else n,
        "num_prompts": num_prompts,
        "started_unix": time.time(),
    }


def _problems(rows: list[LevelRow]) -> list[str]:
    return [
        f"c={r.concurrency} {r.server}: {r.stats.errors} failed, {r.stats.unfinished} unfinished"
        for r in rows
        if r.stats.errors or r.stats.unfinished
    ] + [
        f"c={r.concurrency} {r.server}: {r.stats.no_text} requests streamed no text, so their "
        "TTFT/TPOT are unknown (special tokens only? try --extra-body "
        "'{\"skip_special_tokens\": false}')"
        for r in rows
        if r.stats.no_text
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, description=__doc__)
    try:
        rows = run_sweep(args)
    except (RuntimeError, requests.RequestException) as e:  # reports so far are kept
        print(f"sweep failed: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}/sweep.csv, sweep.json, sweep.png (+ one PNG per panel)")
    problems = _problems(rows)
    for line in problems:
        print("WARNING:", line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
