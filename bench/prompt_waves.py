"""Waves of new prompts, the arms of `bench/peers.py` taking turns: what a wave of users'
first requests costs each server, and what a co-located idle server costs it.

    python bench/prompt_waves.py [--arms ours_plain,vllm_plain] [--batch 16]
        [--max-tokens 1] [--waves 10] [--pause | --no-pause]

Each wave sends `--batch` MT-Bench prompts at once (chat completions, greedy,
`--max-tokens` each), salted with the wave's number so no prompt hits a prefix cache, and
times it to the last reply. Arms take turns wave by wave. `--pause` (default) stops every
other arm's server while one runs, as `bench/peers.py` does; `--no-pause` leaves them up.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import peers

from dflash_sglang import datasets
from dflash_sglang.managed_server import paused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arms", default="ours_plain,vllm_plain")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--waves", type=int, default=10)
    ap.add_argument("--pause", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    unknown = set(args.arms.split(",")) - set(peers.ARMS[:-1])
    if unknown:
        ap.error(f"--arms: unknown {', '.join(sorted(unknown))} (servers of bench/peers.py)")
    work = Path(tempfile.mkdtemp(prefix="dflash_waves_"))
    models = peers.prepare_models(work)
    prompts = datasets.mt_bench()
    arms: list[peers.Arm] = []
    try:
        for name in args.arms.split(","):
            arms.append(peers.start_arm(name, models, "bfloat16", args.threads, work))

        def wave(arm: peers.Arm, texts: list[str]) -> float:
            others = [a.process for a in arms if a is not arm] if args.pause else []
            with paused(others), ThreadPoolExecutor(len(texts)) as pool:
                start = time.perf_counter()
                list(pool.map(lambda t: peers.chat_text(arm.url, t, args.max_tokens), texts))
                return time.perf_counter() - start

        for arm in arms:  # unmeasured: one-time costs
            wave(arm, [f"Warm-up {i}. {p}" for i, p in enumerate(prompts[: args.batch])])
        seconds: dict[str, list[float]] = {arm.name: [] for arm in arms}
        for w in range(args.waves):
            start = w * args.batch % len(prompts)
            chosen = (prompts * 2)[start : start + args.batch]
            texts = [f"Request {w}-{i}. {p}" for i, p in enumerate(chosen)]
            for arm in arms:
                seconds[arm.name].append(wave(arm, texts))
    finally:
        for arm in arms:
            arm.process.stop()
    print(json.dumps({name: [round(s, 3) for s in v] for name, v in seconds.items()}))
    for name, v in seconds.items():
        print(f"{name}: {sum(v):.2f} s for {args.waves} waves of {args.batch}")


if __name__ == "__main__":
    main()
