"""Where a decode step's time goes: plain decoding vs DFLASH_X, sampled with py-spy.

    python bench/profile_step.py [--concurrency 1,8] [--seconds 30] [--out F.json]

Serves the embedded target in turn: plain, DFLASH_X with the bundled drafter as launched by
default, with the whole block every step (fixed), and pinned to width 1. Keeps
`concurrency` greedy requests in flight on each, and samples the scheduler process's Python
stacks with py-spy (`--idle`, so waiting is counted too). Each
sample is charged to the innermost phase it is in:

  draft        DFlashXWorker.draft_block (the drafter's forward and head)
  verify       DFlashXWorker.verify (the target forward over the chain); for plain
               decoding, TpModelWorker.forward_batch_generation
  accept       DFlashXWorker.accept
  inject       DFlashXWorker._inject_committed (KV injection)
  plan         DFlashXWorker.plan_step (suffix lookup + planner)
  metrics      our step observers and the exporters
  scheduler    everything else in the scheduler process: batching, result processing,
               streaming out, waiting for the tokenizer/detokenizer processes
Output: the share of samples per phase, the mean step time (from the servers' counters), and
`step_per_forward`: all samples over those inside the target model's forward
(`ModelRunner.forward` within the verify phase). Arms run one after another, and this
machine's speed drifts by tens of percent over minutes, so step times of different arms are
not comparable; the same tokens through the same target forward cost the same within a
run, so `step_per_forward` compares what each arm adds around that forward.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

from dflash_sglang.loadtest import server_metrics
from dflash_sglang.managed_server import Server

# Innermost match wins: py-spy frames read `Class.method (file:line)`.
PHASES = {
    "DFlashXWorker.draft_block": "draft",
    "DFlashXWorker.verify": "verify",
    "DFlashXWorker.accept": "accept",
    "DFlashXWorker._inject_committed": "inject",
    "DFlashXWorker.plan_step": "plan",
    "DFlashXWorker._export_step": "metrics",
    "DFlashXWorker._observe_step_start": "metrics",
    "TpModelWorker.forward_batch_generation": "verify",  # plain decoding's forward
}
PROMPT = "Write a detailed essay about the history of computing, with examples."


def scheduler_pid(server: Server) -> int:
    """The scheduler child of a launcher (SGLang names its processes `sglang::scheduler`)."""
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        if "scheduler" in " ".join(child.cmdline()) or "scheduler" in child.name():
            return child.pid
    raise RuntimeError("no scheduler process found under the launcher")


def phase_of(stack: str) -> str:
    """`stack` is py-spy's collapsed form: frames `func (file:line)` joined by ';'."""
    for frame in reversed(stack.split(";")):
        phase = PHASES.get(frame.split(" (", 1)[0])
        if phase is not None:
            return phase
    return "scheduler"


TARGET_FORWARD = "target forward"  # pseudo-phase: verify samples inside ModelRunner.forward


def event_loop_phases(lines: list[str]) -> Counter[str]:
    """Phase counts of the scheduler's event-loop thread (`--threads` puts the thread first
    in each stack); other threads (overlap workers, pools) are left out. Also counts, under
    `TARGET_FORWARD`, the verify samples inside the model forward itself."""
    by_thread: dict[str, Counter[str]] = {}
    loop_samples: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        thread, _, frames = stack.partition(";")
        phase = phase_of(frames)
        counts = by_thread.setdefault(thread, Counter())
        counts[phase] += int(count)
        if phase == "verify" and ";ModelRunner.forward (" in frames:
            counts[TARGET_FORWARD] += int(count)
        if "Scheduler.run_event_loop" in frames:
            loop_samples[thread] += int(count)
    return by_thread[loop_samples.most_common(1)[0][0]]


def profile(server: Server, concurrency: int, seconds: float, work: Path) -> dict:
    stop = threading.Event()
    done: list[tuple[float, int]] = []  # (finish time, output tokens)

    def client() -> None:
        while not stop.is_set():
            meta = server.generate(PROMPT, max_new_tokens=64, ignore_eos=True)["meta_info"]
            done.append((time.perf_counter(), meta["completion_tokens"]))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(5)  # reach a steady batch
    before = server_metrics.scrape(server.url)
    out = work / f"stacks_{server.port}_{concurrency}.txt"
    start = time.perf_counter()
    subprocess.run(
        [str(Path(sys.executable).with_name("py-spy")), "record", "--idle", "--threads",
         "--format", "raw",
         "--rate", "200", "--duration", str(int(seconds)), "--pid",
         str(scheduler_pid(server)), "--output", str(out), "--nonblocking"],
        check=True, capture_output=True,
    )  # fmt: skip
    end = time.perf_counter()
    deltas = server_metrics.counter_deltas(before, server_metrics.scrape(server.url))
    stop.set()
    for t in threads:
        t.join()
    samples = event_loop_phases(out.read_text().splitlines())
    forward = samples.pop(TARGET_FORWARD, 0)
    total = sum(samples.values())
    tok_s = sum(n for t, n in done if start < t <= end) / (end - start)
    # A plain step emits one token per request in flight; DFLASH_X counts its steps.
    steps = server_metrics.total(deltas, "dflash_num_steps_total") or tok_s * (end - start) / (
        concurrency
    )
    return {
        "share": {k: v / total for k, v in sorted(samples.items())},
        "output_tok_s": tok_s,
        "ms_per_step": 1000 * (end - start) / steps if steps else None,
        "step_per_forward": total / forward if forward else None,
    }


def arm_args(target: Path, draft: Path) -> dict[str, list[str]]:
    """Launcher arguments per arm: the embedded target, the bundled drafter."""
    common = ["--model-path", str(target), "--max-total-tokens", "65536"]
    dflash_x = [*common, "--speculative-draft-model-path", str(draft)]
    plain = [*common, "--speculative-algorithm", "NONE"]
    return {
        "plain": plain,
        # Plain decoding in DFLASH_X's loop shape on CPU (one Python thread, no overlap).
        "plain_no_overlap": [*plain, "--disable-overlap-schedule"],
        "dflash_x": dflash_x,
        "dflash_x_fixed": [*dflash_x, "--dflash-adaptive", "off", "--dflash-suffix", "off"],
        "dflash_x_width1": [*dflash_x, "--dflash-widths", "1"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--arms", help="comma list of " + ",".join(arm_args(Path(), Path())))
    args = ap.parse_args()

    from dflash_sglang.default_model import ensure_default_target
    from dflash_sglang.drafters import default_draft_dir

    work = Path(tempfile.mkdtemp(prefix="dflash_profile_"))
    arms = arm_args(ensure_default_target(), default_draft_dir())
    chosen = args.arms.split(",") if args.arms else list(arms)
    unknown = sorted(set(chosen) - set(arms))
    if unknown:
        ap.error(f"--arms: unknown {', '.join(unknown)} (choose from {', '.join(arms)})")
    print(f"raw py-spy stacks in {work}", file=sys.stderr)
    report = {}
    for name in chosen:  # one server at a time: nothing else on the cores
        launch = arms[name]
        server = Server(launch, work / f"{name}.log", threads=args.threads)
        try:
            server.generate(PROMPT, max_new_tokens=16)
            for c in map(int, args.concurrency.split(",")):
                report[f"{name} c={c}"] = profile(server, c, args.seconds, work)
                print(name, c, json.dumps(report[f"{name} c={c}"]), file=sys.stderr)
        finally:
            server.stop()
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
