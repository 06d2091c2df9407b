"""Lossless under load: DFLASH_X (default launch) equals plain decoding on real prompts.

    python bench/lossless_load.py --out bench/reliability/lossless_load.json   # ~30 min

The embedded SmolLM2 target in float32, greedy, served twice through our launcher: plain
decoding, then DFLASH_X as launched by default (bundled drafter, adaptive width, suffix
lookup). Each server gets the same requests at --concurrency: MT-Bench, HumanEval, ShareGPT
and ASDiv math prompts (half behind one shared system prompt, so the radix cache hits),
mixed output lengths, and long prompts (several XSum articles, > 2,000 tokens). The KV pool
is sized a little above the longest request, so concurrent requests overflow it: SGLang
evicts cached prefixes and retracts running requests, and DFLASH_X must stay exact through
both. The servers run one after the other (nothing here is a timing). Exit status 1 when any
output differs, when nothing was retracted or cached, or when requests still hold KV rows
afterwards (SGLang's token usage; the draft shares the target's row allocator).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_sglang import datasets, metrics  # noqa: E402
from dflash_sglang.loadtest import server_metrics  # noqa: E402
from dflash_sglang.managed_server import Server  # noqa: E402

SYSTEM = (
    "You are a careful assistant. Answer accurately and concisely, show the steps of any "
    "calculation, write code in fenced blocks, and say so when you are unsure."
)
LENGTHS = (32, 64, 96, 128)
RETRACTED = "sglang:num_retracted_requests_total"
TOKEN_USAGE = "sglang:token_usage"


def prompts(per_set: int, long_count: int) -> list[dict]:
    """Requests as chat messages with their output length, in a fixed interleaved order."""
    sets = {
        "mt_bench": datasets.mt_bench(),
        "humaneval": datasets.humaneval(),
        "sharegpt": datasets.sharegpt(limit=4 * per_set),
        "math": datasets.math_problems(),
    }
    out = []
    for i in range(per_set):
        for name, texts in sets.items():
            messages = [{"role": "user", "content": texts[i]}]
            if (i + len(out)) % 2 == 0:
                messages.insert(0, {"role": "system", "content": SYSTEM})
            out.append({"set": name, "messages": messages})
    articles = datasets.summaries(max_chars=100_000)
    for i in range(long_count):
        documents = "\n\n".join(a.split("\n\n", 1)[1] for a in articles[6 * i : 6 * i + 6])
        text = datasets.SUMMARY_INSTRUCTION.format(document=documents)
        out.append({"set": "long", "messages": [{"role": "user", "content": text}]})
    step = max(1, len(out) // long_count) if long_count else 1
    ordered = sorted(range(len(out)), key=lambda i: (i % step, i))  # spread the long ones
    return [{**out[j], "max_new_tokens": LENGTHS[k % len(LENGTHS)]} for k, j in enumerate(ordered)]


def tokenize(requests_: list[dict], target: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    for r in requests_:
        r["input_ids"] = tokenizer.apply_chat_template(
            r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
        )


def run(server: Server, requests_: list[dict], concurrency: int) -> dict:
    """Every request once at `concurrency`; outputs in request order, and what the pool did."""
    before = server_metrics.scrape(server.url)

    def one(r: dict) -> dict:
        body = {
            "input_ids": r["input_ids"],
            "sampling_params": {"temperature": 0, "max_new_tokens": r["max_new_tokens"]},
        }
        got = requests.post(server.url + "/generate", json=body, timeout=1800)
        got.raise_for_status()
        return got.json()

    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(one, requests_))
    seconds = time.monotonic() - start
    time.sleep(3)  # the scheduler frees the last requests' pages after answering
    after = server_metrics.scrape(server.url)
    deltas = server_metrics.counter_deltas(before, after)
    return {
        "outputs": [o["output_ids"] for o in outs],
        "seconds": round(seconds, 1),
        "output_tokens": sum(len(o["output_ids"]) for o in outs),
        "cached_prompt_tokens": sum(o["meta_info"].get("cached_tokens", 0) for o in outs),
        "retracted_requests": server_metrics.total(deltas, RETRACTED),
        "tau": server_metrics.tau(deltas),
        "token_usage_after": server_metrics.total(after.gauges, TOKEN_USAGE),
        "draft_kv_rows_after": server_metrics.total(after.gauges, metrics.PREFIX + "draft_kv_rows"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--per-set", type=int, default=50, help="prompts per set (4 sets)")
    ap.add_argument("--long", type=int, default=12, help="prompts of several XSum articles")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--pool-margin", type=int, default=512, help="pool = longest request + this")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per server")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from dflash_sglang.default_model import ensure_default_target

    target = ensure_default_target()
    reqs = prompts(args.per_set, args.long)
    tokenize(reqs, target)
    longest = max(len(r["input_ids"]) + r["max_new_tokens"] for r in reqs)
    pool = longest + args.pool_margin
    common = ["--dtype", "float32", "--max-total-tokens", str(pool)]
    logs = Path(tempfile.mkdtemp(prefix="dflash_lossless_"))
    results = {}
    for name, extra in (("plain", ["--speculative-algorithm", "NONE"]), ("dflash_x", [])):
        server = Server([*common, *extra], logs / f"{name}.log", threads=args.threads)
        try:
            results[name] = run(server, reqs, args.concurrency)
        finally:
            server.stop()
        print(name, {k: v for k, v in results[name].items() if k != "outputs"}, flush=True)

    plain, dx = results["plain"]["outputs"], results["dflash_x"]["outputs"]
    differ = [i for i, (a, b) in enumerate(zip(plain, dx, strict=True)) if a != b]
    lengths = [len(r["input_ids"]) for r in reqs]
    report = {
        "command": "python bench/lossless_load.py " + " ".join(sys.argv[1:]),
        "requests": len(reqs),
        "by_set": dict(Counter(r["set"] for r in reqs)),
        "with_shared_system_prompt": sum(r["messages"][0]["role"] == "system" for r in reqs),
        "prompt_tokens": {"min": min(lengths), "max": max(lengths),
                          "over_2000": sum(n > 2000 for n in lengths)},
        "concurrency": args.concurrency,
        "max_total_tokens": pool,
        "identical": len(reqs) - len(differ),
        "differ": [{"index": i, "set": reqs[i]["set"]} for i in differ],
        **{name: {k: v for k, v in r.items() if k != "outputs"} for name, r in results.items()},
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "differ"}, indent=1))
    exercised = all(
        r["retracted_requests"] > 0 and r["cached_prompt_tokens"] > 0 for r in results.values()
    )
    # Target and draft KV share SGLang's row allocator, so a zero token usage (rows held by
    # requests) covers both; dflash_draft_kv_rows also counts radix-cached rows.
    drained = all(r["token_usage_after"] == 0 for r in results.values())
    return 0 if not differ and exercised and drained else 1


if __name__ == "__main__":
    sys.exit(main())
