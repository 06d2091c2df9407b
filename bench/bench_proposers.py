"""Plain decoding vs DFLASH_X's proposal sources and adaptive width, interleaved, per prompt set.

    python bench/bench_proposers.py [--draft DIR|random] [--arms ar,dx,fixed] \
        [--concurrency 1,4,16] [--sets mt_bench,humaneval,math,summaries] [--out F.json]

All arms serve the embedded target (bf16, CPU) with the same drafter (default: the bundled
one); each (level, set) sends the same held-out prompts to every arm, in `--rounds` slices
the arms take turns on (order rotated per slice), so machine noise hits all arms alike.
No server sees a prompt twice (each level takes the next prompts of the set): a shared
suffix index must not be credited for replaying an output it already holds. Arms:
  ar        --speculative-algorithm NONE
  dx        DFLASH_X as launched by default with the embedded model (adaptive width, suffix
            lookup over the request's own text and over finished requests' outputs, the
            latter warm from the bundled corpus)
  cold      the same, the shared lookup starting empty (--dflash-suffix-warm none: the
            default before the corpus was bundled, and for models given by path)
  adaptive  adaptive width, DFlash block only (--dflash-suffix off)
  fixed     the whole block every step, DFlash only (--dflash-adaptive off --dflash-suffix off)
  own       the default launch without the shared lookup (--dflash-suffix-shared 0), the
            default before it was measured (bench/proposers/shared_*.json, whose arm
            "shared" is today's default)
  tree      the default launch with two-branch trees priced by the planner (--dflash-tree on)
Any arm named `ARM@base` is ARM served from git revision `--base` instead of this tree
(before/after a change, in one interleaved run), with `--base-draft`'s drafter if given.
τ per source comes from the servers' `dflash_*` counters (before/after each run).

Each user sends its next prompt when the last one returns, so a slice ends with a drain:
the last requests run in a shrinking batch, and the slowest of them sets the slice's time.
tok/s counts the whole slice (the drain included: a batch job's view, which charges an arm
for how much its requests' speeds vary); steady tok/s counts the tokens streamed from the
first user's second prompt (the opening burst of simultaneous prefills behind) to the
moment the last prompt was sent, while every user had a request in flight at staggered
points (a server under continuous load; None when a slice has too few prompts per user).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash_sglang import suffix_corpus
from dflash_sglang.loadtest import server_metrics
from dflash_sglang.loadtest.level_stats import steady_rate, steady_window
from dflash_sglang.managed_server import Server, paused
from dflash_sglang.metrics import (
    ACCEPTED,
    DRAFTS,
    PLAIN_STEPS,
    PREDICTED_ACCEPTED,
    STEP_WIDTH,
    STEPS,
    tau,
)
from dflash_sglang.proposals import SOURCES

# The benchmarks pass --model-path, so the embedded model's default corpus is named here.
WARM = ["--dflash-suffix-warm", str(suffix_corpus.bundled())]
ARMS_FIXED = ["--dflash-adaptive", "off", "--dflash-suffix", "off"]
ARMS_WIDTH1 = ["--dflash-widths", "1", "--dflash-suffix", "off"]
ARMS = {
    "ar": ["--speculative-algorithm", "NONE"],
    "dx": WARM,
    "cold": ["--dflash-suffix-warm", "none"],
    "adaptive": ["--dflash-suffix", "off"],
    "fixed": ARMS_FIXED,
    "own": ["--dflash-suffix-shared", "0"],
    # Two-branch trees (off by default): on, priced by the planner; always, on every
    # drafting step of a request with a suffix proposal.
    "tree": [*WARM, "--dflash-tree", "on"],
    "tree_always": [*WARM, "--dflash-tree", "always"],
    # Diagnostics for the cost of width 1: plain decoding without SGLang's overlap loop
    # (DFLASH_X runs without it on CPU), and DFLASH_X pinned to plain-decoding steps.
    "ar_no_overlap": ["--speculative-algorithm", "NONE", "--disable-overlap-schedule"],
    # Plain decoding with prompt chunks mixed into decode batches (as vLLM v1 schedules).
    "ar_mixed": ["--speculative-algorithm", "NONE", "--enable-mixed-chunk"],
    "width1": ARMS_WIDTH1,
    # DFlash block at a fixed narrow width: what a step that drafts costs against its gain.
    "width2": ["--dflash-widths", "2", "--dflash-suffix", "off"],
    "width4": ["--dflash-widths", "4", "--dflash-suffix", "off"],
    # The target's forward as SGLang runs it, uncompiled (before/after).
    "ar_eager": ["--speculative-algorithm", "NONE", "--dflash-cpu-compile", "off"],
    "dx_eager": [*WARM, "--dflash-cpu-compile", "off"],
    # The drafter's block forward eager, the target's compiled (before/after for the draft).
    "dx_draft_eager": [*WARM, "--dflash-cpu-compile", "target"],
    "fixed_draft_eager": [*ARMS_FIXED, "--dflash-cpu-compile", "target"],
    # The compiled forwards over plain weights, as before prepacked ones (before/after).
    "ar_nofreeze": ["--speculative-algorithm", "NONE", "--dflash-cpu-freeze", "off"],
    "dx_nofreeze": [*WARM, "--dflash-cpu-freeze", "off"],
    # KV injection every step, as before it waited for steps that draft (before/after).
    "width1_inject_each": [*ARMS_WIDTH1, "--dflash-defer-injection", "0"],
    "dx_inject_each": [*WARM, "--dflash-defer-injection", "0"],
    # Attention of decode and narrow verify batches in SDPA, as before grouped matmuls.
    "ar_sdpa": ["--speculative-algorithm", "NONE", "--dflash-cpu-attention", "sdpa"],
    "dx_sdpa": [*WARM, "--dflash-cpu-attention", "sdpa"],
    # Few-row attention as grouped matmuls over gathered K/V, as before the C++ kernel.
    "ar_grouped": ["--speculative-algorithm", "NONE", "--dflash-cpu-attention", "grouped"],
    "dx_grouped": [*WARM, "--dflash-cpu-attention", "grouped"],
}
SET_NAMES = ("mt_bench", "humaneval", "math", "summaries")
BASE = "@base"
# Streamed requests send a chunk per this many tokens (a step can add several): the steady
# window's token count is exact to within one chunk per request, and the arms pay the same
# streaming cost per token whatever their tokens per step.
STREAM_INTERVAL = 8
REPO = Path(__file__).resolve().parents[1]


def prompt_sets(names: list[str], tokenizer, count: int, max_prompt_tokens: int) -> dict:
    from dflash_sglang import datasets

    loaders = {
        "mt_bench": datasets.mt_bench,
        "humaneval": datasets.humaneval,
        "math": datasets.math_problems,
        "summaries": datasets.summaries,
    }
    out = {}
    for name in names:
        ids = (chat_ids(tokenizer, text) for text in loaders[name]())
        out[name] = [p for p in ids if len(p) <= max_prompt_tokens][:count]
    return out


def chat_ids(tokenizer, text: str) -> list[int]:
    chat = [{"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False).input_ids


def run(server: Server, prompts: list[list[int]], concurrency: int, sampling: dict) -> dict:
    """Output tokens and seconds over `prompts` at `concurrency` (closed loop: each user
    sends its next prompt when the last one returns), the same over the steady window, and
    the counter deltas; `sampling`: the request's sampling parameters (`max_new_tokens`,
    `ignore_eos`, ...)."""
    pending = list(reversed(prompts))
    lock = threading.Lock()
    before = server_metrics.scrape(server.url)
    start = time.perf_counter()
    sent: list[float] = []  # when each prompt was taken

    def user() -> list[list[tuple[float, int]]]:
        timelines = []
        while True:
            with lock:
                if not pending:
                    return timelines
                ids = pending.pop()
                sent.append(time.perf_counter())
            timelines.append(server.generate_stream(ids, STREAM_INTERVAL, **sampling))

    with ThreadPoolExecutor(concurrency) as pool:
        users = [pool.submit(user) for _ in range(concurrency)]
        timelines = [t for u in users for t in u.result()]
    elapsed = time.perf_counter() - start
    first, last = steady_window(sent, concurrency)
    deltas = server_metrics.counter_deltas(before, server_metrics.scrape(server.url))
    return {
        "tokens": sum(t[-1][1] for t in timelines),
        "seconds": elapsed,
        "steady_tokens": tokens_by(timelines, last) - tokens_by(timelines, first),
        "steady_seconds": last - first,
        "deltas": deltas,
    }


def tokens_by(timelines: list[list[tuple[float, int]]], moment: float) -> int:
    """Tokens the streams had delivered by `moment` (each timeline: (time, tokens so far))."""
    return sum(max((n for t, n in timeline if t <= moment), default=0) for timeline in timelines)


def interleaved(servers: dict[str, Server], prompts: list, c: int, sampling: dict, rounds: int):
    """Each arm's totals over `rounds` slices of `prompts`; the arms take turns per slice, in
    an order rotated every slice, so slow and fast moments of the machine hit all alike, and
    the others are paused meanwhile (`managed_server.paused`)."""
    fields = ("tokens", "seconds", "steady_tokens", "steady_seconds")
    totals = {arm: dict.fromkeys(fields, 0) | {"deltas": {}} for arm in servers}
    arms = list(servers)
    for i in range(rounds):
        part = prompts[i::rounds]
        for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:
            with paused(s for other, s in servers.items() if other != arm):
                got = run(servers[arm], part, c, sampling)
            total = totals[arm]
            for field in fields:
                total[field] += got[field]
            for key, value in got["deltas"].items():
                total["deltas"][key] = total["deltas"].get(key, 0.0) + value
    return {
        arm: {field: t[field] for field in fields}
        | {
            "tok_s": t["tokens"] / t["seconds"],
            "steady_tok_s": steady_rate(t["steady_tokens"], t["steady_seconds"]),
        }
        | counts(t["deltas"])
        for arm, t in totals.items()
    }


def counts(deltas: dict[str, float]) -> dict:
    """τ overall and per source, and the share of steps with speculation off."""

    def by_source(name: str, source: str) -> float:
        return deltas.get(server_metrics.sample_key(name, {"source": source}), 0.0)

    total = server_metrics.total
    steps = total(deltas, STEPS)
    return {
        "tau": tau(total(deltas, ACCEPTED), total(deltas, DRAFTS)),
        "tau_by_source": {s: tau(by_source(ACCEPTED, s), by_source(DRAFTS, s)) for s in SOURCES},
        "predicted_tau_by_source": {
            s: tau(by_source(PREDICTED_ACCEPTED, s), by_source(DRAFTS, s)) for s in SOURCES
        },
        "drafts_by_source": {s: by_source(DRAFTS, s) for s in SOURCES},
        "plain_step_share": total(deltas, PLAIN_STEPS) / steps if steps else None,
        "width_share": width_shares(deltas),
        "step_time_by_option": server_metrics.step_time(deltas),
    }


def width_shares(deltas: dict[str, float]) -> dict[int, float]:
    """Share of decode steps at each verify width, from the width histogram's buckets
    (summed over label sets, e.g. one per scheduler process)."""
    cumulative: dict[float, float] = {}
    for key, value in deltas.items():
        le = re.search(r'le="([^"]+)"', key)
        if key.startswith(STEP_WIDTH + "_bucket{") and le and le.group(1) != "+Inf":
            cumulative[float(le.group(1))] = cumulative.get(float(le.group(1)), 0.0) + value
    steps = server_metrics.total(deltas, STEP_WIDTH + "_count")
    shares, below = {}, 0.0
    for width, count in sorted(cumulative.items()):
        if count > below:
            shares[int(width)] = round((count - below) / steps, 4)
        below = count
    return shares if steps else {}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--draft", help="drafter dir, or 'random' (default: the bundled drafter)")
    ap.add_argument("--arms", default="ar,dx,fixed")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--sets", default=",".join(SET_NAMES))
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set at concurrency 1")
    ap.add_argument("--rounds", type=int, default=2, help="slices the arms take turns on")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every reply runs to --max-new-tokens: all arms decode the same number of "
        "tokens and batches shrink only when the slice ends, not as replies finish",
    )
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="requests' temperature (0: greedy)"
    )
    ap.add_argument("--top-p", type=float, default=1.0, help="requests' top_p")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per server")
    ap.add_argument(
        "--repeat-prompts",
        action="store_true",
        help="levels take prompts cyclically from the set (a set smaller than the levels "
        "need is reused); only for arms without the shared suffix lookup, which would be "
        "credited for replaying outputs it holds",
    )
    ap.add_argument("--base", help="git revision the ARM@base arms serve")
    ap.add_argument(
        "--base-draft",
        help="drafter dir (or 'random') the ARM@base arms serve (default: --draft's); with "
        "--base HEAD, the same code with two drafters",
    )
    ap.add_argument("--out", help="write the JSON result here")
    args = ap.parse_args()
    arms = [arm.removesuffix(BASE) for arm in args.arms.split(",")]
    for flag, value, allowed in (
        ("--arms", arms, ARMS),
        ("--sets", args.sets.split(","), SET_NAMES),
    ):
        bad = [v for v in value if v not in allowed]
        if bad:
            ap.error(f"{flag}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    if args.temperature < 0:
        ap.error(f"--temperature: must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p: must be in (0, 1], got {args.top_p}")
    if (BASE in args.arms) != (args.base is not None):
        ap.error(f"--base: needed by, and only by, arms named ARM{BASE}")
    if args.base_draft is not None and args.base is None:
        ap.error("--base-draft: only with --base (it is the ARM@base arms' drafter)")
    for flag, value in (("--draft", args.draft), ("--base-draft", args.base_draft)):
        if value not in (None, "random") and not (Path(value) / "config.json").is_file():
            ap.error(f"{flag}: {value!r} is not a drafter directory (no config.json)")
    if args.base is not None:
        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{args.base}^{{commit}}"],
            capture_output=True,
        )
        if rev.returncode != 0:
            ap.error(f"--base: {args.base!r} is not a commit of {REPO}")
        args.base = rev.stdout.decode().strip()  # the report names the commit, not "HEAD"
    return args


def base_tree(rev: str, work: Path) -> Path:
    """This repository at `rev`, importable ahead of the installed package (PYTHONPATH). The
    top-level `kernels/` and `server/` are linked where the package maps them."""
    tar = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True)
    root = work / "base"
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as archive:
        archive.extractall(root, filter="data")
    for name in ("kernels", "server"):
        (root / "dflash_sglang" / name).symlink_to(root / name)
    return root


def drafter(choice: str | None, target: Path, work: Path) -> str:
    from dflash_sglang import default_model
    from dflash_sglang.checkpoint import write_random_draft
    from dflash_sglang.drafters import default_draft_dir

    if choice == "random":
        path = write_random_draft(
            target,
            work / "draft",
            mask_token_id=default_model.MASK_TOKEN_ID,
            intermediate_size=1536,
        )
        return str(path)
    return choice or str(default_draft_dir())


def identity(path: str) -> str:
    """`NAME sha256:PREFIX` of a drafter directory's weights ('random' as given)."""
    weights = Path(path) / "model.safetensors"
    if not weights.is_file():
        return Path(path).name
    return f"{Path(path).name} sha256:{hashlib.sha256(weights.read_bytes()).hexdigest()[:12]}"


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from dflash_sglang.default_model import ensure_default_target

    target = ensure_default_target()
    work = Path(tempfile.mkdtemp(prefix="dflash_bench_"))
    draft = drafter(args.draft, target, work)
    levels = [int(c) for c in args.concurrency.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(target)
    needed = args.prompts * sum(levels)
    sets = prompt_sets(args.sets.split(","), tokenizer, needed, args.max_prompt_tokens)
    for name, prompts in sets.items():
        if len(prompts) < needed and not args.repeat_prompts:
            sys.exit(
                f"--sets {name}: {len(prompts)} prompts, but --prompts {args.prompts} over "
                f"--concurrency {args.concurrency} needs {needed} distinct ones (fewer "
                "--prompts or levels, or --repeat-prompts for arms without shared lookup)"
            )
    base_draft = drafter(args.base_draft, target, work) if args.base_draft else draft
    common = ["--model-path", str(target), "--max-total-tokens", "65536"]
    servers: dict[str, Server] = {}
    results = []
    try:
        base = None
        if args.base:  # PYTHONSAFEPATH: the working directory is not put ahead of it
            base = {"PYTHONPATH": str(base_tree(args.base, work)), "PYTHONSAFEPATH": "1"}
        for arm in args.arms.split(","):
            on_base = arm.endswith(BASE)
            flags = ["--speculative-draft-model-path", base_draft if on_base else draft]
            flags += ARMS[arm.removesuffix(BASE)]
            env = base if on_base else None
            servers[arm] = Server([*common, *flags], work / f"{arm}.log", args.threads, env=env)
        warm_up = chat_ids(tokenizer, "Say hello.")  # in no prompt set
        for server in servers.values():  # unmeasured
            run(server, [warm_up], 1, {"max_new_tokens": 16})
        sampling = {
            "max_new_tokens": args.max_new_tokens,
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "top_p": args.top_p,
        }
        offset = 0
        for c in levels:
            for name, prompts in sets.items():
                batch = [prompts[(offset + i) % len(prompts)] for i in range(args.prompts * c)]
                by_arm = interleaved(servers, batch, c, sampling, args.rounds)
                for arm, totals in by_arm.items():
                    results.append({"concurrency": c, "set": name, "arm": arm} | totals)
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
            offset += args.prompts * c
    finally:
        for server in servers.values():
            server.stop()
    # Drafters by name and content: the report holds no machine's paths, and two drafters
    # both named `drafter` stay told apart.
    names = {k: identity(v) for k in ("draft", "base_draft") if (v := getattr(args, k))}
    report = {"draft": identity(draft), "args": vars(args) | names, "runs": results}
    print_table(results)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


def print_table(results: list[dict]) -> None:
    ar = {(r["concurrency"], r["set"]): r for r in results if r["arm"] == "ar"}
    columns = ["concurrency", "set", "arm", "tok/s", "× ar", "steady × ar", "τ"]
    columns += [f"τ {s} (predicted)" for s in ("dflash", "suffix", "shared")]
    columns += ["plain steps", "step ms measured / predicted"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in results:
        base = ar.get((r["concurrency"], r["set"]), {})
        ratio = _num(r["tok_s"] / base["tok_s"] if base else None)
        steady, steady_base = r.get("steady_tok_s"), base.get("steady_tok_s")
        steady_ratio = _num(steady / steady_base if steady and steady_base else None)
        src, expected = r["tau_by_source"], r.get("predicted_tau_by_source", {})
        fmt = [_num(r["tau"])]
        fmt += [f"{_num(src[s])} ({_num(expected.get(s))})" for s in ("dflash", "suffix", "shared")]
        fmt += [_num(r["plain_step_share"])]
        times = ", ".join(
            f"{option} {t['measured_ms']:.1f} / {t['predicted_ms']:.1f}"
            for option, t in r.get("step_time_by_option", {}).items()
        )
        print(
            f"| {r['concurrency']} | {r['set']} | {r['arm']} | {r['tok_s']:.1f} | {ratio} | "
            + f"{steady_ratio} | "
            + " | ".join(fmt)
            + f" | {times or '–'} |"
        )


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
