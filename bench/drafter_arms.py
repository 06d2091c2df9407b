"""Same-seed short training runs, one lever changed per arm, scored by held-out teacher-forced τ.

Each arm is `python -m dflash_sglang.training train` on the same cached features with its own
flags, a full (short) schedule, then `evaluate --features-dir` on held-out greedy data of
MT-Bench, HumanEval and math. Two arms run at once, one thread each (a 2-core machine runs
two single-thread jobs with far less loss than one job at two threads next to another).

    .venv/bin/python bench/drafter_arms.py --run run/arms --steps 300 \
        --features zlab=run/f_zlab top=run/f_top \
        --heldout zlab=run/heldout/f_zlab top=run/heldout/f_top \
        --out bench/drafter/arms.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash_sglang.training.evaluate import accept_at

TRAIN = "python -m dflash_sglang.training".split()
COMMON = [
    "--mask-token", "<empty_output>", "--num-layers", "5", "--draft-vocab-size", "8192",
    "--distill", "0.5", "--batch-size", "4", "--num-anchors", "32", "--lr", "1e-3",
    "--threads", "1", "--seed", "0",
]  # fmt: skip
LATE = ["--init-from-target", "25,26,27,28,29"]
ARMS: dict[str, tuple[str, list[str]]] = {
    # name: (feature set, flags)
    "late_init_rope1e4": ("zlab", [*LATE, "--rope-theta", "10000"]),  # the bundled recipe
    "late_init": ("zlab", LATE),  # the target's own RoPE base (1e5)
    "random_init": ("zlab", []),
    "early_init": ("zlab", ["--init-from-target", "1,2,3,4,5"]),
    "taps_top": ("top", [*LATE, "--target-layer-ids", "2,9,16,23,29"]),
    "block8": ("zlab", [*LATE, "--block-size", "8"]),
    "gamma2": ("zlab", [*LATE, "--gamma", "2"]),  # loss on the first slots, which set τ here
}
SETS = ("mt_bench", "humaneval", "math")


def run_arm(name: str, taps: str, flags: list[str], a: argparse.Namespace) -> dict:
    out = Path(a.run) / name
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "arm.log").open("a")
    steps_per_epoch = a.samples / 4
    cmd = [
        sys.executable, *TRAIN[1:], "train", "--features-dir", a.features[taps],
        "--out", str(out), "--epochs", f"{a.steps / steps_per_epoch:.6f}",
        "--save-every", "50", *COMMON, *flags,
    ]  # fmt: skip
    if not (out / "drafter" / "config.json").exists():
        subprocess.run(cmd, check=True, stdout=log, stderr=log)
    result: dict = {"flags": flags, "features": taps}
    for s in SETS:
        report = out / f"eval_{s}.json"
        if not report.exists():
            subprocess.run(
                [sys.executable, *TRAIN[1:], "evaluate", "--drafter", str(out / "drafter"),
                 "--features-dir", f"{a.heldout[taps]}_{s}", "--threads", "1",
                 "--out", str(report)],
                check=True, stdout=log, stderr=log,
            )  # fmt: skip
        tf = json.loads(report.read_text())["teacher_forced"]
        first = [round(x, 3) for x in accept_at(tf["histogram"])[:4]]
        result[s] = {"tau": round(tf["tau"], 3), "steps": tf["steps"], "accept_at": first}
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    tail = rows[-max(1, len(rows) // 10) :]
    result["train_loss_last10pct"] = round(sum(r["loss"] for r in tail) / len(tail), 3)
    result["train_slot1_last10pct"] = round(sum(r["slot1_acc"] for r in tail) / len(tail), 3)
    print(name, json.dumps(result), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--samples", type=int, default=1600, help="sequences in the features")
    p.add_argument("--features", nargs="+", required=True, help="taps=DIR")
    p.add_argument("--heldout", nargs="+", required=True, help="taps=PREFIX (PREFIX_<set>)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--parallel", type=int, default=2, help="arms at once (one thread each)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    a.features = dict(x.split("=", 1) for x in a.features)
    a.heldout = dict(x.split("=", 1) for x in a.heldout)
    names = a.arms.split(",")
    with ThreadPoolExecutor(a.parallel) as pool:
        futures = {n: pool.submit(run_arm, n, *ARMS[n], a) for n in names}
        results = {n: f.result() for n, f in futures.items()}
    setup = {"steps": a.steps, "common": COMMON, "samples": a.samples}
    out = Path(a.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({**previous, "setup": setup, **results}, indent=1))


if __name__ == "__main__":
    main()
