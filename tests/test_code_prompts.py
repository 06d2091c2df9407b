"""`bench/drafter/code_prompts.py`: documented public functions and methods of a library
become HumanEval-format prompts; the rest is skipped, and the committed file is clean."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import jinja2
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
    rows = code_prompts.prompts([tmp_path], seed=0)
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
    assert code_prompts.prompts([tmp_path], seed=0) == rows  # same library, same order


def test_packages_are_read_by_import_name_and_long_stubs_left_out(tmp_path):
    (tmp_path / "lib.py").write_text(LIBRARY)
    rows = code_prompts.prompts([tmp_path, tmp_path], seed=0, source="package_code")
    assert len(rows) == 2 and {r["source"] for r in rows} == {"package_code"}  # deduplicated
    short = code_prompts.prompts([tmp_path], seed=0, max_chars=120)
    assert [r["text"] for r in short] == [r["text"] for r in rows if "class Box" in r["text"]]
    assert code_prompts.package_root("jinja2") == Path(jinja2.__file__).parent
    assert code_prompts.package_root("json.nowhere") is None
    assert code_prompts.package_root("no_such_package_here") is None


@pytest.mark.parametrize(
    ("name", "least"), [("stdlib", 2000), ("package", 5000), ("library", 4000)]
)
def test_committed_code_prompts_are_clean_and_distinct(name, least):
    path = ROOT / "bench" / "drafter" / f"prompts_{name}_code.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == len({r["text"] for r in rows}) > least
    assert {r["source"] for r in rows} == {f"{name}_code"}
    kept = data.file_prompts(path, limit=10**6)
    assert len(kept) > 0.99 * len(rows)  # decontamination drops next to nothing


def test_a_missing_library_fails_naming_the_flag(tmp_path, capsys):
    out = tmp_path / "prompts.jsonl.gz"
    with pytest.raises(SystemExit) as exit_:
        code_prompts.main(["--stdlib", str(tmp_path / "nowhere"), "--out", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--stdlib" in err and "is not a directory" in err
    with pytest.raises(SystemExit):
        code_prompts.main(["--packages", "jinja2,no_such_package_here", "--out", str(out)])
    assert "--packages no_such_package_here: not an installed package" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        code_prompts.main(["--stdlib", str(tmp_path), "--exclude", "nowhere.gz", "--out", str(out)])
    assert "--exclude nowhere.gz: no such file" in capsys.readouterr().err
    assert not out.exists()  # nothing written


def test_exclude_leaves_out_functions_another_prompt_file_has(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "lib.py").write_text(LIBRARY)
    first, second = tmp_path / "first.jsonl.gz", tmp_path / "second.jsonl.gz"
    code_prompts.main(["--stdlib", str(tmp_path / "lib"), "--out", str(first)])
    (tmp_path / "lib" / "more.py").write_text(LIBRARY.replace("Box", "Crate"))
    argv = ["--stdlib", str(tmp_path / "lib"), "--source", "more_code", "--out", str(second)]
    code_prompts.main([*argv, "--exclude", str(first)])
    with gzip.open(second, "rt") as f:
        rows = [json.loads(line) for line in f]
    assert [r["source"] for r in rows] == ["more_code"]
    assert "class Crate:" in rows[0]["text"]  # the one function the first file lacks
