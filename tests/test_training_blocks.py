"""Training blocks: the strict context mask, same-position labels and loss weights."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_sglang.training.blocks import (
    IGNORE,
    attention_mask,
    build_blocks,
    consistent_slots,
    default_gamma,
    loss_weights,
    sample_anchors,
)

MASK = 99


def test_context_is_strictly_before_the_anchor():
    mask = attention_mask(torch.tensor([3, 6]), seq_len=10, block_size=4)
    assert mask.shape == (8, 10 + 8)
    for q in range(4):  # block 0, anchor 3: context 0, 1, 2 only
        assert mask[q, :10].tolist() == [True] * 3 + [False] * 7
    for q in range(4, 8):  # block 1, anchor 6: its own anchor's feature is not visible
        assert mask[q, :10].tolist() == [True] * 6 + [False] * 4


def test_bidirectional_inside_a_block_and_nothing_across():
    mask = attention_mask(torch.tensor([2, 5, 7]), seq_len=9, block_size=3)
    blocks = mask[:, 9:]
    for q in range(9):
        for k in range(9):
            assert blocks[q, k] == (q // 3 == k // 3)


def test_labels_are_the_tokens_at_the_block_positions():
    ids = torch.arange(100, 112)
    loss_mask = torch.tensor([0] * 4 + [1] * 8)
    blocks = build_blocks(
        ids, loss_mask, torch.tensor([4, 9]), block_size=4, mask_token_id=MASK, gamma=7.0
    )
    assert blocks.input_ids.tolist() == [104, MASK, MASK, MASK, 109, MASK, MASK, MASK]
    # Slot k of the block anchored at a predicts ids[a + k] (not a + k + 1); slot 0 and
    # positions past the end carry no loss.
    assert blocks.labels.tolist() == [IGNORE, 105, 106, 107, IGNORE, 110, 111, IGNORE]
    assert blocks.position_ids.tolist() == [*range(12), 4, 5, 6, 7, 9, 10, 11, 12]
    w = [math.exp(-k / 7.0) for k in range(3)]
    assert blocks.weights.tolist() == pytest.approx([0, *w, 0, w[0], w[1], 0])


def test_no_loss_on_prompt_tokens():
    ids = torch.arange(10)
    loss_mask = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 1, 1])
    blocks = build_blocks(
        ids, loss_mask, torch.tensor([1]), block_size=4, mask_token_id=MASK, gamma=4.0
    )
    assert blocks.labels.tolist() == [IGNORE, IGNORE, IGNORE, IGNORE]
    assert blocks.weights.sum() == 0


def test_loss_weights_decay_from_slot_one():
    w = loss_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert w[15] == pytest.approx(math.exp(-14 / 7))
    assert all(a > b for a, b in zip(w[1:], w[2:], strict=False))
    assert default_gamma(16) == 7 and default_gamma(8) == 4


def test_anchors_are_distinct_sorted_response_positions():
    loss_mask = torch.tensor([0] * 5 + [1] * 20)
    anchors = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(0))
    assert len(anchors) == 8 and len(set(anchors.tolist())) == 8
    assert anchors.tolist() == sorted(anchors.tolist())
    assert all(5 <= a < 24 for a in anchors.tolist())
    few = sample_anchors(loss_mask, 100, torch.Generator().manual_seed(0))
    assert len(few) == 19  # every response position but the last
    assert len(sample_anchors(torch.zeros(5), 4, torch.Generator())) == 0


def test_consistent_slots_stop_after_the_first_disagreement():
    agree = torch.tensor(
        [
            [False, True, True, True, True],  # slot 0 (the anchor) is never checked
            [True, False, True, True, True],  # slot 1 disagrees: slot 1 kept, 2.. dropped
            [True, True, True, False, True],  # slot 3 disagrees: slots up to 3 kept
            [True, True, True, True, False],  # the last slot's own agreement matters to none
        ]
    )
    assert consistent_slots(agree).int().tolist() == [
        [1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]
