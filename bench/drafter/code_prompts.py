"""Python functions for drafter training, from the CPython standard library or packages.

The held-out HumanEval set asks the target to complete a function from its signature and
docstring; ShareGPT has little of that, and no code set ships in a package
(`../shared/research/models_data.md`). The standard library has thousands of documented
public functions: each becomes a prompt in the HumanEval format
(`datasets.HUMANEVAL_INSTRUCTION`), its signature and docstring with the body removed.
`generate --prompts-file` drops any that overlap a held-out set and regenerates the
target's replies. Shuffled with a fixed seed, so a generation stopped early still spans
the library rather than its first modules.

    python bench/drafter/code_prompts.py --out bench/drafter/prompts_stdlib_code.jsonl.gz
    python bench/drafter/code_prompts.py --packages sympy,scipy,networkx --max-chars 1500 \
        --out bench/drafter/prompts_package_code.jsonl.gz
    python bench/drafter/code_prompts.py --packages matplotlib,rich --max-chars 1500 \
        --source library_code --exclude bench/drafter/prompts_stdlib_code.jsonl.gz \
        --out bench/drafter/prompts_library_code.jsonl.gz

A second package list is written under its own source name, so each regenerated sample
names the one prompt file it came from (`tests/test_training_data.py` checks that).
Packages (installed ones, by import name; their lock-pinned versions give the same bytes)
document with numpy-style sections that can run to pages: `--max-chars` keeps the stubs a
prompt can hold whole, since `generate` cuts an over-long prompt from its end.
"""

from __future__ import annotations

import argparse
import ast
import copy
import gzip
import importlib.util
import json
import random
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from dflash_sglang.datasets import HUMANEVAL_INSTRUCTION, write_prompt_file

# Tests, demos, vendored installers and Python 2 fixtures are not the code HumanEval asks for.
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages"}
MIN_DOC_CHARS = 40  # a one-line "Return x." says too little to write the function from
MIN_BODY = 2  # statements besides the docstring: a real function, not a stub or alias


def stub(fn: ast.FunctionDef) -> str | None:
    """`def` line and docstring of a documented public function, or None if it is not one;
    the docstring indented as the body would be, whatever its source indentation was."""
    doc = ast.get_docstring(fn)  # cleaned: common indentation removed
    if fn.name.startswith("_") or not doc or len(doc) < MIN_DOC_CHARS:
        return None
    if len(fn.body) - 1 < MIN_BODY:
        return None
    lines = doc.splitlines()
    if len(lines) > 1:
        doc = "\n".join([lines[0]] + [f"    {ln}" if ln else "" for ln in lines[1:]] + ["    "])
    head = copy.copy(fn)
    head.body, head.decorator_list = [ast.Expr(ast.Constant(doc))], []
    return ast.unparse(head) + "\n"


def method_stub(cls: ast.ClassDef, fn: ast.FunctionDef) -> str | None:
    """A documented public method, inside its class line so `self` has a meaning."""
    text = stub(fn)
    if cls.name.startswith("_") or text is None:
        return None
    return f"class {cls.name}:\n" + "".join(
        f"    {ln}" if ln.strip() else ln for ln in text.splitlines(True)
    )


def stubs(root: Path) -> Iterator[str]:
    """The stub of every documented top-level function and method under `root`."""
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS & set(path.relative_to(root).parts[:-1]):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a fixture in another Python's syntax or encoding
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and (text := stub(node)):
                yield text
            elif isinstance(node, ast.ClassDef):
                for fn in node.body:
                    if isinstance(fn, ast.FunctionDef) and (text := method_stub(node, fn)):
                        yield text


def prompts(
    roots: list[Path], seed: int, source: str = "stdlib_code", max_chars: int | None = None
) -> list[dict]:
    seen: set[str] = set()
    rows = []
    for text in (t for root in roots for t in stubs(root)):
        if text not in seen and (max_chars is None or len(text) <= max_chars):
            seen.add(text)
            rows.append({"text": HUMANEVAL_INSTRUCTION.format(prompt=text), "source": source})
    random.Random(seed).shuffle(rows)
    return rows


def package_root(name: str) -> Path | None:
    """An installed package's directory, or None (not installed, or a single module)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a dotted name whose parent is missing, or ""
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="library root")
    p.add_argument("--packages", help="comma list of installed packages instead of the stdlib")
    p.add_argument("--max-chars", type=int, help="longest stub kept (default: all)")
    p.add_argument("--source", help="source name of the rows (default: stdlib_code / package_code)")
    p.add_argument("--exclude", help="comma list of prompt files whose functions are left out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSONL.gz to write")
    a = p.parse_args(argv)
    if a.max_chars is not None and a.max_chars < 1:
        p.error(f"--max-chars must be >= 1, got {a.max_chars}")
    if a.packages:
        names = a.packages.split(",")
        if missing := [n for n in names if package_root(n) is None]:
            p.error(f"--packages {','.join(missing)}: not an installed package")
        roots = [package_root(n) for n in names]
        source, root = "package_code", a.packages
    else:
        roots, source, root = [Path(a.stdlib)], "stdlib_code", a.stdlib
        if not roots[0].is_dir():
            p.error(f"--stdlib {root} is not a directory")
    excluded = set()
    for name in a.exclude.split(",") if a.exclude else []:
        if not Path(name).is_file():
            p.error(f"--exclude {name}: no such file")
        with gzip.open(name, "rt", encoding="utf-8") as f:
            excluded |= {json.loads(line)["text"] for line in f}
    rows = [
        r
        for r in prompts(roots, a.seed, a.source or source, a.max_chars)
        if r["text"] not in excluded
    ]
    write_prompt_file(a.out, rows)
    print(
        f"{len(rows)} functions from {root} (Python {sys.version.split()[0]}) -> {a.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
