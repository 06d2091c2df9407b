"""Cache-aware vs round-robin routing over the same two DFLASH_X replicas; a replica killed.

    python bench/cluster_routing.py --out bench/cluster/routing.json [--fault]

Two replicas (our launcher: the embedded SmolLM2, its bundled drafter, one core each, as
`python -m dflash_sglang.cluster` starts them, with `--dflash-suffix-shared 0` so no arm
proposes from the other arm's outputs) and two sglang-router processes in front of
both: `cache_aware` and `round_robin`. Each slice flushes both replicas' caches, then runs
locust (`loadtest`'s users, streaming chat) through one router over the slice's
shared-prefix prompts (`loadtest.prompt_sets.shared_prefix`: groups sharing a ~450-token
article), scraping every replica before and after; then the other router on the same
prompts. Arms alternate slice by slice. Per arm: output tok/s, prefix-cache hit rate
(Δ`sglang:cached_tokens_total` / Δ`sglang:prompt_tokens_total` over both replicas), and per
replica: requests, cached tokens, and DFlash draft KV reused from the radix cache
(`dflash_radix_reused_draft_kv_tokens_total`), which must follow the router's choices.

--fault: one more cache-aware run during which replica 1's whole process tree is SIGKILLed
after --kill-after seconds, with the cluster's supervisor running. Reported: failed
requests, the requests the router had in flight on replica 1 at the kill (what may fail),
and seconds until the router took it out of rotation (the supervisor's watcher removes it),
until it answered again (restarted), and until the supervisor added it back.
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
    p.add_argument("--slices", type=int, default=3, help="alternations of the two arms (0: none)")
    p.add_argument("--requests-per-slice", type=int, default=32, help="4 per prefix group")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--fault", action="store_true", help="then kill replica 1 mid-run")
    p.add_argument("--kill-after", type=float, default=10.0, help="seconds into the fault run")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


def flush(urls: list[str], timeout_s: float = 60.0) -> None:
    """Empty every replica's radix cache; SGLang answers 400 while requests are still in
    the scheduler (a stream the client has finished may not have left it yet): retry."""
    for url in urls:
        deadline = time.monotonic() + timeout_s
        while (r := requests.post(url + "/flush_cache", timeout=60)).status_code != 200:
            if time.monotonic() > deadline:
                r.raise_for_status()
            time.sleep(1)


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
        "failed": [{k: r[k] for k in ("t_start", "t_end", "error")} for r in records if r["error"]],
    }


def worker_gauge(router: cluster.Router, name: str, worker_url: str) -> float | None:
    """The router's own view of a worker: `smg_worker_health` (1 in rotation, 0 out),
    `smg_worker_requests_active` (requests it has in flight there)."""
    gauges = server_metrics.scrape(router.metrics_url).gauges
    return gauges.get(server_metrics.sample_key(name, {"worker": worker_url}))


def fault_run(cl, router, prompts, args, work: Path) -> dict:
    """Kill replica 1 `kill_after` seconds into a cache-aware run while the cluster's
    supervisor runs; time the router taking it out and back in."""
    victim = cl.replicas[1]
    outcome: dict = {}
    stop = threading.Event()

    def supervise() -> None:
        while not stop.is_set():
            cl.supervise_once()
            time.sleep(0.5)

    def kill_and_watch() -> None:
        time.sleep(args.kill_after)
        in_flight = worker_gauge(router, "smg_worker_requests_active", victim.url)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        outcome["killed_at"] = killed  # the loadtest's clock (CLOCK_MONOTONIC) too
        outcome["router_in_flight_on_it_at_kill"] = in_flight
        deadline = killed + 900

        def in_rotation() -> bool:
            return victim.url in router.worker_ids()

        while in_rotation() and time.monotonic() < deadline:
            time.sleep(0.01)
        outcome["seconds_until_router_took_it_out"] = time.monotonic() - killed
        while not victim.ready() and time.monotonic() < deadline:
            time.sleep(0.5)
        outcome["seconds_until_it_answered_again"] = time.monotonic() - killed
        while not in_rotation() and time.monotonic() < deadline:
            time.sleep(0.25)
        outcome["seconds_until_router_took_it_back"] = time.monotonic() - killed

    threads = [
        threading.Thread(target=supervise, daemon=True),
        threading.Thread(target=kill_and_watch),
    ]
    for t in threads:
        t.start()
    result = run_arm(router.url, [cl.replicas[0].url], prompts, args, work)
    threads[1].join()
    stop.set()
    result.pop("replicas")  # replica 1's counters restarted with it
    killed = outcome.pop("killed_at")
    # Which failures were requests already running at the kill (what may fail), which not.
    result["failed"] = [
        {"error": f["error"], "started_s_before_kill": round(killed - f["t_start"], 3),
         "ended_s_after_kill": round(f["t_end"] - killed, 3)}
        for f in result["failed"]
    ]  # fmt: skip
    result["failed_not_in_flight_at_kill"] = sum(
        f["started_s_before_kill"] < 0 for f in result["failed"]
    )
    return result | outcome | {"restarts": list(cl.restarts)}


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="dflash_routing_"))
    base = free_port()
    ns = argparse.Namespace(replicas=2, port=base, host="127.0.0.1", policy="cache_aware",
                            threads=1, log_dir=str(work))  # fmt: skip
    # The shared suffix lookup off: it would carry one arm's outputs into the next arm's
    # identical prompts (flush_cache empties SGLang's caches, not this index).
    replica_args = ["--served-model-name", "default", "--dflash-suffix-shared", "0"]
    cl = cluster.Cluster(ns, replica_args, start_router=False)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run `finally`: stop everything
    routers = {}
    try:
        cl.wait_ready()
        urls = [r.url for r in cl.replicas]
        for policy in ARMS:
            routers[policy] = cluster.Router(urls, work / f"router_{policy}.log", free_port(),
                                             policy, free_port())  # fmt: skip
            routers[policy].wait_ready(timeout_s=120)
        cl.routers.extend(routers.values())  # the supervisor takes a dead replica out of both
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
        for arm in ARMS if runs else ():
            mine = [r for r in runs if r["arm"] == arm]
            summary[arm] = {
                "output_tok_s": sum(r["output_tok_s"] for r in mine) / len(mine),
                "prefix_cache_hit_rate": sum(r["prefix_cache_hit_rate"] for r in mine) / len(mine),
                "errors": sum(r["errors"] for r in mine),
            }
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                  "summary": summary}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(json.dumps(summary, indent=1))
        if args.fault:
            flush(urls)
            n = 2 * args.requests_per_slice
            report["fault"] = fault_run(cl, routers["cache_aware"], pool[-n:], args, work)
            args.out.write_text(json.dumps(report, indent=1))
            print(json.dumps(report["fault"], indent=1))
        return 0
    finally:
        for router in routers.values():
            router.stop()
        cl.stop()


if __name__ == "__main__":
    sys.exit(main())
