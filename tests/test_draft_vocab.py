"""The restricted draft vocabulary: frequency ranking and proposals mapped to full ids."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_sglang.draft_vocab import (
    draft_argmax,
    most_frequent,
    pad_extras,
    prompt_extra,
    select,
    select_extended,
)


def test_most_frequent_ranks_by_count_then_id():
    ids = most_frequent([[5, 5, 5, 2, 2, 9], [9, 7, 2]], 2)
    assert ids.tolist() == [2, 5]  # 2 and 5 three times each, 9 twice
    assert most_frequent([[1]], 10).tolist() == [1]


def test_proposals_come_from_the_vocabulary_in_full_ids():
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    hidden = torch.randn(3, 4, 8)
    full = draft_argmax(hidden, weight, None)
    assert torch.equal(full, (hidden @ weight.T).argmax(-1))
    vocab = torch.tensor([3, 17, 42])
    restricted = draft_argmax(hidden, weight, vocab)
    assert set(restricted.flatten().tolist()) <= {3, 17, 42}
    expected = vocab[(hidden @ weight[vocab].T).argmax(-1)]
    assert torch.equal(restricted, expected)
    assert torch.equal(select(hidden, weight[vocab], vocab), expected)
    # The full vocabulary's winner is kept whenever it is in the draft vocabulary.
    everything = torch.arange(50)
    assert torch.equal(draft_argmax(hidden, weight, everything), full)


def test_prompt_extra_keeps_the_latest_prompt_tokens_outside_the_vocabulary():
    vocab = torch.tensor([1, 2, 3])
    prompt = [9, 1, 7, 9, 2, 8, 7, 5]
    # Outside the vocabulary, latest occurrence first: 5, 7, 8, 9.
    assert prompt_extra(prompt, vocab, 10).tolist() == [5, 7, 8, 9]
    assert prompt_extra(prompt, vocab, 2).tolist() == [5, 7]
    assert prompt_extra(prompt, vocab, 0).tolist() == []
    assert prompt_extra([], vocab, 4).tolist() == []
    assert prompt_extra([1, 2, 2, 3], vocab, 4).tolist() == []


def test_extended_proposals_are_the_argmax_over_each_requests_union():
    torch.manual_seed(0)
    weight = torch.randn(60, 8)
    hidden = torch.randn(3, 5, 8)
    vocab = torch.tensor([0, 4, 9, 30])
    extras = [torch.tensor([11, 50, 7]), torch.tensor([]).long(), torch.tensor([42])]
    padded = pad_extras(extras)
    assert padded.tolist() == [[11, 50, 7], [-1, -1, -1], [42, -1, -1]]
    got = select_extended(hidden, weight[vocab], vocab, weight, padded)
    for b, extra in enumerate(extras):
        union = torch.cat([vocab, extra])
        assert torch.equal(got[b], union[(hidden[b] @ weight[union].T).argmax(-1)])
    # Nothing extra: the static proposals; a padded slot is never proposed.
    none = pad_extras([torch.tensor([]).long()] * 3)
    assert torch.equal(
        select_extended(hidden, weight[vocab], vocab, weight, none),
        select(hidden, weight[vocab], vocab),
    )
    assert (got >= 0).all()
    # Extras do win where they score higher: the test would pass vacuously otherwise.
    assert set(got.flatten().tolist()) & {11, 50, 7, 42}


def test_full_vocabulary_copy_drops_only_the_restricted_vocabulary(tmp_path):
    from safetensors.torch import load_file

    from dflash_sglang.draft_vocab import KEY, load_ids, write_full_vocabulary_copy
    from dflash_sglang.drafters import default_draft_dir

    bundled = Path(default_draft_dir())
    assert load_ids(bundled) is not None
    copy = write_full_vocabulary_copy(bundled, tmp_path / "full")
    assert load_ids(copy) is None
    config = json.loads((copy / "config.json").read_text())
    original = json.loads((bundled / "config.json").read_text())
    assert "draft_vocab_size" not in config["dflash_config"]
    original["dflash_config"].pop("draft_vocab_size")
    assert config == original
    before = load_file(str(bundled / "model.safetensors"))
    after = load_file(str(copy / "model.safetensors"))
    assert set(before) - set(after) == {KEY}
    assert all(torch.equal(after[k], before[k]) for k in after)


def test_proposals_from_a_strided_block_view_cost_what_one_gemm_costs():
    """The worker passes `[bs, B, d][:, 1:]`; `@` on that strided view took a batched path
    11x slower than one GEMM on CPU at 4 requests. Ratio against the same GEMM, same run."""
    import time

    torch.manual_seed(0)
    weight = torch.randn(8192, 576, dtype=torch.bfloat16)
    vocab = torch.arange(8192)
    hidden = torch.randn(8, 16, 576, dtype=torch.bfloat16)[:, 1:, :]
    rows = hidden.reshape(-1, 576).contiguous()

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    assert torch.equal(select(hidden, weight, vocab).view(-1), select(rows, weight, vocab))
    gemm = best(lambda: torch.nn.functional.linear(rows, weight).argmax(-1))
    assert best(lambda: select(hidden, weight, vocab)) < 3 * gemm
