"""Warm-start corpora for the shared suffix lookup: reading, validating, tokenizing."""

from __future__ import annotations

import gzip
import json

import pytest

from dflash_sglang import suffix_corpus
from dflash_sglang.suffix_corpus import CorpusError, Record


def write(path, lines: list[str]):
    data = "\n".join(lines) + "\n"
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(data)
    else:
        path.write_text(data)
    return path


@pytest.mark.parametrize("name", ["corpus.jsonl", "corpus.jsonl.gz"])
def test_token_id_and_text_records(tmp_path, name):
    ids = {"id": "a", "prompt_ids": [1, 2], "response_ids": [3, 4, 5], "finish": "length"}
    text = {"prompt": "hi there", "response": "hello"}
    path = write(tmp_path / name, [json.dumps(ids), "", json.dumps(text)])
    records = suffix_corpus.read(path)
    assert records == [Record([1, 2], [3, 4, 5]), Record("hi there", "hello")]
    assert suffix_corpus.documents(records, lambda s: [len(w) for w in s.split()]) == [
        ([1, 2], [3, 4, 5]),
        ([2, 5], [5]),
    ]
    with pytest.raises(CorpusError, match="text records need the target's tokenizer"):
        suffix_corpus.documents(records)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"corpus.jsonl:2: not JSON"),
        ("[1, 2]", r"corpus.jsonl:2: a record must be a JSON object"),
        ('{"prompt_ids": [1], "response_ids": [-3]}', r"'response_ids' must be a list of non"),
        ('{"prompt_ids": "1 2", "response_ids": [3]}', r"'prompt_ids' must be a list of non"),
        ('{"prompt_ids": [true], "response_ids": [3]}', r"'prompt_ids' must be a list of non"),
        ('{"prompt": "x"}', r"corpus.jsonl:2: a record needs 'prompt_ids' and 'response_ids'"),
        ('{"prompt": 1, "response": "y"}', r"a record needs"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, line, message):
    path = write(tmp_path / "corpus.jsonl", ['{"prompt_ids": [1], "response_ids": [2]}', line])
    with pytest.raises(CorpusError, match=message):
        suffix_corpus.read(path)


def test_missing_empty_and_corrupt_files(tmp_path):
    with pytest.raises(CorpusError, match="no such file"):
        suffix_corpus.read(tmp_path / "absent.jsonl")
    with pytest.raises(CorpusError, match="no records"):
        suffix_corpus.read(write(tmp_path / "empty.jsonl", [""]))
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(CorpusError, match="cannot be read"):
        suffix_corpus.read(bad)


def test_the_bundled_corpus_is_the_default_targets_own_replies():
    path = suffix_corpus.bundled()
    assert path is not None, "the embedded target's corpus is not in this build"
    records = suffix_corpus.read(path)
    assert len(records) == 1600 and not any(r.is_text for r in records)
    docs = suffix_corpus.documents(records)
    assert all(max(p + r) < 49152 for p, r in docs)  # SmolLM2's vocabulary
    # Each prompt ends at the chat template's assistant header, where a reply starts.
    assert {tuple(p[-3:]) for p, _ in docs} == {(520, 9531, 198)}  # "assistant\n"


def test_the_bundled_corpus_shares_no_13_word_run_with_any_held_out_prompt(converted):
    """The benchmarks' prompt sets measure a warm server on traffic it has not seen."""
    from transformers import AutoTokenizer

    from dflash_sglang import datasets
    from dflash_sglang.training.data import _ngrams

    tokenizer = AutoTokenizer.from_pretrained(converted[0])
    docs = suffix_corpus.documents(suffix_corpus.read(suffix_corpus.bundled()))
    grams = set().union(*(_ngrams(tokenizer.decode(p + r)) for p, r in docs))
    for load in (datasets.mt_bench, datasets.humaneval, datasets.math_problems, datasets.summaries):
        assert not [t for t in load() if _ngrams(t) & grams], load.__name__
