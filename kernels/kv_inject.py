"""KV injection in Triton: k_norm, RoPE and the paged K/V write of every draft layer at once.

The torch twin is `kv_injection.inject` on the committed rows (`inject_committed_reference`).
Here the fused context (`fc` + `hidden_norm`, once, as there) goes through one GEMM against
every layer's K/V weights stacked, then one program per (request, block slot, layer) applies
that layer's `k_norm` (RMSNorm), neox (rotate-half) RoPE from the layer's own
`rotary_emb.cos_sin_cache` at the row's absolute position, the drafter's value scale, and
stores K and V straight into the pool at the row's slot. Programs for slots >= commit_len
return at once: rejected rows are never written, and neither is any slot not listed in
`cache_loc` (other requests' rows, radix-hit prefixes). Upstream's fused path instead norms
and ropes every row of every layer into a workspace, then launches one masked write per layer.

`MHATokenToKVPool` allocates each layer's K and V separately, so no stride links layers; the
kernel indexes the pool's own base-pointer tables (`k_data_ptrs`/`v_data_ptrs`, uint64) and
casts the entry to a typed pointer, which works compiled and under TRITON_INTERPRET alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.speculative.dflash_utils import can_dflash_use_fused_qkv_proj

from dflash_sglang import kv_injection

_POOL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class StackedKV:
    """What the fused path reads per layer, built once per (re)loaded draft model.

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
    if kv_pool.dtype not in _POOL_DTYPES or kv_pool.kv_cache_layout != "nhd":
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


def can_fuse(draft_model, kv_pool) -> tuple[bool, str]:
    """Whether `inject_committed` computes what `kv_injection.inject` does, and if not why."""
    reason = _model_reason(draft_model) or _pool_reason(draft_model, kv_pool)
    return not reason, reason


def stack_kv_weights(draft_model) -> StackedKV:
    """Stack the per-layer weights the fused path needs (call once, after `can_fuse`)."""
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


@triton.jit
def _inject_kernel(
    kv_ptr, kv_row_stride, k_norm_ptr, eps_ptr, v_scale_ptr, cos_sin_ptr, cos_sin_stride,
    positions_ptr, loc_ptr, commit_lens_ptr, k_ptrs, v_ptrs, slot_stride, head_stride,
    group_size,
    HAS_COMMIT: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF_ROT: tl.constexpr, HEADS_POW2: tl.constexpr, DIM_POW2: tl.constexpr,
    HALF_POW2: tl.constexpr, POOL_DTYPE: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1)
    layer = tl.program_id(2)
    if HAS_COMMIT:
        if slot >= tl.load(commit_lens_ptr + group):
            return
    row = group * group_size + slot
    pos = tl.load(positions_ptr + row)
    loc = tl.load(loc_ptr + row)

    heads = tl.arange(0, HEADS_POW2)[:, None]
    dims = tl.arange(0, DIM_POW2)[None, :]
    halves = tl.arange(0, HALF_POW2)[None, :]
    in_head = (heads < KV_HEADS) & (dims < HEAD_DIM)
    in_half = (heads < KV_HEADS) & (halves < HALF_ROT)
    k_src = kv_ptr + row * kv_row_stride + layer * (2 * KV_HEADS * HEAD_DIM) + heads * HEAD_DIM
    v_src = k_src + KV_HEADS * HEAD_DIM
    norm_w = k_norm_ptr + layer * HEAD_DIM

    k = tl.load(k_src + dims, mask=in_head, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(k * k, axis=1) / HEAD_DIM + tl.load(eps_ptr + layer))[:, None]
    w1 = tl.load(norm_w + halves, mask=halves < HALF_ROT, other=0.0).to(tl.float32)
    w2 = tl.load(norm_w + HALF_ROT + halves, mask=halves < HALF_ROT, other=0.0).to(tl.float32)
    x1 = tl.load(k_src + halves, mask=in_half, other=0.0).to(tl.float32) * inv_rms * w1
    x2 = tl.load(k_src + HALF_ROT + halves, mask=in_half, other=0.0).to(tl.float32) * inv_rms * w2
    cos_sin = cos_sin_ptr + pos * cos_sin_stride
    cos = tl.load(cos_sin + halves, mask=halves < HALF_ROT, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin + HALF_ROT + halves, mask=halves < HALF_ROT, other=0.0).to(tl.float32)

    k_dst = tl.load(k_ptrs + layer).to(tl.pointer_type(POOL_DTYPE))
    k_dst += loc * slot_stride + heads * head_stride
    tl.store(k_dst + halves, (x1 * cos - x2 * sin).to(POOL_DTYPE), mask=in_half)
    tl.store(k_dst + HALF_ROT + halves, (x2 * cos + x1 * sin).to(POOL_DTYPE), mask=in_half)
    if 2 * HALF_ROT < HEAD_DIM:  # partial rotary: the tail is normed only
        w = tl.load(norm_w + dims, mask=dims < HEAD_DIM, other=0.0).to(tl.float32)
        tail = in_head & (dims >= 2 * HALF_ROT)
        tl.store(k_dst + dims, (k * inv_rms * w).to(POOL_DTYPE), mask=tail)

    v = tl.load(v_src + dims, mask=in_head, other=0.0).to(tl.float32)
    v_dst = tl.load(v_ptrs + layer).to(tl.pointer_type(POOL_DTYPE))
    v_dst += loc * slot_stride + heads * head_stride
    tl.store(v_dst + dims, (v * tl.load(v_scale_ptr + layer)).to(POOL_DTYPE), mask=in_head)


