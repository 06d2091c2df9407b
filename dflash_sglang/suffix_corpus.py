"""Warm-start corpora for the shared suffix lookup: past requests and their outputs, in a file.

A server starts with an empty shared index, so its first requests find nothing from other
requests' outputs (offline replay, README: a warm index is worth +0.1-0.3 τ over a cold one).
A corpus fills the index at start-up as if the server had already answered those requests.

Format: JSONL, gzip-compressed if the name ends in `.gz`, one request per line, oldest first:
- token ids of the served target's tokenizer, `{"prompt_ids": [...], "response_ids": [...]}`
  (what `python -m dflash_sglang.training generate` writes), or
- text, `{"prompt": "...", "response": "..."}`, tokenized at start-up by the target's
  tokenizer; the prompt as the model saw it (chat template applied), since its last tokens
  are what a new reply's opening is looked up from.
Other keys are ignored.
"""

from __future__ import annotations

import functools
import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Target-specific corpora shipped with the package (see `bundled`).
CORPORA_DIR = Path(__file__).resolve().parent / "corpora"
# The embedded default target's: its own bf16 greedy replies to 1,600 ShareGPT first turns
# (the drafter's training data, decontaminated against every held-out prompt set).
DEFAULT_CORPUS = "smollm2-135m-instruct.jsonl.gz"


class CorpusError(ValueError):
    """A corpus file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Record:
    prompt: list[int] | str
    response: list[int] | str

    @property
    def is_text(self) -> bool:
        return isinstance(self.prompt, str)


def bundled() -> Path | None:
    """The embedded default target's corpus, if this build ships it."""
    path = CORPORA_DIR / DEFAULT_CORPUS
    return path if path.is_file() else None


def _lines(path: Path) -> Iterator[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            yield from f
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise CorpusError(f"{path}: cannot be read: {e}") from e


def _token_ids(value, where: str, key: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise CorpusError(f"{where}: {key!r} must be a list of non-negative token ids")
    return value


def _record(line: str, where: str) -> Record:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise CorpusError(f"{where}: a record must be a JSON object")
    if "prompt_ids" in data and "response_ids" in data:
        return Record(
            _token_ids(data["prompt_ids"], where, "prompt_ids"),
            _token_ids(data["response_ids"], where, "response_ids"),
        )
    if isinstance(data.get("prompt"), str) and isinstance(data.get("response"), str):
        return Record(data["prompt"], data["response"])
    raise CorpusError(
        f"{where}: a record needs 'prompt_ids' and 'response_ids' (token ids) "
        "or 'prompt' and 'response' (strings)"
    )


def read(path: str | Path) -> list[Record]:
    """Every record, validated; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    records = [
        _record(line, f"{path}:{number}")
        for number, line in enumerate(_lines(path), 1)
        if line.strip()
    ]
    if not records:
        raise CorpusError(f"{path}: no records")
    return records


def documents(
    records: list[Record], tokenize: Callable[[str], list[int]] | None = None
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) per record; text records need `tokenize`."""
    if tokenize is None and any(r.is_text for r in records):
        raise CorpusError("text records need the target's tokenizer")
    return [
        (tokenize(r.prompt), tokenize(r.response)) if r.is_text else (r.prompt, r.response)
        for r in records
    ]


def load(path: str | Path, tokenizer_path: str, trust_remote_code: bool = False):
    """`documents` of the file at `path`, text records tokenized by the target's tokenizer
    (loaded only when there are any)."""
    records = read(path)
    tokenize = None
    if any(r.is_text for r in records):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            tokenizer_path, trust_remote_code=trust_remote_code
        )
        tokenize = functools.partial(tokenizer.encode, add_special_tokens=False)
    return documents(records, tokenize)
