"""Does the DFlash block's acceptance come in bursts the planner could follow? Offline, on
cached held-out features (`evaluate --features-dir` data, the target's own greedy output).

The planner estimates acceptance per draft slot from all recent steps, as if each step were
independent of the one before. Here the block's acceptance length at every response
position (teacher-forced, `tree_offline.lengths_at`) gives, along the greedy walk that
drafts every step, how often a block is accepted after an accepted block and after a
missed one, and what a policy that runs `k` plain steps after each missed block would emit
per unit of step time, at verify width `w`, under a relative cost model: a plain step 1,
a drafting step `1 + draft_cost + token_cost * (w - 1)`. The default costs are one
request's on the EPYC (README, "What the drafter costs a step at one request": 12.9 ms
at width 1, 22.2 ms a drafting step at width 4, 0.38 ms per verified token).

    python bench/acceptance_bursts.py --heldout mt_bench=heldout/f_zlab_mt_bench \
        --drafter dflash_sglang/drafters/smollm2-135m-instruct-dflash [--out F.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from tree_offline import lengths_at, load_pair

from dflash_sglang.options import at_least, number
from dflash_sglang.training import evaluate, features


def walk_pairs(lengths: list[int]) -> list[tuple[int, int]]:
    """(previous, next) acceptance lengths of consecutive steps of the walk that drafts the
    whole block every step."""
    steps = evaluate.greedy_walk(lengths)
    return list(itertools.pairwise(steps))


def skip_after_miss(
    lengths: list[int], width: int, skip: int, draft_cost: float, token_cost: float
) -> tuple[int, float]:
    """(tokens, cost) of drafting at `width` except for `skip` plain steps after each step
    that accepted no draft."""
    tokens, cost, p, plain = 0, 0.0, 0, 0
    while p < len(lengths):
        if plain:
            plain -= 1
            n, step = 1, 1.0
        else:
            n = min(lengths[p], width, len(lengths) - p)
            step = 1.0 + draft_cost + token_cost * (width - 1)
            plain = skip if n == 1 else 0
        tokens, cost, p = tokens + n, cost + step, p + n
    return tokens, cost


def bursts(walks: list[list[int]]) -> dict:
    pairs = [pair for lengths in walks for pair in walk_pairs(lengths)]
    after_hit = [b for a, b in pairs if a > 1]
    after_miss = [b for a, b in pairs if a == 1]

    def share(xs: list[int]) -> float:
        return round(sum(x > 1 for x in xs) / len(xs), 3)

    return {
        "steps": len(pairs),
        "accepted": share([b for _, b in pairs]),
        "accepted_after_accepted": share(after_hit),
        "accepted_after_missed": share(after_miss),
        "tau_after_accepted": round(sum(after_hit) / len(after_hit), 3),
        "tau_after_missed": round(sum(after_miss) / len(after_miss), 3),
    }


def int_list(flag: str, low: int):
    """An argparse type: comma-separated integers >= `low`, a bad one named by `flag`."""
    one = at_least(flag, low)
    return lambda text: [one(part) for part in text.split(",")]


def heldout(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--heldout takes NAME=FEATURES_DIR, got {text!r}")
    return name, Path(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--heldout", nargs="+", type=heldout, required=True, help="NAME=FEATURES_DIR ..."
    )
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--draft-cost", type=number("--draft-cost", 0.0), default=0.63)
    parser.add_argument("--token-cost", type=number("--token-cost", 0.0), default=0.03)
    parser.add_argument("--widths", type=int_list("--widths", 2), default=[2, 4, 8, 16])
    parser.add_argument("--skips", type=int_list("--skips", 0), default=[0, 1, 2, 3, 5])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    embed, weight, drafter = load_pair(args.drafter)
    report: dict = {"draft_cost": args.draft_cost, "token_cost": args.token_cost}
    for name, path in args.heldout:
        walks = []
        for example in features.load(path):
            end = len(example.input_ids) - 1
            with torch.no_grad():
                dflash, _ = lengths_at(drafter, embed, weight, example, end)
            walks.append([dflash[p] for p in range(example.prompt_len, end)])
        speed = {}
        for w in args.widths:
            for k in args.skips:
                runs = [
                    skip_after_miss(lengths, w, k, args.draft_cost, args.token_cost)
                    for lengths in walks
                ]
                tokens, cost = (sum(x) for x in zip(*runs, strict=True))
                speed[f"w{w}_skip{k}"] = round(tokens / cost, 3)  # x plain decoding
        report[name] = {"bursts": bursts(walks), "x_plain": speed}
        print(name, json.dumps(report[name]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
