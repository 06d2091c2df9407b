"""Instruction prompts for drafter training, from the OpenAI Evals registry (PyPI `evals`).

ShareGPT's chat stopped paying on MT-Bench after ~20,000 later turns (README 24.); the
registry's 470 evals are tasks of other kinds (extraction, reasoning, science, word
problems, formats), written as chat inputs. Each eval gives at most `--per-eval` distinct
prompts so no large synthetic file dominates; only English-script prompts of system and
user turns are kept (a reply of the target to a few-shot chat of someone else's replies is
not what it serves). `generate --prompts-file` drops any that overlap a held-out set and
regenerates the target's replies.

The wheel is read as a zip, never installed (43 dependencies):
`make evals-prompts` (writes bench/drafter/prompts_openai_evals.jsonl.gz).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import itertools
import json
import sys
import zipfile
from collections import defaultdict
from pathlib import Path

from dflash_sglang.datasets import write_prompt_file

_DATA = "evals/registry/data/"


def prompt_text(line: str) -> str | None:
    """The system and user turns of one registry sample, joined; None for anything else."""
    try:
        sample = json.loads(line)
    except json.JSONDecodeError:
        return None
    turns = sample.get("input") if isinstance(sample, dict) else None
    if not isinstance(turns, list) or not turns:
        return None
    if not all(isinstance(t, dict) and t.get("role") in ("system", "user") for t in turns):
        return None
    return "\n\n".join(str(t.get("content", "")) for t in turns).strip()


def keep(text: str, min_chars: int, max_chars: int) -> bool:
    # Mostly ASCII: the target is an English model, and its replies to other scripts are noise.
    ascii_share = sum(c.isascii() for c in text) / max(len(text), 1)
    return min_chars <= len(text) <= max_chars and ascii_share >= 0.98


def prompts(
    wheel: str, per_eval: int, lines_per_file: int, min_chars: int, max_chars: int
) -> list[dict]:
    by_eval: dict[str, set[str]] = defaultdict(set)
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            if not (name.startswith(_DATA) and name.endswith(".jsonl")):
                continue
            eval_name = name[len(_DATA) :].split("/")[0]
            with io.TextIOWrapper(z.open(name), errors="replace") as f:
                texts = (prompt_text(line) for line in itertools.islice(f, lines_per_file))
                by_eval[eval_name].update(t for t in texts if t and keep(t, min_chars, max_chars))
    rows = []
    for eval_name in sorted(by_eval):
        # A hash order: a fixed, content-blind sample of each eval (files are often sorted).
        chosen = sorted(by_eval[eval_name], key=lambda t: hashlib.sha1(t.encode()).digest())
        rows += [{"text": t, "source": "openai_evals"} for t in chosen[:per_eval]]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheel", required=True, help="evals-3.0.1.post1-py3-none-any.whl")
    p.add_argument("--per-eval", type=int, default=20, help="distinct prompts per eval at most")
    p.add_argument("--lines-per-file", type=int, default=3000, help="lines read per data file")
    p.add_argument("--min-chars", type=int, default=40)
    p.add_argument("--max-chars", type=int, default=2000)
    p.add_argument("--out", required=True, help="JSONL.gz to write")
    a = p.parse_args(argv)
    for flag in ("per_eval", "lines_per_file", "min_chars", "max_chars"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if not zipfile.is_zipfile(a.wheel):
        p.error(f"--wheel: not a wheel (zip) file: {a.wheel}")
    rows = prompts(a.wheel, a.per_eval, a.lines_per_file, a.min_chars, a.max_chars)
    write_prompt_file(a.out, rows)
    print(f"{len(rows)} prompts from the OpenAI Evals registry -> {Path(a.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
