"""The block loss's labels: the data's tokens, or the target's own argmax (`--labels target`),
which is what makes someone else's text usable as training data."""

from __future__ import annotations

import pytest
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


def _loss(example: Example, head: Head, target_labels: bool, consistent: bool = False) -> float:
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
        consistent=consistent,
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


def test_consistent_labels_drop_slots_after_the_data_leaves_the_targets_path():
    weight = torch.linalg.qr(torch.randn(V, V))[0][:, :H].contiguous() * 4
    head = Head(weight, None)
    ids = torch.randint(0, V - 2, (S,), generator=torch.Generator().manual_seed(2))
    says = torch.roll(ids, -1)
    # Where the data follows the target everywhere nothing is dropped.
    assert _loss(_example(ids, says, weight), head, True, consistent=True) == _loss(
        _example(ids, says, weight), head, True
    )
    # The target disagrees with the data at position 6 (block 0, slot 2: it says V-2 after
    # position 5). Slot 3's label (said at position 6) then follows the data's path, not
    # the target's: with consistent labels it has no effect on the loss; without, it has.
    says[5] = V - 2
    a, b = says.clone(), says.clone()
    b[6] = (says[6] + 1) % (V - 2)
    with_a = _example(ids, a, weight)
    with_b = _example(ids, b, weight)
    assert _loss(with_a, head, True, consistent=True) == _loss(with_b, head, True, consistent=True)
    assert _loss(with_a, head, True) != _loss(with_b, head, True)
    # The disagreeing slot itself still counts (its label is the target's, on its path).
    c = says.clone()
    c[5] = V - 3
    assert _loss(with_a, head, True, consistent=True) != _loss(
        _example(ids, c, weight), head, True, consistent=True
    )


def test_consistent_labels_need_the_targets_labels():
    weight = torch.randn(V, H)
    ids = torch.randint(0, V - 1, (S,), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="labels='target'"):
        _loss(_example(ids, torch.roll(ids, -1), weight), Head(weight, None), False, True)


def test_average_is_the_mean_of_the_drafters_and_refuses_other_shapes(tmp_path, capsys):
    """`training average`: each weight the fp32 mean of the drafters' (saved bf16)."""
    from dataclasses import replace

    from dflash_sglang.drafter import DFlashDrafter
    from dflash_sglang.training.__main__ import main

    a, b = (
        new_drafter(CONFIG, seed=1).save(tmp_path / "a"),
        new_drafter(CONFIG, seed=2).save(tmp_path / "b"),
    )
    assert main(["average", "--drafters", f"{a},{b}", "--out", str(tmp_path / "avg")]) == 0
    wa, wb = DFlashDrafter.load(a).state_dict(), DFlashDrafter.load(b).state_dict()
    avg = DFlashDrafter.load(tmp_path / "avg").state_dict()
    for k, v in avg.items():
        assert torch.equal(v, ((wa[k] + wb[k]) / 2).bfloat16().float()), k
    other = new_drafter(replace(CONFIG, num_hidden_layers=2), seed=3).save(tmp_path / "c")
    assert main(["average", "--drafters", f"{a},{other}", "--out", str(tmp_path / "x")]) == 2
    assert "same config.json" in capsys.readouterr().err
