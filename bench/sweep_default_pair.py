"""The README's concurrency sweep: the embedded target served plainly and with DFLASH_X.

    python bench/sweep_default_pair.py [--draft DIR|random] [--arms default,adaptive,fixed]
        [--concurrency 1,2,4,8,16,32] --out DIR

Starts the servers on loopback through our launcher (bf16, CPU) and runs
`python -m loadtest.sweep` against them, every arm and the baseline (plain decoding) taking
turns at each level. Arms (`--arms`, default `default`):
  default   DFLASH_X as launched (adaptive width, suffix lookups, warm shared index)
  adaptive  adaptive width, the DFlash block only (--dflash-suffix off)
  fixed     the whole block every step (--dflash-adaptive off --dflash-suffix off)
`--draft`: the bundled drafter by default, `random` for one that accepts nothing (what
speculation costs when it never pays). Ends with a headless-Chromium screenshot of the
first arm's `/dflash/` status page (`OUT/status_page.png`), showing the whole sweep.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_proposers import drafter  # noqa: E402

from tests.browser import screenshot  # noqa: E402

ARMS = {
    "default": [],
    "adaptive": ["--dflash-suffix", "off"],
    "fixed": ["--dflash-adaptive", "off", "--dflash-suffix", "off"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--draft", help="drafter dir, or 'random' (default: the bundled drafter)")
    ap.add_argument("--arms", default="default", help=f"comma list of {','.join(ARMS)}")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--requests-per-level", default="2x")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per server")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or len(set(arms)) != len(arms):
        ap.error(f"--arms: distinct names from {', '.join(ARMS)} (got {args.arms!r})")

    from dflash_sglang.default_model import ensure_default_target
    from dflash_sglang.managed_server import Server

    target = ensure_default_target()
    work = Path(tempfile.mkdtemp(prefix="dflash_sweep_"))
    draft = drafter(args.draft, target, work)
    common = ["--model-path", str(target), "--max-total-tokens", "65536"]
    common += ["--served-model-name", "SmolLM2-135M-Instruct"]
    with contextlib.ExitStack() as stack:
        servers = {}
        for arm in arms:
            flags = [*common, "--speculative-draft-model-path", draft, *ARMS[arm]]
            servers[arm] = Server(flags, work / f"{arm}.log", threads=args.threads)
            stack.callback(servers[arm].stop)
        ar = Server([*common, "--speculative-algorithm", "NONE"], work / "ar.log",
                    threads=args.threads)  # fmt: skip
        stack.callback(ar.stop)
        first, *others = arms
        sweep = [sys.executable, "-m", "loadtest.sweep", "--url", servers[first].url,
                 "--label", f"DFLASH_X {first}", "--baseline-url", ar.url,
                 "--baseline-label", "AR", "--concurrency", args.concurrency,
                 "--requests-per-level", args.requests_per_level,
                 "--max-tokens", str(args.max_tokens), "--ignore-eos",
                 "--dataset", "mixed", "--out", args.out]  # fmt: skip
        for arm in others:
            sweep += ["--also", f"DFLASH_X {arm}={servers[arm].url}"]
        code = subprocess.call(sweep, cwd=ROOT)
        screenshot(servers[first].url + "/dflash/", Path(args.out) / "status_page.png")
        return code


if __name__ == "__main__":
    sys.exit(main())
