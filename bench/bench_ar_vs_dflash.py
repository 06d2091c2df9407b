"""Output tokens/s of plain decoding vs DFLASH_X on the embedded target, interleaved.

    python bench/bench_ar_vs_dflash.py [--draft DIR] [--concurrency 1,8] [--rounds 3]

Starts three servers on loopback, all on the same target (bf16, CPU):
  ar      our launcher, --speculative-algorithm NONE (attention backend dflash_cpu)
  dflash  our launcher, DFLASH_X with --draft (default: a random 5-layer, block-16 draft)
  native  SGLang's own torch_native attention backend, no speculation
and runs the same prompts against each in turn, round after round, so machine noise hits
all arms alike. Reports tokens/s per arm and ratios against `ar`. A random draft accepts
(almost) nothing: its ratio is the overhead of speculation, not a speedup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.server import Server  # noqa: E402

PROMPTS = [
    "Explain how a hash map works, step by step.",
    "Write a short poem about the sea.",
    "What are the main causes of inflation?",
    "Give three tips for learning a new language.",
    "Describe the water cycle to a ten-year-old.",
    "Write a Python function that reverses a linked list.",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(chat, add_special_tokens=False).input_ids


def run_level(server: Server, prompts: list[list[int]], concurrency: int, max_new: int) -> dict:
    def one(ids):
        out = server.generate(input_ids=ids, max_new_tokens=max_new, ignore_eos=True)
        return out["meta_info"]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        metas = list(pool.map(one, prompts[:concurrency] * max(1, 8 // concurrency)))
    elapsed = time.perf_counter() - start
    tokens = sum(m["completion_tokens"] for m in metas)
    accept = [m["spec_accept_length"] for m in metas if "spec_accept_length" in m]
    return {"tok_s": tokens / elapsed, "tau": statistics.mean(accept) if accept else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--draft", help="draft checkpoint (default: random 5-layer block-16)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per server")
    ap.add_argument("--out", help="write the JSON result here")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from dflash_sglang import default_model
    from dflash_sglang.checkpoint import write_random_draft
    from dflash_sglang.default_model import ensure_default_target

    target = ensure_default_target()
    work = Path(tempfile.mkdtemp(prefix="dflash_bench_"))
    draft = args.draft or str(
        write_random_draft(
            target,
            work / "draft",
            mask_token_id=default_model.MASK_TOKEN_ID,
            intermediate_size=1536,
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    common = ["--model-path", str(target), "--max-total-tokens", "16384"]
    arms = {
        "ar": [*common, "--speculative-algorithm", "NONE"],
        "dflash": [*common, "--speculative-draft-model-path", draft],
        "native": [
            *common,
            "--speculative-algorithm",
            "NONE",
            "--attention-backend",
            "torch_native",
        ],
    }
    servers = {}
    try:
        for name, arm_args in arms.items():
            servers[name] = Server(arm_args, work / f"{name}.log", threads=args.threads)
        levels = [int(c) for c in args.concurrency.split(",")]
        results = {name: {c: [] for c in levels} for name in arms}
        for server in servers.values():  # warm-up
            run_level(server, prompts, 1, 8)
        for r in range(args.rounds):
            for c in levels:
                for name, server in servers.items():
                    results[name][c].append(run_level(server, prompts, c, args.max_new_tokens))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for server in servers.values():
            server.stop()

    summary = {
        "target": str(target),
        "draft": draft,
        "rounds": args.rounds,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "levels": {},
    }
    print(f"{'conc':>4} {'arm':>7} {'tok/s':>8} {'x ar':>6} {'tau':>5}")
    for c in levels:
        ar_tps = statistics.median(x["tok_s"] for x in results["ar"][c])
        summary["levels"][c] = {}
        for name in arms:
            tps = statistics.median(x["tok_s"] for x in results[name][c])
            taus = [x["tau"] for x in results[name][c] if x["tau"] is not None]
            tau = statistics.mean(taus) if taus else None
            summary["levels"][c][name] = {"tok_s": tps, "ratio_vs_ar": tps / ar_tps, "tau": tau}
            tau_s = f"{tau:5.2f}" if tau else "    -"
            print(f"{c:>4} {name:>7} {tps:8.1f} {tps / ar_tps:6.2f} {tau_s}")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
