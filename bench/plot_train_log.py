"""Loss and slot-1 accuracy curves of a training run, from its `train_log.jsonl`.

    python bench/plot_train_log.py RUN/train_log.jsonl --out bench/drafter/loss_curve.png

Per-step values are noisy (4 sequences x 32 random anchors): the curves are running means
over `--window` steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from matplotlib.figure import Figure


def running_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("log", help="train_log.jsonl")
    ap.add_argument("--out", required=True, help="PNG path")
    ap.add_argument("--window", type=int, default=25)
    args = ap.parse_args()
    rows = [json.loads(line) for line in Path(args.log).read_text().splitlines() if line]
    steps = [r["step"] for r in rows]
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    loss_ax, acc_ax = fig.subplots(1, 2)
    loss_ax.plot(steps, running_mean([r["loss"] for r in rows], args.window))
    loss_ax.set(xlabel="step", ylabel="training loss", title="loss")
    acc_ax.plot(steps, running_mean([100 * r["slot1_acc"] for r in rows], args.window))
    acc_ax.set(xlabel="step", ylabel="%", title="slot-1 accuracy (training batches)")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"{len(rows)} steps -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
