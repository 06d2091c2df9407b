"""Offline τ of suffix lookup, own text alone vs with a shared index over other requests'
outputs, replaying the target's own greedy outputs (no model runs: seconds, not a server).

Each held-out set is replayed in order, as requests finishing one after another; with a
shared index each finished output joins it. `--warm` first fills the shared index with
other traffic (e.g. the training set's regenerated ShareGPT replies), as a server that has
been up a while would have.

    python bench/replay_suffix.py --heldout bench/drafter/heldout_greedy.jsonl.gz \
        --warm bench/drafter/data.jsonl.gz --capacities 0,16384,65536,262144
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

from dflash_sglang.suffix import SharedSuffixIndex, replay_tau


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def replay(
    records: list[dict], warm: list[dict], capacity: int, max_match: int, max_proposal: int
) -> dict[str, dict[str, float]]:
    """Per source set: step-weighted τ and share of steps with a proposal."""
    shared = SharedSuffixIndex(capacity, max_match, max_proposal) if capacity else None
    for r in warm if shared is not None else ():
        shared.add(r["prompt_ids"], r["response_ids"])
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # tokens, steps, proposed
    for r in records:
        out = r["response_ids"]
        if not out:
            continue
        tau, rate = replay_tau(r["prompt_ids"], out, max_match, max_proposal, shared)
        steps = len(out) / tau
        acc = sums[r["source"]]
        acc[0] += len(out)
        acc[1] += steps
        acc[2] += rate * steps
        if shared is not None:
            shared.add(r["prompt_ids"], out)
    return {s: {"tau": t / n, "proposal_rate": p / n} for s, (t, n, p) in sums.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--heldout", type=Path, required=True, help="JSONL(.gz): prompt_ids, response_ids, source"
    )
    parser.add_argument("--warm", type=Path, help="JSONL(.gz) of other traffic, added first")
    parser.add_argument("--warm-limit", type=int, default=0, help="the last N warm records")
    parser.add_argument(
        "--capacities", default="0,65536", help="shared index sizes in tokens; 0: own text only"
    )
    parser.add_argument("--max-match", type=int, default=4)
    parser.add_argument("--max-proposal", type=int, default=15)
    parser.add_argument(
        "--max-output-tokens",
        type=int,
        default=0,
        help="replay only each output's first N tokens, as a server capping replies at N",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.max_output_tokens < 0:
        parser.error("--max-output-tokens must be >= 0 (0: whole outputs)")
    records = read_jsonl(args.heldout)
    if args.max_output_tokens:
        cap = args.max_output_tokens
        records = [{**r, "response_ids": r["response_ids"][:cap]} for r in records]
    warm = read_jsonl(args.warm) if args.warm else []
    warm = warm[-args.warm_limit :] if args.warm_limit else warm
    results = {}
    for capacity in (int(c) for c in args.capacities.split(",")):
        results[capacity] = replay(records, warm, capacity, args.max_match, args.max_proposal)
        row = "  ".join(
            f"{s} τ {v['tau']:.2f} ({v['proposal_rate']:.0%})" for s, v in results[capacity].items()
        )
        print(f"shared capacity {capacity:>7}: {row}", flush=True)
    if args.out:
        recorded = {k: str(v) for k, v in vars(args).items() if k != "out"}
        args.out.write_text(json.dumps({"args": recorded, "results": results}, indent=1))


if __name__ == "__main__":
    main()
