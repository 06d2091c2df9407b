"""Training blocks: random anchors, the sparse attention mask, same-position labels, weights.

Pure tensor functions, so the two bugs that ruined public re-implementations are pinned by
tests: labels are the tokens AT the block's positions (slot k predicts `ids[anchor + k]`,
not `anchor + k + 1`), and a block sees target features strictly BEFORE its anchor (the
anchor's own feature does not exist yet at inference time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass(frozen=True)
class Blocks:
    """N draft blocks laid out after one sequence's S context positions."""

    anchors: torch.Tensor  # [N] sorted anchor positions
    input_ids: torch.Tensor  # [N*bs] slot 0 = anchor token, the rest MASK
    position_ids: torch.Tensor  # [S + N*bs] context 0..S-1, then anchor + k
    attention_mask: torch.Tensor  # [N*bs, S + N*bs] bool, True = may attend
    labels: torch.Tensor  # [N*bs] token at anchor + k, IGNORE where no loss
    weights: torch.Tensor  # [N*bs] float loss weight, 0 where no loss


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """`exp(-(k-1)/γ)` for slots k ≥ 1; slot 0 (the anchor itself) has no loss."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> torch.Tensor:
    """Up to `num_anchors` distinct response positions with at least one label after them."""
    valid = loss_mask.bool().clone()
    valid[-1] = False  # an anchor at the last position has nothing to predict
    candidates = valid.nonzero().flatten()
    if len(candidates) == 0:
        return candidates
    pick = torch.randperm(len(candidates), generator=generator)[:num_anchors]
    return candidates[pick].sort().values


def attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Block n sees context positions `< anchors[n]` and every slot of block n, nothing else."""
    n = len(anchors)
    block_of_query = torch.arange(n * block_size) // block_size  # [Q]
    context = torch.arange(seq_len)[None, :] < anchors[block_of_query][:, None]  # [Q, S]
    same_block = block_of_query[:, None] == block_of_query[None, :]  # [Q, Q]
    return torch.cat([context, same_block], dim=1)


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> Blocks:
    """Inputs, positions, mask, labels and weights for one sequence's blocks."""
    seq_len = len(input_ids)
    offsets = torch.arange(block_size)
    positions = (anchors[:, None] + offsets[None, :]).flatten()  # [N*bs]
    inside = positions < seq_len
    safe = positions.clamp(max=seq_len - 1)

    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[offsets.repeat(len(anchors)) == 0] = input_ids[anchors]

    slot_weight = loss_weights(block_size, gamma).repeat(len(anchors))
    weights = slot_weight * inside * loss_mask[safe].float()
    labels = torch.where(weights > 0, input_ids[safe], torch.full_like(safe, IGNORE))
    return Blocks(
        anchors=anchors,
        input_ids=block_ids,
        position_ids=torch.cat([torch.arange(seq_len), positions]),
        attention_mask=attention_mask(anchors, seq_len, block_size),
        labels=labels,
        weights=weights,
    )


def consistent_slots(agree: torch.Tensor) -> torch.Tensor:
    """Slots whose label continues the target's own greedy path: `agree` is [N, bs] bool,
    True where the data's token at a slot equals the target's choice there.

    With `--labels target` on text the target did not write, slot k's label is the target's
    argmax after the DATA's tokens at slots 1..k-1. At inference slot k counts only when
    slots 1..k-1 were accepted, i.e. equal the target's choices, so that label is the right
    one exactly when the data agreed at every earlier slot:

        valid[n, k] = ∏_{1 ≤ j < k} agree[n, j]     (slots 0 and 1 always valid)
    """
    valid = torch.ones_like(agree, dtype=torch.bool)
    valid[:, 2:] = torch.cumprod(agree[:, 1:-1].int(), dim=1).bool()
    return valid


def default_gamma(block_size: int) -> float:
    """The paper's decay: 7 for block 16, 5 for 10, 4 for 8 (interpolated otherwise)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, math.log2(block_size) * 1.75))
