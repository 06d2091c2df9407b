"""KV injection: fused target features become K/V rows of every draft layer.

After the target computes tokens (prefill or verify), their captured hidden states are
projected once (`fc` + `hidden_norm`), then through each draft layer's K/V projections,
`k_norm` and RoPE at the tokens' absolute positions, and written to the draft KV pool at
the same slot ids the target used. Only committed rows are written; rejected drafts never
reach the draft cache.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc


def committed_rows(commit_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat row indices `[bs*B]` of the committed prefix of every block, in order."""
    cols = torch.arange(block_size, device=commit_lens.device).unsqueeze(0)
    keep = cols < commit_lens.view(-1, 1).to(torch.int64)
    return keep.view(-1).nonzero().squeeze(1)


def inject(
    draft_model: torch.nn.Module,
    kv_pool,
    target_hidden: torch.Tensor,
    positions: torch.Tensor,
    cache_loc: torch.Tensor,
) -> None:
    """Write draft K/V for `target_hidden` rows `[n, K*H]` at `cache_loc` `[n]`."""
    if target_hidden.shape[0] == 0:
        return
    ctx = draft_model.project_target_hidden(target_hidden)
    loc = KVWriteLoc(cache_loc.to(torch.int64), physical=True)
    positions = positions.to(torch.int64)
    for layer in draft_model.layers:
        attn = layer.self_attn
        k, v = attn.kv_proj_only(draft_model.prepare_context_hidden_for_kv(layer, ctx))
        k = attn.apply_k_rope(positions, attn.apply_k_norm(k))
        k = k.view(-1, attn.num_kv_heads, attn.head_dim)
        v = v.view(-1, attn.num_kv_heads, attn.head_dim)
        kv_pool.set_kv_buffer(attn.attn, loc, k, v, attn.attn.k_scale, attn.attn.v_scale)
