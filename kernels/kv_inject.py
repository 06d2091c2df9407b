"""KV injection in Triton: k_norm, RoPE and the paged K/V write of every draft layer at once.

The torch twins are `kv_injection.inject` on the committed rows (`inject_committed_reference`)
and `kv_injection.inject_stacked` (CPU). Here the fused context (`fc` + `hidden_norm`, once,
as there) goes through one GEMM against every layer's K/V weights stacked, then one program
per (request, block slot, layer) applies that layer's `k_norm` (RMSNorm), neox (rotate-half)
RoPE from the layer's own `rotary_emb.cos_sin_cache` at the row's absolute position, the
drafter's value scale, and stores K and V straight into the pool at the row's slot. Programs
for slots >= commit_len return at once: rejected rows are never written, and neither is any
slot not listed in `cache_loc` (other requests' rows, radix-hit prefixes). Upstream's fused
path instead norms and ropes every row of every layer into a workspace, then launches one
masked write per layer.

`MHATokenToKVPool` allocates each layer's K and V separately, so no stride links layers; the
kernel indexes the pool's own base-pointer tables (`k_data_ptrs`/`v_data_ptrs`, uint64) and
casts the entry to a typed pointer, which works compiled and under TRITON_INTERPRET alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_sglang import kv_injection
from dflash_sglang.kv_injection import POOL_DTYPES, StackedKV

# Triton's name for each pool dtype `kv_injection.can_stack` accepts.
_POOL_DTYPES = {dtype: getattr(tl, str(dtype).removeprefix("torch.")) for dtype in POOL_DTYPES}


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
    The caller has checked `kv_injection.can_stack(draft_model, kv_pool)`, and positions lie
    inside the rotary cos_sin_cache (as `kv_injection.inject` needs too).
    """
    _check_rows(target_hidden, positions, cache_loc, commit_lens)
    n = cache_loc.shape[0]
    if n == 0:
        return
    kv = kv_injection.stacked_kv_rows(draft_model, stacked, target_hidden)
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
