"""The README's concurrency sweep: the embedded target served plainly and with DFLASH_X.

    python bench/sweep_default_pair.py [--draft DIR] [--concurrency 1,2,4,8,16,32] --out DIR

Starts both servers on loopback through our launcher (bf16, CPU) and runs
`python -m loadtest.sweep` against them, DFLASH_X and the baseline alternating per level.
Without --draft it uses the bundled default drafter, else a random one (which measures only
the overhead of speculation). Ends with a headless-Chromium screenshot of the DFLASH_X
server's `/dflash/` status page (`OUT/status_page.png`), showing the whole sweep.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.browser import screenshot  # noqa: E402


def default_or_random_draft(target: Path, work: Path) -> Path:
    from dflash_sglang import default_model
    from dflash_sglang.checkpoint import write_random_draft
    from dflash_sglang.drafters import default_draft_dir

    bundled = default_draft_dir()
    if bundled is not None:
        return Path(bundled)
    print("no bundled drafter: using a random one (overhead only)", file=sys.stderr)
    return write_random_draft(
        target, work / "draft", mask_token_id=default_model.MASK_TOKEN_ID, intermediate_size=1536
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--draft", help="drafter dir (default: bundled, else random)")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--requests-per-level", default="2x")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per server")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from dflash_sglang.default_model import ensure_default_target
    from dflash_sglang.managed_server import Server

    target = ensure_default_target()
    work = Path(tempfile.mkdtemp(prefix="dflash_sweep_"))
    draft = Path(args.draft) if args.draft else default_or_random_draft(target, work)
    common = ["--model-path", str(target), "--max-total-tokens", "65536"]
    common += ["--served-model-name", "SmolLM2-135M-Instruct"]
    dflash = Server([*common, "--speculative-draft-model-path", str(draft)],
                    work / "dflash.log", threads=args.threads)  # fmt: skip
    try:
        ar = Server([*common, "--speculative-algorithm", "NONE"], work / "ar.log",
                    threads=args.threads)  # fmt: skip
        try:
            sweep = [sys.executable, "-m", "loadtest.sweep", "--url", dflash.url,
                     "--baseline-url", ar.url, "--label", "DFLASH_X", "--baseline-label", "AR",
                     "--concurrency", args.concurrency,
                     "--requests-per-level", args.requests_per_level,
                     "--max-tokens", str(args.max_tokens), "--ignore-eos",
                     "--dataset", "mixed", "--out", args.out]  # fmt: skip
            code = subprocess.call(sweep, cwd=ROOT)
            screenshot(dflash.url + "/dflash/", Path(args.out) / "status_page.png")
            return code
        finally:
            ar.stop()
    finally:
        dflash.stop()


if __name__ == "__main__":
    sys.exit(main())