def _check_rows(target_hidden, positions, cache_loc, commit_lens) -> None:
    n = cache_loc.shape[0]
    if cache_loc.ndim != 1 or cache_loc.dtype != torch.int64 or not cache_loc.is_contiguous():
        raise ValueError("cache_loc must be a contiguous int64 [n]")
    if positions.shape != (n,) or not positions.is_contiguous():
        raise ValueError(f"positions must be contiguous [n] = [{n}]")
    if target_hidden.ndim != 2 or target_hidden.shape[0] != n:
        raise ValueError(f"target_hidden must be [n, K*H] with n = {n} (trim padding rows)")
    if commit_lens is not None:
        bs = commit_lens.numel()
        if commit_lens.ndim != 1 or not commit_lens.is_contiguous() or bs * (n // max(bs, 1)) != n:
            raise ValueError(f"commit_lens must be contiguous [bs] with bs dividing n = {n}")


def inject_committed(
    draft_model,
    stacked: StackedKV,
    kv_pool,
    target_hidden: torch.Tensor,
    positions: torch.Tensor,
    cache_loc: torch.Tensor,
    commit_lens: torch.Tensor | None = None,
) -> None:
    """Write draft K/V for `target_hidden` rows `[n, K*H]` at slots `cache_loc` `[n]`.

    With `commit_lens` `[bs]` the rows are bs blocks of n/bs and only the first
    `commit_lens[i]` rows of block i are written (verify); without it every row is (prefill).
    The caller has checked `can_fuse(draft_model, kv_pool)`, and positions lie inside the
    rotary cos_sin_cache (as `kv_injection.inject` needs too).
    """
    _check_rows(target_hidden, positions, cache_loc, commit_lens)
    n = cache_loc.shape[0]
    if n == 0:
        return
    ctx = draft_model.project_target_hidden(target_hidden)
    kv = F.linear(ctx.to(stacked.weight.dtype), stacked.weight)
    groups, group_size = (
        (n, 1) if commit_lens is None else (commit_lens.numel(), n // commit_lens.numel())
    )
    layers = stacked.k_norm_weight.shape[0]
    first = stacked.first_layer - kv_pool.start_layer
    cos_sin = stacked.rotary_emb.cos_sin_cache
    pool_slots = kv_pool.k_buffer[first]
    _inject_kernel[(groups, group_size, layers)](
        kv, kv.stride(0), stacked.k_norm_weight, stacked.k_norm_eps, stacked.v_scale,
        cos_sin, cos_sin.stride(0), positions, cache_loc,
        cache_loc if commit_lens is None else commit_lens,
        kv_pool.k_data_ptrs[first : first + layers], kv_pool.v_data_ptrs[first : first + layers],
        pool_slots.stride(0), pool_slots.stride(1), group_size,
        HAS_COMMIT=commit_lens is not None, KV_HEADS=stacked.num_kv_heads,
        HEAD_DIM=stacked.head_dim, HALF_ROT=stacked.rotary_dim // 2,
        HEADS_POW2=triton.next_power_of_2(stacked.num_kv_heads),
        DIM_POW2=triton.next_power_of_2(stacked.head_dim),
        HALF_POW2=triton.next_power_of_2(stacked.rotary_dim // 2),
        POOL_DTYPE=_POOL_DTYPES[kv_pool.dtype],
    )  # fmt: skip


def inject_committed_reference(
    draft_model,
    kv_pool,
    target_hidden: torch.Tensor,
    positions: torch.Tensor,
    cache_loc: torch.Tensor,
    commit_lens: torch.Tensor | None = None,
) -> None:
    """The torch twin of `inject_committed` (which also takes the `StackedKV`)."""
    if commit_lens is not None:
        rows = kv_injection.committed_rows(commit_lens, cache_loc.numel() // commit_lens.numel())
        target_hidden, positions, cache_loc = target_hidden[rows], positions[rows], cache_loc[rows]
    kv_injection.inject(draft_model, kv_pool, target_hidden, positions, cache_loc)
