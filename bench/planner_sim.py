"""The planner in a closed loop at one request, against step costs measured on this CPU.

    python bench/planner_sim.py [--seeds 16] [--out F.json]

Runs `proposals.Planner` (DFlash alone, widths 1, 2, 4, 8, 16) on simulated requests of 128
tokens, eight in a row on one planner as on a server: each step's acceptance is drawn per
slot from a conditional curve, and its time from the costs the server measured at one
request (README, "The planner learning its drafter at one request"): 24 ms a plain step, 0.2
ms per verified token, 8.5 ms a draft forward, a one-off 2 ms (draft) + 4 ms (rest) on
the step that turns the drafter on after plain steps and 9 ms on the first plain step after
drafting ones, plus up to ~2 ms of noise. A reply's first `opening` tokens accept nothing
(measured: the bundled drafter's first seven blocks on MT-Bench's first prompt). Prints
tokens per second over plain decoding's (mean and range over seeds) for the planner
variants named below and for fixed widths, per drafter curve:

  good    conditional acceptance 0.5, 0.38, 0.35, then 0.3 (the bundled drafter on held-out
          prompts: slot-0 acceptance 0.45-0.52)
  mid     0.38, 0.3, 0.3, then 0.25 (near break-even at one request)
  random  nothing accepted
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable

from dflash_sglang.adaptive import DEFAULT_CPU_PRIOR, CostModel
from dflash_sglang.proposals import Planner

BLOCK, WIDTHS = 16, (1, 2, 4, 8, 16)
PLAIN, PER_TOKEN, DRAFT = 0.024, 0.0002, 0.0085  # seconds
SWITCH_DRAFT, SWITCH_REST = 0.002, 0.004  # the step that turns the drafter on pays these once
SWITCH_BACK = 0.009  # and the first plain step after drafting this
CURVES = {
    "good": [0.5, 0.38, 0.35] + [0.3] * 12,
    "mid": [0.38, 0.3, 0.3] + [0.25] * 12,
    "random": [0.0] * 15,
}


def run(planner: Planner, curve: list[float], seed: int, opening: int, requests: int = 8) -> float:
    """Tokens per second over plain decoding's (whose steps pay the same noise)."""
    rng = random.Random(seed)
    seconds = plain = 0.0
    drafted = True
    for _ in range(requests):
        emitted = 0
        while emitted < 128:
            plan = planner.plan([None])
            rates = [0.0] * len(curve) if emitted < opening else curve
            accepted = 0
            while accepted < plan.offered(0) and rng.random() < rates[accepted]:
                accepted += 1
            planner.observe(plan, [accepted])
            switch = plan.run_draft and not drafted
            back = drafted and not plan.run_draft
            draft = DRAFT + SWITCH_DRAFT * switch + rng.gauss(0, 0.0005) if plan.run_draft else 0.0
            noise = abs(rng.gauss(0, 0.001))
            step = PLAIN + PER_TOKEN * plan.width + SWITCH_REST * switch + SWITCH_BACK * back
            step += draft + noise
            planner.observe_seconds(plan, 1, step, draft)
            drafted = plan.run_draft
            seconds += step
            plain += (accepted + 1) * (PLAIN + PER_TOKEN + noise)
            emitted += accepted + 1
        drafted = True  # a prefill between requests: the server does not time the next step
    return plain / seconds


def variants() -> dict[str, Callable[[], Planner]]:
    def make(widths=WIDTHS, **kwargs) -> Callable[[], Planner]:
        return lambda: Planner(BLOCK, widths, CostModel(DEFAULT_CPU_PRIOR), **kwargs)

    return {
        "default": make(),
        "prior weight 1": make(dflash_prior_weight=1.0),
        "explore every 50": make(explore_every=50),
        "fixed width 4": make(widths=(4,)),
        "fixed width 16": make(widths=(16,)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--openings", default="0,8,16")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    try:
        openings = [int(x) for x in args.openings.split(",")]
    except ValueError:
        ap.error(f"--openings must be comma-separated integers, got {args.openings!r}")
    if min(openings) < 0:
        ap.error(f"--openings must be >= 0, got {args.openings!r}")
    results = []
    print("| planner | opening | " + " | ".join(CURVES) + " |")
    print("|---|---|" + "---|" * len(CURVES))
    for name, make in variants().items():
        for opening in openings:
            cells = []
            for curve_name, curve in CURVES.items():
                ratios = [run(make(), curve, s, opening) for s in range(args.seeds)]
                results.append(
                    {"planner": name, "opening": opening, "curve": curve_name, "ratios": ratios}
                )
                mean = statistics.mean(ratios)
                cells.append(f"{mean:.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
            print(f"| {name} | {opening} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
