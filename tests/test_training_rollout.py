"""Rollout labels (`--labels rollout`): the target rolled out from every anchor at once over the
sequence's cached prefix equals the target decoding greedily from each anchor alone, and the
block loss takes its labels from that path and only where the drafter could follow it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_sglang.training.features import Example, extract
from dflash_sglang.training.rollout import Roller, Rollout, rollout_mask
from dflash_sglang.training.train import Head, block_loss, new_drafter
from tests.test_training_loss import CONFIG, H, V


def test_rollout_mask_sees_the_prefix_to_its_anchor_and_its_own_tokens():
    mask = rollout_mask(torch.tensor([1, 3]), seq_len=5, step=2)
    assert mask.int().tolist() == [
        [1, 1, 0, 0, 0, 1, 0, 1, 0],
        [1, 1, 1, 1, 0, 0, 1, 0, 1],
    ]


@pytest.fixture(scope="module")
def target(models):
    return AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()


def _greedy_alone(target, prefix: torch.Tensor, depth: int) -> tuple[list[int], torch.Tensor]:
    """The target decoding from `prefix` on its own, no cache: tokens and final states."""
    ids, states = prefix.tolist(), []
    for _ in range(depth):
        with torch.no_grad():
            h = target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        states.append(h)
        ids.append(int(target.lm_head(h).argmax()))
    return ids[len(prefix) :], torch.stack(states)


def test_rollout_equals_greedy_decoding_from_each_anchor(target):
    sample = {"prompt_ids": list(range(5, 15)), "response_ids": list(range(40, 70, 2))}
    example = extract(target, sample, [0, 2], max_len=512, keep_cache=True)
    anchors = torch.tensor([3, 10, 11, 24])
    roller = Roller(target, depth=6, stop_ids={2})
    path = roller(example, anchors)
    assert path.tokens.shape == (4, 6) and path.hidden.shape == (4, 6, target.config.hidden_size)
    for n, a in enumerate(anchors.tolist()):
        tokens, states = _greedy_alone(target, example.input_ids[: a + 1], 6)
        assert path.tokens[n].tolist() == tokens
        torch.testing.assert_close(path.hidden[n], states, rtol=1e-4, atol=1e-4)
    assert path.stop.tolist() == (path.tokens == 2).tolist()
    # The prefix K/V is left as found: a second rollout gives the same path.
    assert example.target_cache.get_seq_length() == len(example.input_ids)
    assert torch.equal(roller(example, anchors).tokens, path.tokens)


def test_rollout_needs_the_prefix_cache(target):
    sample = {"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10]}
    example = extract(target, sample, [0], max_len=512)
    with pytest.raises(ValueError, match="keep_cache"):
        Roller(target, depth=2, stop_ids=set())(example, torch.tensor([3]))


# --- the loss over a rollout (the tiny shapes of test_training_loss: block 4, anchors 4, 9) ---

S = 12
ANCHORS = torch.tensor([4, 9])
WEIGHT = torch.linalg.qr(torch.randn(V, V, generator=torch.Generator().manual_seed(0)))[0]
WEIGHT = WEIGHT[:, :H].contiguous() * 4  # distinct lm_head rows: a state "says" one token


def _block_loss(example: Example, head: Head, distill: float = 0.5, **kw):
    torch.manual_seed(0)
    drafter, embed = new_drafter(CONFIG, seed=0), torch.nn.Embedding(V, H)
    return block_loss(drafter, embed, head, example, ANCHORS, 7.0, distill, **kw)


def _loss(example: Example, head: Head, **kw) -> float:
    return _block_loss(example, head, **kw)[0].item()


def _says(tokens: torch.Tensor) -> torch.Tensor:
    """Final states whose argmax (and distribution) is `tokens`."""
    return WEIGHT[tokens] * 10


def _rollout(tokens: list[list[int]], stop: int | None = None) -> Rollout:
    t = torch.tensor(tokens)
    return Rollout(tokens=t, hidden=_says(t), stop=t == stop if stop is not None else t < 0)


def _example() -> Example:
    ids = torch.randint(0, V - 1, (S,), generator=torch.Generator().manual_seed(2))
    features = torch.randn(S, 2 * H, generator=torch.Generator().manual_seed(1))
    return Example(ids, 3, features, _says(torch.roll(ids, -1)))  # the target agrees with the data


def test_a_rollout_that_follows_the_data_is_the_target_labels():
    """When the target's own path is the data, rollout labels are --labels target's."""
    example, head = _example(), Head(WEIGHT, None)
    ids = example.input_ids
    path = _rollout([ids[5:8].tolist(), ids[10:12].tolist() + [7]])
    # Anchor 9's third slot (position 12) lies past the sequence: no loss there either way.
    assert _loss(example, head, rollout=path) == pytest.approx(
        _loss(example, head, target_labels=True), rel=1e-6
    )
    # Where the path leaves the data, the loss follows the path, not the data.
    other = _rollout([[1, 2, 3], ids[10:12].tolist() + [7]])
    assert _loss(example, head, rollout=other) != pytest.approx(_loss(example, head, rollout=path))


def test_slots_after_a_stop_or_an_out_of_vocabulary_token_carry_no_loss():
    example = _example()
    head = Head(WEIGHT, torch.arange(V - 8))  # tokens V-8.. lie outside the draft vocabulary
    base = _loss(example, head, rollout=_rollout([[1, 5, 6], [3, 4, 5]], stop=5))
    # Anchor 4's path stopped at its second slot: what follows is free.
    assert base == _loss(example, head, rollout=_rollout([[1, 5, 9], [3, 4, 5]], stop=5))
    # Before the stop it matters.
    assert base != _loss(example, head, rollout=_rollout([[2, 5, 6], [3, 4, 5]], stop=5))
    outside = V - 3
    base = _loss(example, head, rollout=_rollout([[outside, 1, 2], [3, 4, 5]]))
    assert base == _loss(example, head, rollout=_rollout([[outside, 7, 8], [3, 4, 5]]))


def test_a_shallow_rollout_leaves_later_slots_without_loss():
    example, head = _example(), Head(WEIGHT, None)
    _, stats = _block_loss(example, head, distill=0.0, rollout=_rollout([[1], [3]]))
    assert stats["later_kept"] == 0 and stats["later_total"] > 0
    with pytest.raises(ValueError, match="depth"):
        _rollout([[1, 2, 3, 4], [1, 2, 3, 4]]).slots(CONFIG.block_size)
