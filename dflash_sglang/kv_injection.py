"""KV injection: fused target features become K/V rows of every draft layer.

After the target computes tokens (prefill or verify), their captured hidden states are
projected once (`fc` + `hidden_norm`), then through each draft layer's K/V projections,
`k_norm` and RoPE at the tokens' absolute positions, and written to the draft KV pool at
the same slot ids the target used. Only committed rows are written; rejected drafts never
reach the draft cache.

`inject` is the reference: per layer, as the draft model's own methods compute it.
`inject_stacked` computes the same with every layer's K/V projection in one GEMM and k_norm,
RoPE and the value scale batched over layers: a dozen torch ops per step instead of ~20 per
layer, which on a CPU is most of what injection costs (the GEMMs are tiny at decode).
`dflash_sglang.kernels.kv_inject` is its one-launch Triton form for GPUs.

`held_rows.HeldRows` keeps committed rows back until something reads their slots (CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool
from sglang.srt.speculative.dflash_utils import can_dflash_use_fused_qkv_proj

POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


@dataclass(frozen=True)
class StackedKV:
    """Every draft layer's injection weights side by side, built once per (re)loaded draft.

    `weight` copies every layer's K/V projection (L * 2 * kv_size rows): the price of one
    GEMM instead of L.
    """

    weight: torch.Tensor  # [L * 2 * kv_size, hidden]: layer 0 K, layer 0 V, layer 1 K, ...
    k_norm_weight: torch.Tensor  # [L, head_dim]
    k_norm_eps: torch.Tensor  # [L] float32
    v_scale: torch.Tensor  # [L] float32, the drafter's value scale (1 when it has none)
    rotary_emb: torch.nn.Module  # layer 0's; cos_sin_cache is read per call (it can grow)
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    first_layer: int  # pool layer id of draft layer 0; draft layers are consecutive


def _unit(scale) -> bool:
    return scale is None or math.isclose(float(scale), 1.0)


def _model_reason(draft_model) -> str:
    if not getattr(draft_model, "supports_fused_context_kv", False):
        return "draft model does not declare supports_fused_context_kv"
    first = draft_model.layers[0].self_attn
    for i, layer in enumerate(draft_model.layers):
        attn = layer.self_attn
        ok, reason = can_dflash_use_fused_qkv_proj(attn.qkv_proj)
        if not ok:
            return f"layer {i}: {reason}"
        rope = attn.rotary_emb
        if type(rope).forward_native is not RotaryEmbedding.forward_native:
            return f"layer {i}: RoPE {type(rope).__name__} is not a cos_sin_cache lookup"
        if not rope.is_neox_style or hasattr(rope, "sin_cos_cache"):
            return f"layer {i}: only neox RoPE from cos_sin_cache is fused"
        if (attn.num_kv_heads, attn.head_dim, rope.rotary_dim) != (
            first.num_kv_heads,
            first.head_dim,
            first.rotary_emb.rotary_dim,
        ):
            return f"layer {i}: heads, head_dim or rotary_dim differ from layer 0"
        if attn.attn.layer_id != first.attn.layer_id + i:
            return "draft layer ids are not consecutive"
        if not (_unit(attn.attn.k_scale) and _unit(attn.attn.v_scale)):
            return f"layer {i}: non-unit KV cache scales"
    return ""


def _pool_reason(draft_model, kv_pool) -> str:
    attn = draft_model.layers[0].self_attn
    if type(kv_pool) is not MHATokenToKVPool:
        return f"pool {type(kv_pool).__name__} is not a plain MHATokenToKVPool"
    if kv_pool.is_quantized_kv_cache or kv_pool.store_dtype != kv_pool.dtype:
        return "quantized KV cache"
    if kv_pool.dtype not in POOL_DTYPES or kv_pool.kv_cache_layout != "nhd":
        return f"pool dtype {kv_pool.dtype} / layout {kv_pool.kv_cache_layout} not supported"
    if (kv_pool.head_num, kv_pool.head_dim, kv_pool.v_head_dim) != (
        attn.num_kv_heads,
        attn.head_dim,
        attn.head_dim,
    ):
        return "pool head shape differs from the draft's"
    first = attn.attn.layer_id - kv_pool.start_layer
    buffers = kv_pool.k_buffer[first : first + len(draft_model.layers)]
    buffers += kv_pool.v_buffer[first : first + len(draft_model.layers)]
    if any(b.stride() != buffers[0].stride() for b in buffers) or buffers[0].stride(2) != 1:
        return "pool layers do not share one [slot, head, dim] stride"
    return ""


def can_stack(draft_model, kv_pool) -> tuple[bool, str]:
    """Whether the stacked paths (`inject_stacked`, the Triton kernel) compute what `inject`
    does for this draft and pool, and if not why."""
    reason = _model_reason(draft_model) or _pool_reason(draft_model, kv_pool)
    return not reason, reason


def stack_kv_weights(draft_model) -> StackedKV:
    """Stack the per-layer weights the stacked paths need (call once, after `can_stack`)."""
    attns = [layer.self_attn for layer in draft_model.layers]
    first = attns[0]
    device = first.k_norm.weight.device
    return StackedKV(
        weight=torch.cat(
            [a.qkv_proj.weight[a.q_size : a.q_size + 2 * a.kv_size] for a in attns]
        ).contiguous(),
        k_norm_weight=torch.stack([a.k_norm.weight for a in attns]).contiguous(),
        k_norm_eps=torch.tensor(
            [a.k_norm.variance_epsilon for a in attns], dtype=torch.float32, device=device
        ),
        v_scale=torch.tensor(
            [1.0 if a.v_scale is None else a.v_scale for a in attns],
            dtype=torch.float32,
            device=device,
        ),
        rotary_emb=first.rotary_emb,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        rotary_dim=first.rotary_emb.rotary_dim,
        first_layer=first.attn.layer_id,
    )


def stacked_kv_rows(draft_model, stacked: StackedKV, target_hidden: torch.Tensor) -> torch.Tensor:
    """Every layer's pre-norm K and V of `target_hidden` `[n, K*H]`: `fc` + `hidden_norm`
    once, then one GEMM, `[n, L * 2 * kv_size]` laid out as `StackedKV.weight`."""
    ctx = draft_model.project_target_hidden(target_hidden)
    return F.linear(ctx.to(stacked.weight.dtype), stacked.weight)


def inject_stacked(
    draft_model,
    stacked: StackedKV,
    kv_pool,
    target_hidden: torch.Tensor,
    positions: torch.Tensor,
    cache_loc: torch.Tensor,
    commit_lens: torch.Tensor | None = None,
) -> None:
    """`inject` in a dozen ops; arguments as `kernels.kv_inject.inject_committed`.

    With `commit_lens` `[bs]` the rows are bs blocks of n/bs and only the first
    `commit_lens[i]` rows of block i are written. Norm and RoPE run in fp32 and round once,
    as the Triton kernel does (the per-layer path rounds after each op: bf16 differs by ulps).
    """
    if commit_lens is not None:
        rows = committed_rows(commit_lens, cache_loc.numel() // max(commit_lens.numel(), 1))
        target_hidden, positions, cache_loc = target_hidden[rows], positions[rows], cache_loc[rows]
    n = cache_loc.shape[0]
    if n == 0:
        return
    layers, heads, dim = stacked.k_norm_weight.shape[0], stacked.num_kv_heads, stacked.head_dim
    kv = stacked_kv_rows(draft_model, stacked, target_hidden).view(n, layers, 2, heads, dim)
    k, v = kv[:, :, 0].float(), kv[:, :, 1].float()
    # RMSNorm over head_dim with each layer's weight and epsilon: [n, L, heads, dim].
    eps = stacked.k_norm_eps.view(1, layers, 1, 1)
    k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    k = k * stacked.k_norm_weight.view(1, layers, 1, dim).float()
    k = _neox_rope(k, stacked.rotary_emb.cos_sin_cache[positions.long()], stacked.rotary_dim)
    v = v * stacked.v_scale.view(1, layers, 1, 1)
    k, v = k.to(kv_pool.dtype), v.to(kv_pool.dtype)
    first = stacked.first_layer - kv_pool.start_layer
    loc = cache_loc.long()
    for layer in range(layers):
        kv_pool.k_buffer[first + layer].index_copy_(0, loc, k[:, layer])
        kv_pool.v_buffer[first + layer].index_copy_(0, loc, v[:, layer])


def _neox_rope(k: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate-half RoPE on the first `rotary_dim` dims of `k` `[n, L, heads, dim]`; the tail
    passes through. `cos_sin` `[n, rotary_dim]` holds each row's cos then sin halves."""
    half = rotary_dim // 2
    cos_sin = cos_sin.float().view(-1, 1, 1, rotary_dim)
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    x1, x2, tail = k[..., :half], k[..., half:rotary_dim], k[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, tail], dim=-1)
