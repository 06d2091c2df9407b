"""The reference decode loop: lossless against plain greedy, and τ agrees with the server."""

from __future__ import annotations

import pytest
import torch

from dflash_sglang.drafter import DFlashDrafter
from dflash_sglang.reference import ReferenceDecoder
from tests.prompts import SHORT


def _load(pair: dict):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(pair["target"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(pair["target"])
    return ReferenceDecoder(target, DFlashDrafter.load(pair["draft"])), tok


def _plain_greedy(target, ids: list[int], n: int) -> list[int]:
    out = target.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("pair", ["models", "half_models"])
def test_greedy_equals_plain_decoding(pair, request):
    decoder, tok = _load(request.getfixturevalue(pair))
    for prompt in SHORT[:4]:
        ids = tok(prompt)["input_ids"]
        gen = decoder.generate(ids, 40)
        assert gen.tokens == _plain_greedy(decoder.target, ids, 40)
        assert all(1 <= a <= decoder.config.block_size for a in gen.acceptance_lengths)


def test_full_acceptance_on_the_echo_pair(echo_models):
    decoder, tok = _load(echo_models)
    gen = decoder.generate(tok(SHORT[0])["input_ids"], 1 + 5 * 4)
    assert gen.acceptance_lengths == [4] * 5 and gen.tau == 4


def test_stop_token_ends_generation(models):
    decoder, tok = _load(models)
    ids = tok(SHORT[1])["input_ids"]
    plain = _plain_greedy(decoder.target, ids, 30)
    stop = plain[7]
    gen = decoder.generate(ids, 30, stop_ids=(stop,))
    assert gen.tokens == plain[: plain.index(stop) + 1]


@pytest.mark.server
def test_server_reports_the_same_acceptance(live_dflash, half_models):
    decoder, tok = _load(half_models)
    for prompt in SHORT[:6]:
        meta = live_dflash.generate(prompt, max_new_tokens=40, ignore_eos=True)["meta_info"]
        ref = decoder.generate(tok(prompt)["input_ids"], 40)
        assert meta["spec_verify_ct"] == len(ref.acceptance_lengths), prompt
        assert meta["completion_tokens"] == len(ref.tokens)


def test_evaluate_checks_outputs_against_plain_greedy(half_models):
    from dflash_sglang.training import evaluate

    report = evaluate.run(
        half_models["target"],
        half_models["draft"],
        ["mt_bench", "humaneval"],
        limit=2,
        max_new_tokens=24,
        block_size=None,
        dtype="float32",
        server_url=None,
        check_greedy=True,
    )
    for name in ("mt_bench", "humaneval"):
        assert report[name]["reference"]["same_as_plain_greedy"] == 2
        assert report[name]["reference"]["tau"] > 1
