"""How this machine's speed drifts under a fixed load, inside one process.

    python bench/machine_drift.py [--blocks 30] [--iters 60] [--threads 2] [--out F.json]

One process repeats the same bf16 work — a 30-layer decode-shaped stack of linears at four
rows (the embedded SmolLM2's widths) and its LM head, ~12 ms a pass — and prints the median
milliseconds of every block of `iters` passes. Nothing in it changes between blocks, so
a block that differs from the others measures the machine (another tenant, the host), not
our code. Used to size how far two server processes that take turns can differ (README,
"Benchmark").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HIDDEN, KV, MLP, VOCAB, LAYERS, ROWS = 576, 192, 1536, 49152, 30, 4


def decode_stack() -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor, torch.Tensor]:
    """Per layer fused qkv, o, fused gate-up and down weights; the LM head; four rows."""
    g = torch.Generator().manual_seed(0)

    def weight(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=g, dtype=torch.bfloat16)

    layers = [
        (weight(HIDDEN + 2 * KV, HIDDEN), weight(HIDDEN, HIDDEN), weight(2 * MLP, HIDDEN),
         weight(HIDDEN, MLP))
        for _ in range(LAYERS)
    ]  # fmt: skip
    return layers, weight(VOCAB, HIDDEN), torch.randn(ROWS, HIDDEN, dtype=torch.bfloat16)


def one_pass(layers, head: torch.Tensor, x: torch.Tensor) -> None:
    h = x
    for qkv, o, gate_up, down in layers:
        F.linear(h, qkv)
        h = F.linear(h, o)
        h = F.linear(F.linear(h, gate_up)[:, :MLP], down)
    F.linear(h, head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--iters", type=int, default=60, help="passes per block")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.blocks < 1 or args.iters < 1 or args.threads < 1:
        ap.error("--blocks, --iters and --threads must be positive")
    torch.set_num_threads(args.threads)
    layers, head, x = decode_stack()
    for _ in range(10):
        one_pass(layers, head, x)
    medians = []
    for _ in range(args.blocks):
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            one_pass(layers, head, x)
            times.append(time.perf_counter() - start)
        medians.append(round(1000 * statistics.median(times), 2))
        print(f"{medians[-1]:.2f}", flush=True)
    low, high = min(medians), max(medians)
    print(f"min {low:.2f} max {high:.2f} ms: max/min {high / low:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "block_ms": medians}, indent=1))


if __name__ == "__main__":
    main()
