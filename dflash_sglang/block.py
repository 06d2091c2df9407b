"""Building the draft block: `[pending bonus token, MASK x (B-1)]` at absolute positions.

The anchor (slot 0) is the token the target produced last; it has no KV yet, so the block
starts at position `prefix_len` (the number of committed tokens with KV).
"""

from __future__ import annotations

import torch


def build_draft_block(
    bonus_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(block_ids [bs, B] int64, positions [bs, B] int64)`."""
    bs = bonus_tokens.numel()
    block_ids = torch.full(
        (bs, block_size), mask_token_id, dtype=torch.int64, device=bonus_tokens.device
    )
    block_ids[:, 0] = bonus_tokens.view(-1).to(torch.int64)
    offsets = torch.arange(block_size, dtype=torch.int64, device=bonus_tokens.device)
    positions = prefix_lens.view(-1, 1).to(torch.int64) + offsets
    return block_ids, positions
