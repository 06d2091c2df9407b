"""The rows the target verifies: the DFlash draft block and the chain built from proposals.

The anchor (slot 0) is the token the target produced last; it has no KV yet, so a block
starts at position `prefix_len` (the number of committed tokens with KV).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_sglang.suffix import SuffixProposal


def build_draft_block(
    bonus_tokens: torch.Tensor, block_size: int, mask_token_id: int
) -> torch.Tensor:
    """The drafter's input `[bs, B]` int64: `[bonus, MASK x (B-1)]`."""
    bs = bonus_tokens.numel()
    block_ids = torch.full(
        (bs, block_size), mask_token_id, dtype=torch.int64, device=bonus_tokens.device
    )
    block_ids[:, 0] = bonus_tokens.view(-1).to(torch.int64)
    return block_ids


def assemble_candidates(
    drafts: torch.Tensor,
    suffix: Sequence[SuffixProposal | None],
    width: int,
    pad_token: int,
) -> torch.Tensor:
    """The verified chain `[bs, width]`: anchor, then each request's chosen proposal.

    `drafts` is `[bs, n]` (anchor + DFlash proposals, or the anchor alone when the drafter
    did not run). A request with a suffix proposal takes it; slots beyond a proposal's end
    keep the DFlash proposal if there is one, else `pad_token`: any token is lossless there,
    since verification only keeps what the target itself would emit.
    """
    bs, n = drafts.shape
    out = drafts[:, :width]
    if n < width:
        pad = torch.full((bs, width - n), pad_token, dtype=drafts.dtype, device=drafts.device)
        out = torch.cat([out, pad], dim=1)
    rows = [r for r, p in enumerate(suffix) if p is not None]
    if not rows or width == 1:
        return out
    # One host-to-device copy for all suffix rows; -1 marks slots past a proposal's end.
    table = [[*suffix[r].tokens[: width - 1], *[-1] * (width - 1)][: width - 1] for r in rows]
    proposed = torch.tensor(table, dtype=drafts.dtype).to(drafts.device)
    index = torch.tensor(rows, device=drafts.device)
    out = out.clone()
    out[index, 1:] = torch.where(proposed >= 0, proposed, out[index, 1:])
    return out
