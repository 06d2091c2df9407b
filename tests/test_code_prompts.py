"""`bench/drafter/code_prompts.py`: documented public functions and methods of a library
become HumanEval-format prompts; the rest is skipped, and the committed file is clean."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from dflash_sglang.datasets import HUMANEVAL_INSTRUCTION
from dflash_sglang.training import data

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "code_prompts", ROOT / "bench" / "drafter" / "code_prompts.py"
)
code_prompts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(code_prompts)

LIBRARY = '''
def public(a, b=2) -> int:
    """Add two numbers and return their sum, checking both first.

        Indented deeper in the source than the body.
    """
    assert a
    return a + b


def _private(a):
    """A private helper that is long enough to be documented here."""
    x = a
    return x


def terse(a):
    """Return a."""
    x = a
    return x


def alias(a):
    """A function whose body is a single statement besides this docstring."""
    return a


class Box:
    @classmethod
    def fill(cls, items):
        """Fill the box with the given items and return how many fit."""
        cls.items = list(items)
        return len(cls.items)
'''


def test_documented_functions_and_methods_become_humaneval_prompts(tmp_path):
    (tmp_path / "lib.py").write_text(LIBRARY)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_lib.py").write_text(LIBRARY)  # tests are skipped
    (tmp_path / "py2.py").write_text("print 'python 2'\n")  # unparseable: skipped
    rows = code_prompts.prompts(tmp_path, seed=0)
    texts = sorted(r["text"] for r in rows)
    assert {r["source"] for r in rows} == {"stdlib_code"}
    function = (
        "def public(a, b=2) -> int:\n"
        '    """Add two numbers and return their sum, checking both first.\n\n'
        "    Indented deeper in the source than the body.\n"  # re-indented to the body
        '    """\n'
    )
    method = (
        "class Box:\n"
        "    def fill(cls, items):\n"
        '        """Fill the box with the given items and return how many fit."""\n'
    )
    assert texts == sorted(HUMANEVAL_INSTRUCTION.format(prompt=p) for p in (function, method))
    assert code_prompts.prompts(tmp_path, seed=0) == rows  # same library, same order


def test_committed_code_prompts_are_clean_and_distinct():
    path = ROOT / "bench" / "drafter" / "prompts_stdlib_code.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == len({r["text"] for r in rows}) > 2000
    kept = data.file_prompts(path, limit=10**6)
    assert len(kept) > 0.99 * len(rows)  # decontamination drops next to nothing


def test_a_missing_library_fails_naming_the_flag(tmp_path, capsys):
    out = tmp_path / "prompts.jsonl.gz"
    with pytest.raises(SystemExit) as exit_:
        code_prompts.main(["--stdlib", str(tmp_path / "nowhere"), "--out", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--stdlib" in err and "is not a directory" in err
    assert not out.exists()  # nothing written
