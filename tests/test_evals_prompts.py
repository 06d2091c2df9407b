"""`bench/drafter/evals_prompts.py`: system and user turns of the OpenAI Evals registry
become training prompts, a bounded, stable sample per eval; the committed file is clean."""

from __future__ import annotations

import gzip
import importlib.util
import json
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "evals_prompts", ROOT / "bench" / "drafter" / "evals_prompts.py"
)
evals_prompts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(evals_prompts)

SYSTEM = {"role": "system", "content": "Answer the question in one short sentence."}


def _sample(question: str, *extra: dict) -> str:
    return json.dumps({"input": [SYSTEM, *extra, {"role": "user", "content": question}]})


def _wheel(tmp_path: Path) -> Path:
    big = [_sample(f"What is the capital of country number {i} on the list?") for i in range(9)]
    files = {
        "evals/registry/data/capitals/samples.jsonl": "\n".join(big),
        "evals/registry/data/mixed/a.jsonl": "\n".join(
            [
                _sample("Which planet is known as the red planet in our sky?"),
                _sample("Which planet is known as the red planet in our sky?"),  # twice
                json.dumps({"input": [{"role": "user", "content": "Short?"}]}),  # < 40 chars
                _sample("Translate this word for me please: " + "日本語" * 10),  # not English
                _sample(
                    "And the next one after that, in the same format?",
                    {"role": "assistant", "content": "Mars."},  # someone else's reply
                ),
                json.dumps({"input": "a plain string is not a chat input at all here"}),
                "not json",
            ]
        ),
        "evals/registry/data/mixed/b.jsonl": _sample(
            "Name a metal that is liquid at room temperature."
        ),
        "evals/registry/evals/capitals.yaml": "capitals: {}",  # not data
    }
    path = tmp_path / "evals-0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_system_and_user_turns_become_prompts_bounded_per_eval(tmp_path):
    wheel = _wheel(tmp_path)
    rows = evals_prompts.prompts(
        str(wheel), per_eval=4, lines_per_file=100, min_chars=40, max_chars=2000
    )
    texts = [r["text"] for r in rows]
    assert {r["source"] for r in rows} == {"openai_evals"}
    assert len(texts) == len(set(texts)) == 4 + 2  # capitals capped at 4; mixed has 2 kept
    assert all(t.startswith(SYSTEM["content"] + "\n\n") for t in texts)
    mixed = {t.split("\n\n", 1)[1] for t in texts if "capital" not in t}
    assert mixed == {
        "Which planet is known as the red planet in our sky?",
        "Name a metal that is liquid at room temperature.",
    }
    again = evals_prompts.prompts(
        str(wheel), per_eval=4, lines_per_file=100, min_chars=40, max_chars=2000
    )
    assert again == rows  # the sample per eval is stable
    first_lines = evals_prompts.prompts(
        str(wheel), per_eval=9, lines_per_file=2, min_chars=40, max_chars=2000
    )
    assert sum("capital" in r["text"] for r in first_lines) == 2


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--per-eval", "0"], "--per-eval"),
        (["--wheel", "/nonexistent.whl"], "--wheel"),
        (["--wheel", __file__], "--wheel"),  # a file, not a zip
    ],
)
def test_bad_flags_fail_naming_the_flag(tmp_path, capsys, args, flag):
    argv = ["--wheel", str(_wheel(tmp_path)), "--out", str(tmp_path / "o.jsonl.gz"), *args]
    with pytest.raises(SystemExit) as e:
        evals_prompts.main(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_main_writes_the_prompt_file(tmp_path):
    out = tmp_path / "p.jsonl.gz"
    assert evals_prompts.main(["--wheel", str(_wheel(tmp_path)), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in gzip.open(out, "rt")]
    assert len(rows) == 9 + 2


COMMITTED = ROOT / "bench" / "drafter" / "prompts_openai_evals.jsonl.gz"


@pytest.mark.skipif(not COMMITTED.exists(), reason="written by make evals-prompts")
def test_committed_prompt_file_is_clean():
    rows = [json.loads(line) for line in gzip.open(COMMITTED, "rt")]
    texts = [r["text"] for r in rows]
    assert len(rows) > 5000 and len(set(texts)) == len(texts)
    assert {r["source"] for r in rows} == {"openai_evals"}
    assert all(40 <= len(t) <= 2000 for t in texts)
