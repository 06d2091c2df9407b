"""Cache-aware vs round-robin routing over the same two DFLASH_X replicas; a replica killed.

    python bench/cluster_routing.py --out bench/cluster/routing.json [--fault]

Two replicas (our launcher: the embedded SmolLM2, its bundled drafter, one core each, as
`python -m dflash_sglang.cluster` starts them) and two sglang-router processes in front of
both: `cache_aware` and `round_robin`. Each slice flushes both replicas' caches, then runs
locust (`loadtest`'s users, streaming chat) through one router over the slice's
shared-prefix prompts (`loadtest.prompt_sets.shared_prefix`: groups sharing a ~450-token
article), scraping every replica before and after; then the other router on the same
prompts. Arms alternate slice by slice. Per arm: output tok/s, prefix-cache hit rate
(Δ`sglang:cached_tokens_total` / Δ`sglang:prompt_tokens_total` over both replicas), and per
replica: requests, cached tokens, and DFlash draft KV reused from the radix cache
(`dflash_radix_reused_draft_kv_tokens_total`), which must follow the router's choices.

--fault: one more cache-aware run during which replica 1's whole process tree is SIGKILLed
after --kill-after seconds. Reported: failed requests, replica 1's running requests just
before the kill (the most that may fail), seconds until the supervisor had it answering
again and until the router sent it a request.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_sglang import cluster  # noqa: E402
from dflash_sglang.managed_server import free_port  # noqa: E402
from loadtest import level_stats, prompt_sets, server_metrics  # noqa: E402
from loadtest.locust_runner import LevelPlan, run_level  # noqa: E402

ARMS = ("cache_aware", "round_robin")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--slices", type=int, default=3, help="alternations of the two arms")
    p.add_argument("--requests-per-slice", type=int, default=32, help="4 per prefix group")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--fault", action="store_true", help="then kill replica 1 mid-run")
    p.add_argument("--kill-after", type=float, default=10.0, help="seconds into the fault run")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


def flush(urls: list[str]) -> None:
    for url in urls:
        requests.post(url + "/flush_cache", timeout=60).raise_for_status()


def per_replica(urls: list[str], before: list, after: list) -> list[dict]:
    rows = []
    for url, b, a in zip(urls, before, after, strict=True):
        d = server_metrics.counter_deltas(b, a)
        rows.append(
            {
                "replica": url,
                "requests": server_metrics.total(d, "sglang:num_requests_total"),
                "prompt_tokens": server_metrics.total(d, "sglang:prompt_tokens_total"),
                "cached_tokens": server_metrics.total(d, "sglang:cached_tokens_total"),
                "radix_reused_draft_kv_tokens": server_metrics.total(
                    d, "dflash_radix_reused_draft_kv_tokens_total"
                ),
                "tau": server_metrics.tau(d),
            }
        )
    return rows


def run_arm(router_url: str, replicas: list[str], prompts: list[str], args, work: Path) -> dict:
    flush(replicas)
    before = [server_metrics.scrape(u) for u in replicas]
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    plan = LevelPlan(router_url, "default", args.concurrency, len(prompts), args.max_tokens,
                     True, {}, 600.0)  # fmt: skip
    records = run_level(plan, prompts_file, work / "results.jsonl")
    after = [server_metrics.scrape(u) for u in replicas]
    stats = level_stats.summarize(records, len(prompts))
    rows = per_replica(replicas, before, after)
    prompt = sum(r["prompt_tokens"] for r in rows)
    return {
        "output_tok_s": stats.output_tok_s,
        "errors": stats.errors,
        "ttft_p50_ms": stats.ttft_p50_ms,
        "prefix_cache_hit_rate": sum(r["cached_tokens"] for r in rows) / prompt if prompt else None,
        "replicas": rows,
    }


def fault_run(routers, replicas_obj, prompts, args, work: Path) -> dict:
    """Kill replica 1 `kill_after` seconds into a cache-aware run; let the cluster restart it."""
    victim = replicas_obj[1]
    url = victim.url
    outcome: dict = {}

    def kill() -> None:
        time.sleep(args.kill_after)
        outcome["running_at_kill"] = server_metrics.total(
            server_metrics.scrape(url).gauges, "sglang:num_running_reqs"
        )
        os.killpg(victim.proc.pid, signal.SIGKILL)
        outcome["killed_at"] = time.monotonic()

    killer = threading.Thread(target=kill)
    killer.start()
    result = run_arm(routers["cache_aware"].url, [r.url for r in replicas_obj[:1]], prompts,
                     args, work)  # fmt: skip
    killer.join()
    result.pop("replicas")  # replica 1's counters restarted with it
    return result | outcome


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="dflash_routing_"))
    base = free_port()
    ns = argparse.Namespace(replicas=2, port=base, host="127.0.0.1", policy="cache_aware",
                            threads=1, log_dir=str(work))  # fmt: skip
    cl = cluster.Cluster(ns, ["--served-model-name", "default"], start_router=False)
    routers = {}
    try:
        cl.wait_ready()
        urls = [r.url for r in cl.replicas]
        for policy in ARMS:
            routers[policy] = cluster.Router(urls, work / f"router_{policy}.log", free_port(),
                                             policy, free_port())  # fmt: skip
            routers[policy].wait_ready(timeout_s=120)
        pool = prompt_sets.shared_prefix()
        runs = []
        for s in range(args.slices):
            prompts = pool[s * args.requests_per_slice : (s + 1) * args.requests_per_slice]
            # Groups out of order: round robin must not keep a group on one replica by parity.
            random.Random(s).shuffle(prompts)
            order = ARMS if s % 2 == 0 else ARMS[::-1]
            for arm in order:
                measured = run_arm(routers[arm].url, urls, prompts, args, work)
                row = {"slice": s, "arm": arm} | measured
                print(json.dumps(row), flush=True)
                runs.append(row)
        summary = {}
        for arm in ARMS:
            mine = [r for r in runs if r["arm"] == arm]
            summary[arm] = {
                "output_tok_s": sum(r["output_tok_s"] for r in mine) / len(mine),
                "prefix_cache_hit_rate": sum(r["prefix_cache_hit_rate"] for r in mine) / len(mine),
                "errors": sum(r["errors"] for r in mine),
            }
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                  "summary": summary}  # fmt: skip
        if args.fault:
            report["fault"] = fault_run_supervised(cl, routers, pool, args, work)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(json.dumps(summary, indent=1))
        return 0
    finally:
        for router in routers.values():
            router.stop()
        cl.stop()


def fault_run_supervised(cl, routers, pool, args, work: Path) -> dict:
    """The fault run with the cluster's supervisor restarting the killed replica."""
    stop = threading.Event()

    def supervise() -> None:
        while not stop.is_set():
            cl.supervise_once()
            time.sleep(0.5)

    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    n = args.requests_per_slice * 2
    prompts = pool[-n:]
    flush([r.url for r in cl.replicas])
    result = fault_run(routers, cl.replicas, prompts, args, work)
    victim = cl.replicas[1]
    deadline = time.monotonic() + 600
    while not victim.ready() and time.monotonic() < deadline:
        time.sleep(1)
    result["seconds_to_answer_again"] = time.monotonic() - result["killed_at"]
    before = server_metrics.total(server_metrics.scrape(victim.url).counters,
                                  "sglang:num_requests_total")  # fmt: skip
    body = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": ""}]}
    while time.monotonic() < deadline:
        for i in range(4):
            body["messages"][0]["content"] = f"Rejoin probe {i} {time.monotonic()}"
            requests.post(routers["cache_aware"].url + "/v1/chat/completions", json=body,
                          timeout=60)  # fmt: skip
        now = server_metrics.total(server_metrics.scrape(victim.url).counters,
                                   "sglang:num_requests_total")  # fmt: skip
        if now > before:
            break
    result["seconds_to_rejoin"] = time.monotonic() - result.pop("killed_at")
    result["restarts"] = cl.restarts
    stop.set()
    return result


if __name__ == "__main__":
    sys.exit(main())
