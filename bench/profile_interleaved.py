"""Where two arms' decode steps differ, per function, from one interleaved run.

    python bench/profile_interleaved.py [--arms plain,dflash_x_width1] [--concurrency 16]
        [--slice 8] [--rounds 6] [--time-calls] [--no-spy] [--set math] [--out F.json]

`profile_step.py` runs its arms one after another, and this machine's speed drifts by tens
of percent between them, so only ratios inside one arm compare. Here every arm's server is
up at once with py-spy sampling its scheduler throughout, and the load takes turns: `slice`
seconds of `concurrency` closed-loop requests (64 tokens, `ignore_eos`) on each arm in
turn, `rounds` times. Drift then hits every arm alike. Per arm: output tok/s, and for every
function of the scheduler's event-loop thread, its inclusive milliseconds per decode step
(samples at 200 Hz x 5 ms over steps). Steps are output tokens over `concurrency`: exact
for one token per request per step (plain decoding, DFLASH_X at width 1), a step count
times τ otherwise. A server's idle slices show up in its polling frames only, so compare
functions inside `Scheduler.run_batch`, not the totals.

`--time-calls` also times every call of our paged attention kernel and of the compiled
target and draft forwards, the scheduler's decode steps and the phases of a DFLASH_X step
inside the servers (`call_timer/sitecustomize.py`): per arm, label and verify width, the
calls at full batch, their mean and median microseconds and nanoseconds per
key, which py-spy's samples cannot give (at this grain they move by ±1 ms per function
per step between arms that take turns). `--no-spy` leaves py-spy out, whose sampling
slows arms unequally (plain decoding's overlap loop runs two Python threads): the timers
alone, or without `--time-calls` the arms' output tok/s under this load and nothing else.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from bench_proposers import SET_NAMES, prompt_sets
from profile_step import PROMPT, arm_args, scheduler_pid

from dflash_sglang.managed_server import Server

RATE_HZ = 200
TIMER = Path(__file__).resolve().with_name("call_timer")


def function_ms(lines: list[str], steps: float) -> dict[str, float]:
    """Inclusive ms per step of each function (`func (file)`, line numbers dropped) on the
    event-loop thread of a py-spy `--threads --format raw` dump; a recursive function
    counts once per sample."""
    by_thread: dict[str, list[tuple[list[str], int]]] = {}
    loop: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        thread, _, frames = stack.partition(";")
        by_thread.setdefault(thread, []).append((frames.split(";"), int(count)))
        if "Scheduler.run_event_loop" in frames:
            loop[thread] += int(count)
    inclusive: Counter[str] = Counter()
    for frames, n in by_thread[loop.most_common(1)[0][0]] if loop else []:
        for name in {re.sub(r":\d+\)$", ")", f) for f in frames}:
            inclusive[name] += n
    return {name: n * 1000 / RATE_HZ / steps for name, n in inclusive.items()}


def timed_calls(lines: list[str], batch: int) -> dict[str, dict[str, float]]:
    """Per label and width, a summary of the calls over `batch` requests from `call_timer`
    lines (`label requests keys rows nanoseconds`); other batch sizes (ramp-up, tails,
    prefills of a few requests) are left out. A label stands alone for one row per request
    (plain decoding, width 1) and as `label wN` for N rows per request (a verify of width N;
    the drafter's block); prefill forwards, whatever their rows, as one label."""
    by_label: dict[str, list[tuple[int, int]]] = {}
    for line in lines:
        if line.strip():
            label, requests, keys, rows, ns = line.split()
            if int(requests) == batch:
                width = int(rows) // batch
                wide = width > 1 and not label.endswith(".prefill")
                key = f"{label} w{width}" if wide else label
                by_label.setdefault(key, []).append((int(ns), int(keys)))
    summary = {}
    for label, calls in sorted(by_label.items()):
        calls.sort()
        total_ns, total_keys = sum(ns for ns, _ in calls), sum(keys for _, keys in calls)
        summary[label] = {
            "calls": len(calls),
            "mean_us": total_ns / len(calls) / 1e3,
            "median_us": calls[len(calls) // 2][0] / 1e3,
            "ns_per_key": total_ns / max(total_keys, 1),
            "keys_per_call": total_keys / len(calls),
        }
    return summary


def spy_command(pid: int, seconds: int, out: Path) -> list[str]:
    """py-spy sampling every thread of `pid`, idle frames included, raw stacks to `out`."""
    return [str(Path(sys.executable).with_name("py-spy")), "record", "--idle", "--threads",
            "--format", "raw", "--rate", str(RATE_HZ), "--duration", str(seconds),
            "--pid", str(pid), "--output", str(out), "--nonblocking"]  # fmt: skip


def drive(
    server: Server, concurrency: int, seconds: float, prompts: Iterator[list[int]] | None = None
) -> tuple[int, float]:
    """`concurrency` closed-loop clients for `seconds`: (output tokens, seconds taken). Each
    request is `PROMPT`, or the next of `prompts` (chat-templated ids) when given."""
    stop, tokens, lock = threading.Event(), [], threading.Lock()

    def client() -> None:
        while not stop.is_set():
            if prompts is None:
                prompt = {"text": PROMPT}
            else:
                with lock:
                    prompt = {"input_ids": next(prompts)}
            meta = server.generate(**prompt, max_new_tokens=64, ignore_eos=True)["meta_info"]
            tokens.append(meta["completion_tokens"])

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(tokens), time.perf_counter() - start


def add_turn_args(ap: argparse.ArgumentParser, arms: str, concurrency: int, rounds: int) -> None:
    """The options of arms taking turns under closed-loop load (this script and
    `process_counters.py`)."""
    ap.add_argument("--arms", default=arms)
    ap.add_argument("--concurrency", type=int, default=concurrency)
    ap.add_argument("--slice", type=float, default=8.0, help="seconds of load per turn")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--threads", type=int, default=2)


def check_turn_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.concurrency < 1 or args.slice <= 0 or args.rounds < 1:
        ap.error("--concurrency, --slice and --rounds must be positive")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_turn_args(ap, "plain,dflash_x_width1", concurrency=16, rounds=6)
    ap.add_argument("--top", type=int, default=40, help="functions printed, by |difference|")
    ap.add_argument("--time-calls", action="store_true", help="time kernel and forward calls")
    ap.add_argument(
        "--no-spy",
        action="store_true",
        help="no py-spy (its sampling slows the arms unequally): timers with --time-calls, "
        "else output tok/s alone",
    )
    ap.add_argument(
        "--set",
        choices=SET_NAMES,
        help="requests cycle through this held-out prompt set (every arm the same sequence; "
        "distinct prompts of real lengths, so prefills are real) instead of one short prompt",
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    names = list(arm_args(Path(), Path()))
    chosen = args.arms.split(",")
    unknown = sorted(set(chosen) - set(names))
    if unknown or len(set(chosen)) != len(chosen) or len(chosen) < 2:
        ap.error(f"--arms: two or more different of {', '.join(names)} (got {args.arms})")
    check_turn_args(ap, args)
    return args


def run_arms(
    args: argparse.Namespace,
    arms: dict[str, list[str]],
    prompts: list[list[int]] | None,
    work: Path,
) -> tuple[Counter, Counter]:
    """Start every arm's server (py-spy on each scheduler unless --no-spy) and drive them
    in turns: output tokens and seconds per arm."""
    chosen = args.arms.split(",")
    servers: dict[str, Server] = {}
    try:
        for name in chosen:
            env = None
            if args.time_calls:
                (work / name).mkdir()
                path = os.pathsep.join(filter(None, [str(TIMER), os.environ.get("PYTHONPATH")]))
                env = {"PYTHONPATH": path, "DFLASH_CALL_TIMES": str(work / name)}
            servers[name] = Server(arms[name], work / f"{name}.log", threads=args.threads, env=env)
            servers[name].generate(PROMPT, max_new_tokens=16)
        seconds = int(args.rounds * len(chosen) * args.slice + 30)
        spies = [
            subprocess.Popen(
                spy_command(scheduler_pid(server), seconds, work / f"{name}.txt"),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for name, server in servers.items()
            if not args.no_spy
        ]
        if spies:
            time.sleep(3)  # py-spy attached
        tokens, elapsed = Counter(), Counter()
        sequences = {name: itertools.cycle(prompts) if prompts else None for name in chosen}
        for _ in range(args.rounds):
            for name in chosen:
                n, s = drive(servers[name], args.concurrency, args.slice, sequences[name])
                tokens[name] += n
                elapsed[name] += s
        for spy in spies:
            spy.wait()
    finally:
        for server in servers.values():
            server.stop()
    return tokens, elapsed


def arm_report(
    args: argparse.Namespace, name: str, tokens: int, seconds: float, work: Path
) -> dict:
    """One arm's tok/s and ms per step by function (py-spy), and its timed calls."""
    steps = tokens / args.concurrency
    lines = [] if args.no_spy else (work / f"{name}.txt").read_text().splitlines()
    report = {
        "output_tok_s": tokens / seconds,
        "steps": steps,
        "ms_per_step": {  # the functions that matter, not every frame seen once
            k: v for k, v in function_ms(lines, steps).items() if v >= 0.05
        },
    }
    if args.time_calls:
        timed = [line for f in (work / name).glob("*.txt") for line in f.read_text().splitlines()]
        report["timed_calls"] = timed_calls(timed, args.concurrency)
        for label, calls in report["timed_calls"].items():
            print(f"{name} {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in calls.items()))
    return report


def main() -> None:
    args = parse_args()
    from dflash_sglang.default_model import ensure_default_target
    from dflash_sglang.drafters import default_draft_dir

    target = ensure_default_target()
    prompts = None
    if args.set:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target)
        prompts = prompt_sets([args.set], tokenizer, 10**6, max_prompt_tokens=1024)[args.set]
    work = Path(tempfile.mkdtemp(prefix="dflash_interleaved_"))
    print(f"servers' logs and py-spy stacks in {work}", file=sys.stderr)
    tokens, elapsed = run_arms(args, arm_args(target, default_draft_dir()), prompts, work)
    chosen = args.arms.split(",")
    report = {name: arm_report(args, name, tokens[name], elapsed[name], work) for name in chosen}
    base, other = chosen[0], chosen[1]
    a, b = report[base]["ms_per_step"], report[other]["ms_per_step"]
    print("tok/s: " + ", ".join(f"{n} {report[n]['output_tok_s']:.1f}" for n in chosen))
    print(f"{'ms/step ' + base:>14} {other:>16}  function")
    for name in sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))[: args.top]:
        print(f"{a.get(name, 0):14.2f} {b.get(name, 0):16.2f}  {name[:120]}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
