"""Teacher-forced acceptance: on the target's own greedy output, a block anchored where a
decode step started accepts exactly what that step accepted in the reference loop, and the
walk over cached features retraces the decode's steps."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_sglang.draft_vocab import prompt_extra
from dflash_sglang.drafter import DFlashDrafter
from dflash_sglang.reference import ReferenceDecoder
from dflash_sglang.training import evaluate, features
from dflash_sglang.training.train import Head

PROMPTS = [[5, 9, 13, 2], [40, 41, 42, 43, 44, 45], [7, 100, 7, 100, 7]]


def test_acceptance_at_the_decode_steps_equals_the_reference_loop(half_models):
    target = AutoModelForCausalLM.from_pretrained(half_models["target"], dtype=torch.float32)
    drafter = DFlashDrafter.load(half_models["draft"]).eval()
    decoder = ReferenceDecoder(target.eval(), drafter)
    head = Head(target.lm_head.weight.detach(), drafter.draft_vocab_ids)
    layers = list(drafter.config.target_layer_ids)
    all_lengths = []
    for prompt in PROMPTS:
        gen = decoder.generate(prompt, 48)
        sample = {"prompt_ids": prompt, "response_ids": gen.tokens}
        example = features.extract(target, sample, layers, max_len=4096)
        # Step i's block starts at the token the previous steps ended on.
        steps = gen.acceptance_lengths
        starts = torch.tensor([len(prompt) + sum(steps[:i]) for i in range(len(steps))])
        embed = target.get_input_embeddings()
        lengths = evaluate.acceptance_at(drafter, embed, head, example, starts)
        # The last step may be cut by max_new_tokens; every other one must match, and the
        # walk over all positions finds the same steps without being told where they are.
        assert lengths[:-1] == steps[:-1]
        assert evaluate.decode_walk(drafter, embed, head, example, chunk=5)[:-1] == steps[:-1]
        all_lengths += steps
    assert 1 < sum(all_lengths) / len(all_lengths) < drafter.config.block_size  # partial


def test_a_restricted_vocabulary_with_prompt_tokens_walks_as_the_reference_loop(half_models):
    """`--dflash-prompt-vocab`: the reference loop, the walk and (through the same rule,
    `draft_vocab.prompt_extra`) the server propose from the draft vocabulary plus each
    prompt's own tokens; the walk still retraces the decode's steps."""
    target = AutoModelForCausalLM.from_pretrained(half_models["target"], dtype=torch.float32)
    drafter = DFlashDrafter.load(half_models["draft"]).eval()
    # Without token 0, the target's only output here, no draft is ever accepted; the
    # prompts hold it, so their tokens bring it back.
    drafter.draft_vocab_ids = torch.arange(1, target.config.vocab_size)
    prompts = [[5, 9, 13, 2, 0], [5, 9, 0, 13, 2]]
    embed, weight = target.get_input_embeddings(), target.lm_head.weight.detach()
    layers = list(drafter.config.target_layer_ids)
    taus = {}
    for cap in (0, 256):
        decoder = ReferenceDecoder(target.eval(), drafter, prompt_vocab=cap)
        examples = []
        for prompt in prompts:
            gen = decoder.generate(prompt, 48)
            sample = {"prompt_ids": prompt, "response_ids": gen.tokens}
            examples.append(features.extract(target, sample, layers, max_len=4096))
            extra = prompt_extra(prompt, drafter.draft_vocab_ids, cap)
            head = Head(weight, torch.cat([drafter.draft_vocab_ids, extra]))
            walk = evaluate.decode_walk(drafter, embed, head, examples[-1], chunk=5)
            assert walk[:-1] == gen.acceptance_lengths[:-1]
        taus[cap] = evaluate.teacher_forced(drafter, embed, weight, examples, cap)["tau"]
    assert taus[0] == 1.0 and taus[256] > 1.0


def test_the_walk_at_another_block_size_retraces_the_reference_loop_at_it(half_models):
    """A drafter served with a block other than its own (`--speculative-dflash-block-size`):
    the walk over cached features at that size retraces the reference loop's steps at it."""
    target = AutoModelForCausalLM.from_pretrained(half_models["target"], dtype=torch.float32)
    drafter = DFlashDrafter.load(half_models["draft"]).eval()
    trained = drafter.config.block_size
    small = evaluate.at_block_size(drafter, 2)
    assert small.config.block_size == 2 and drafter.config.block_size == trained
    with pytest.raises(ValueError, match="block size must be at least 2"):
        evaluate.at_block_size(drafter, 1)  # `evaluate --block-size 1`: named, nothing run
    decoder = ReferenceDecoder(target.eval(), drafter)
    head = Head(target.lm_head.weight.detach(), drafter.draft_vocab_ids)
    embed = target.get_input_embeddings()
    layers = list(drafter.config.target_layer_ids)
    examples = []
    for prompt in PROMPTS:
        gen = decoder.generate(prompt, 48, block_size=2)
        sample = {"prompt_ids": prompt, "response_ids": gen.tokens}
        examples.append(features.extract(target, sample, layers, max_len=4096))
        walk = evaluate.decode_walk(small, embed, head, examples[-1], chunk=5)
        assert walk[:-1] == gen.acceptance_lengths[:-1]
        assert max(gen.acceptance_lengths) <= 2
    weight = target.lm_head.weight.detach()
    result = evaluate.teacher_forced(drafter, embed, weight, examples, 0, block_size=2)
    assert len(result["histogram"]) == 2 and 1.0 < result["tau"] <= 2.0
