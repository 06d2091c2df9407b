"""What the kernel counts for each arm's scheduler process per decode step, arms taking turns.

    python bench/process_counters.py --arms plain_no_overlap,dflash_x_width1,\
dflash_x_width1:--dflash-cpu-arena-cache=off [--concurrency 1] [--set humaneval]

No wrappers and no sampling in the servers (which slow arms unequally, README "Benchmark
drift"): only counters the kernel keeps anyway, read from /proc before and after each turn.
Per arm: output tok/s; per step (output tokens / concurrency, so one step per token of each
request: meant for plain decoding and DFLASH_X at width 1), the scheduler process's minor
page faults and involuntary context switches; CPU seconds of its busiest threads. An arm is
a name of `profile_step.arm_args`, optionally followed by `:--flag=value` launcher arguments.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import psutil
from bench_proposers import SET_NAMES, prompt_sets
from profile_interleaved import PROMPT, add_turn_args, check_turn_args, drive
from profile_step import arm_args, scheduler_pid

from dflash_sglang.managed_server import Server


def process_counters(pid: int) -> Counter[str]:
    """Minor faults, context switches and per-thread CPU seconds of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    proc = psutil.Process(pid)
    switches = proc.num_ctx_switches()
    out = Counter(minor_faults=int(fields[7]), involuntary_switches=switches.involuntary)
    for thread in proc.threads():
        out[f"cpu_s thread {thread.id}"] = thread.user_time + thread.system_time
    return out


def parse_arm(spec: str, arms: dict[str, list[str]]) -> list[str]:
    name, *flags = spec.split(":")
    if name not in arms:
        raise ValueError(f"--arms: unknown arm {name!r} (choose from {', '.join(arms)})")
    extra = []
    for flag in flags:
        key, sep, value = flag.partition("=")
        if not key.startswith("--") or not sep:
            raise ValueError(f"--arms: {spec!r}: extra arguments go as :--flag=value")
        extra += [key, value]
    return [*arms[name], *extra]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_turn_args(ap, "plain_no_overlap,dflash_x_width1", concurrency=1, rounds=4)
    ap.add_argument("--set", choices=SET_NAMES, default="humaneval")
    ap.add_argument("--out")
    args = ap.parse_args()
    check_turn_args(ap, args)

    from transformers import AutoTokenizer

    from dflash_sglang.default_model import ensure_default_target
    from dflash_sglang.drafters import default_draft_dir

    target = ensure_default_target()
    known = arm_args(target, default_draft_dir())
    chosen = args.arms.split(",")
    try:
        launches = {spec: parse_arm(spec, known) for spec in chosen}
    except ValueError as e:
        ap.error(str(e))
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = prompt_sets([args.set], tokenizer, 10**6, max_prompt_tokens=1024)[args.set]
    logs = Path(tempfile.mkdtemp(prefix="dflash_counters_"))
    print(f"servers' logs in {logs}", file=sys.stderr)
    servers: dict[str, Server] = {}
    tokens, seconds = Counter(), Counter()
    counts: dict[str, Counter[str]] = {spec: Counter() for spec in chosen}
    try:
        for i, spec in enumerate(chosen):
            servers[spec] = Server(launches[spec], logs / f"arm{i}.log", threads=args.threads)
            servers[spec].generate(PROMPT, max_new_tokens=16)
        sequences = {spec: itertools.cycle(prompts) for spec in chosen}
        for _ in range(args.rounds):
            for spec in chosen:
                pid = scheduler_pid(servers[spec])
                before = process_counters(pid)
                n, s = drive(servers[spec], args.concurrency, args.slice, sequences[spec])
                counts[spec].update(process_counters(pid))
                counts[spec].subtract(before)
                tokens[spec] += n
                seconds[spec] += s
    finally:
        for server in servers.values():
            server.stop()

    report = {}
    for spec in chosen:
        steps = tokens[spec] / args.concurrency
        threads = sorted(
            (v for k, v in counts[spec].items() if k.startswith("cpu_s")), reverse=True
        )
        report[spec] = {
            "output_tok_s": tokens[spec] / seconds[spec],
            "steps": steps,
            "minor_faults_per_step": counts[spec]["minor_faults"] / steps,
            "involuntary_switches_per_step": counts[spec]["involuntary_switches"] / steps,
            "busiest_threads_cpu_share": [round(v / seconds[spec], 3) for v in threads[:3]],
        }
    base = report[chosen[0]]["output_tok_s"]
    print("| arm | tok/s | × first | minor faults / step | involuntary switches / step |")
    print("|---|---|---|---|---|")
    for spec, r in report.items():
        print(
            f"| {spec} | {r['output_tok_s']:.1f} | {r['output_tok_s'] / base:.2f} | "
            f"{r['minor_faults_per_step']:.1f} | {r['involuntary_switches_per_step']:.1f} |"
        )
    if args.out:
        meta = {"command": " ".join(sys.argv[1:]), **vars(args)}
        Path(args.out).write_text(json.dumps({"meta": meta, "arms": report}, indent=1))


if __name__ == "__main__":
    main()
