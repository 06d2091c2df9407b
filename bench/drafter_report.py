"""The README's drafter table: τ, acceptance histogram and single-stream speedup on held-out sets.

    python bench/drafter_report.py [--drafter DIR] [--limit 20] --out bench/drafter/report.json

For the embedded SmolLM2 target and a drafter (default: the bundled one) it runs
`training.evaluate` with the reference loop (fp32, exact) and through two servers started by
our launcher on the same build: DFLASH_X with the drafter, and plain decoding. Prompts go to
both servers one at a time, alternating which goes first, so the speedup is a same-run ratio.
Temperature 0, block size of the drafter, up to --max-new-tokens new tokens. Each prompt is
also decoded by the target alone (HF, fp32): the reference loop must reproduce it exactly.
The DFLASH_X server runs pure DFlash (whole block every step, no suffix lookup) unless
--dflash-args says otherwise, so its τ is the drafter's; --temperature-one adds τ and the
speedup at temperature 1 (exact sampling) through the same two servers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_sglang.options import PURE_DFLASH_ARGS  # noqa: E402


def table(report: dict) -> str:
    """Markdown rows: one per set, reference and server side by side."""
    rows = [
        "| set | prompts | τ reference | reference = plain greedy | τ server "
        "| server tok/s DFLASH_X / AR | speedup | same output as AR "
        "| acceptance at draft 1 / 2 / 3 | τ server T=1 | speedup T=1 "
        "| server histogram (accepted length 1..16) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    spread = " spread" if report.get("spread") else ""
    for name, entry in report.items():
        if not isinstance(entry, dict) or "reference" not in entry:
            continue
        ref, srv, t1 = entry["reference"], entry.get("server", {}), entry.get("server_t1", {})
        first = " / ".join(f"{x:.2f}" for x in srv.get("accept_at", [])[:3])
        sampled = f"{t1['tau']:.2f} | {t1['speedup']:.2f}x" if t1 else "- | -"
        rows.append(
            f"| {name} | {entry['prompts']}{spread} | {ref['tau']:.2f} "
            f"| {ref.get('same_as_plain_greedy', '-')} | {srv.get('tau') or 0:.2f} "
            f"| {srv.get('tokens_per_s', 0):.1f} / {srv.get('baseline_tokens_per_s', 0):.1f} "
            f"| {srv.get('speedup', 0):.2f}x | {srv.get('same_output_as_baseline', '-')} "
            f"| {first} | {sampled} "
            f"| {' '.join(map(str, srv.get('histogram', [])))} |"
        )
    return "\n".join(rows)


def _temperature_one(report: dict, target, url: str, baseline: str, max_new: int) -> None:
    """τ and speedup at temperature 1 on the same prompts, through the same servers."""
    from transformers import AutoTokenizer

    from dflash_sglang.training import evaluate
    from dflash_sglang.training.data import chat_ids, heldout_sets

    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = heldout_sets()
    for name, entry in report.items():
        if not isinstance(entry, dict) or "reference" not in entry:
            continue
        picked = evaluate.pick(texts[name], entry["prompts"], report["spread"])
        prompts = [chat_ids(tokenizer, t, evaluate.MAX_PROMPT_TOKENS) for t in picked]
        bs = report["block_size"]
        entry["server_t1"] = evaluate.through_server(
            url, prompts, max_new, bs, baseline, temperature=1.0
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--drafter", help="drafter dir (default: the bundled one)")
    ap.add_argument("--sets", default="mt_bench,humaneval,math")
    ap.add_argument("--limit", type=int, default=20, help="prompts per set")
    ap.add_argument("--spread", action="store_true", help="--limit prompts spaced over each set")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--server-dtype", default="bfloat16", help="servers' --dtype (as served)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per server")
    ap.add_argument("--out", required=True, help="JSON report (a .md table is written beside)")
    ap.add_argument(
        "--dflash-args",
        help=f"extra DFLASH_X server flags (default: pure DFlash: {' '.join(PURE_DFLASH_ARGS)})",
    )
    ap.add_argument("--temperature-one", action="store_true", help="also measure at T=1")
    args = ap.parse_args()

    import torch

    from dflash_sglang.default_model import ensure_default_target
    from dflash_sglang.drafters import default_draft_dir
    from dflash_sglang.managed_server import Server
    from dflash_sglang.training import evaluate

    torch.set_num_threads(args.threads)
    drafter = args.drafter or default_draft_dir()
    if drafter is None:
        ap.error("--drafter: no bundled drafter in this build; pass one")
    target = ensure_default_target()
    logs = Path(tempfile.mkdtemp(prefix="dflash_report_"))
    common = ["--model-path", str(target), "--dtype", args.server_dtype]
    common += ["--max-total-tokens", "16384"]
    extra = args.dflash_args.split() if args.dflash_args is not None else list(PURE_DFLASH_ARGS)
    dflash = Server([*common, "--speculative-draft-model-path", drafter, *extra],
                    logs / "dflash.log", threads=args.threads)  # fmt: skip
    try:
        ar = Server([*common, "--speculative-algorithm", "NONE"], logs / "ar.log",
                    threads=args.threads)  # fmt: skip
        try:
            report = evaluate.run(
                target,
                Path(drafter),
                args.sets.split(","),
                limit=args.limit,
                max_new_tokens=args.max_new_tokens,
                block_size=None,
                dtype="float32",
                server_url=dflash.url,
                baseline_url=ar.url,
                check_greedy=True,
                spread=args.spread,
            )
            if args.temperature_one:
                _temperature_one(report, target, dflash.url, ar.url, args.max_new_tokens)
        finally:
            ar.stop()
    finally:
        dflash.stop()
    report["server_dtype"] = args.server_dtype
    report["dflash_args"] = extra
    if Path(drafter).resolve().is_relative_to(REPO):  # no machine paths in committed reports
        report["drafter"] = str(Path(drafter).resolve().relative_to(REPO))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(table(report) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
