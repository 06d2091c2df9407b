"""Math word problems for drafter training, from GSM-Symbolic (PyPI `reasoning-gym`).

ShareGPT is chat; the held-out math set (ASDiv) is self-contained word problems, and a run
on later ShareGPT turns lost on it. GSM-Symbolic instantiates ~85 GSM8K templates with
fresh names and numbers, so it gives as many distinct problems as wanted. They are written
in the math prompt format every math benchmark here uses (`datasets.MATH_INSTRUCTION`);
`generate --prompts-file` drops any that overlap a held-out set and regenerates the
target's replies.

reasoning-gym imports a dozen packages we never need, so it runs in its own venv:
`make gsm-prompts` (writes bench/drafter/prompts_gsm_symbolic.jsonl.gz).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import reasoning_gym

from dflash_sglang.datasets import MATH_INSTRUCTION, write_prompt_file

# reasoning-gym appends this to every question; the math instruction already asks for it.
_SUFFIX = " Give the result as your final answer. Do not include units."


def prompts(size: int, seed: int) -> list[dict]:
    rows = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    return [
        {
            "text": MATH_INSTRUCTION.format(problem=row["question"].removesuffix(_SUFFIX)),
            "source": "gsm_symbolic",
        }
        for row in rows
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSONL.gz to write")
    a = p.parse_args(argv)
    if a.size < 1:
        p.error(f"--size must be >= 1, got {a.size}")
    rows = prompts(a.size, a.seed)
    write_prompt_file(a.out, rows)
    distinct = len({r["text"] for r in rows})
    print(f"{len(rows)} problems ({distinct} distinct) -> {Path(a.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
