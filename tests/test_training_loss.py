"""The block loss's labels: the data's tokens, or the target's own argmax (`--labels target`),
which is what makes someone else's text usable as training data."""

from __future__ import annotations

import torch

from dflash_sglang.drafter import DraftConfig
from dflash_sglang.training.features import Example
from dflash_sglang.training.train import Head, block_loss, new_drafter

V, H, S = 64, 32, 12
CONFIG = DraftConfig(
    hidden_size=H,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=V,
    block_size=4,
    mask_token_id=V - 1,
    target_layer_ids=(0, 1),
    num_target_layers=2,
)


def _loss(example: Example, head: Head, target_labels: bool) -> float:
    torch.manual_seed(0)
    embed = torch.nn.Embedding(V, H)
    loss, _ = block_loss(
        new_drafter(CONFIG, seed=0),
        embed,
        head,
        example,
        torch.tensor([4, 9]),  # labels at positions 5, 6, 7 and 10, 11
        gamma=7.0,
        distill=0.0,
        target_labels=target_labels,
    )
    return loss.item()


def _example(ids: torch.Tensor, says: torch.Tensor, weight: torch.Tensor) -> Example:
    """`says[p]`: the token the target predicts after position p (its final state points at
    that token's lm_head row)."""
    features = torch.randn(S, 2 * H, generator=torch.Generator().manual_seed(1))
    return Example(ids, 3, features, weight[says] * 10)


def test_target_labels_are_the_targets_argmax_at_the_previous_position():
    weight = torch.linalg.qr(torch.randn(V, V))[0][:, :H].contiguous() * 4  # distinct rows
    head = Head(weight, None)
    ids = torch.randint(0, V - 1, (S,), generator=torch.Generator().manual_seed(2))
    # A target that agrees with the data: both label kinds give the same loss.
    agrees = _example(ids, torch.roll(ids, -1), weight)
    assert _loss(agrees, head, True) == _loss(agrees, head, False)
    # A target that would say 7 everywhere: its labels are 7, whatever the text says. The
    # drafter sees only anchor tokens and features, so the text-label loss on data whose
    # labelled positions hold 7 is the same number.
    sevens = _example(ids, torch.full((S,), 7), weight)
    relabelled = ids.clone()
    relabelled[[5, 6, 7, 10, 11]] = 7
    expected = _loss(_example(relabelled, torch.roll(ids, -1), weight), head, False)
    assert _loss(sevens, head, True) == expected != _loss(sevens, head, False)
