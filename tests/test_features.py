"""Cached target features: the `hidden_states[l + 1]` tap, and shards that follow the data."""

from __future__ import annotations

import torch

from dflash_sglang.training import features


def _samples(n: int) -> list[dict]:
    return [
        {"prompt_ids": [5 + i, 6, 7], "response_ids": list(range(20 + i, 30 + i))} for i in range(n)
    ]


def test_features_are_the_outputs_of_the_tapped_layers(models, tmp_path):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    features.compute(target, _samples(2), [0, 2], tmp_path, max_len=64, dtype=torch.float32)
    example = features.load(tmp_path)[1]
    ids = torch.tensor([6, 6, 7, *range(21, 31)])
    assert torch.equal(example.input_ids, ids) and example.prompt_len == 3
    with torch.no_grad():
        out = target(input_ids=ids[None], output_hidden_states=True)
    # Layer l's OUTPUT is HF's hidden_states[l + 1] (index 0 is the embedding).
    expected = torch.cat([out.hidden_states[1], out.hidden_states[3]], dim=-1)[0]
    assert torch.allclose(example.features, expected, atol=1e-5)
    logits = example.final_hidden @ target.lm_head.weight.T
    assert torch.allclose(logits, out.logits[0], atol=1e-4)


def test_a_short_last_shard_is_redone_when_data_grows(models, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(features, "SHARD", 4)
    target = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    assert features.compute(target, _samples(6), [1], tmp_path, max_len=64) == 2
    assert features.compute(target, _samples(6), [1], tmp_path, max_len=64) == 0  # resumed
    assert features.compute(target, _samples(7), [1], tmp_path, max_len=64) == 1
    assert [int(e.input_ids[0]) for e in features.load(tmp_path)] == [5, 6, 7, 8, 9, 10, 11]


def test_online_examples_equal_the_cache(models, tmp_path):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    samples = _samples(3)
    features.compute(target, samples, [0, 2], tmp_path, max_len=8, dtype=torch.float32)
    cached = features.load(tmp_path)
    online = features.OnlineExamples(target, samples, [0, 2], max_len=8)
    assert len(online) == 3
    for a, b in zip(cached, online, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and len(a.input_ids) == 8
        assert torch.allclose(a.features, b.features) and a.prompt_len == b.prompt_len
    assert features.batch_indices(5, 2, torch.Generator().manual_seed(0))[-1].__len__() == 1
