"""Draft attention split in two: the block against itself, the committed context, merged.

Upstream's DFlash draft writes the block's own K/V into the draft cache at the verify
slots in every layer, then runs one paged non-causal pass over context + block. Those
2·L·bs·B writes are wasted: KV injection overwrites the committed rows right after the
verify, and the rest are never read. Here each draft layer instead runs

- the block as a **ragged** non-causal pass over the layer's own K/V (B keys per request),
- the committed context as a **paged** non-causal pass over the draft cache,

and combines the two by their log-sum-exps (FlashInfer's `merge_state`). Attention over
the union of two key sets is exactly the LSE-weighted mix of the attention over each:

    o = (2^{s_a} o_a + 2^{s_b} o_b) / (2^{s_a} + 2^{s_b}),   s = log2(2^{s_a} + 2^{s_b})

with s the base-2 log-sum-exp of the scaled scores (FlashInfer's convention). The index
lists are built once per step and shared by every layer.

This module is pure torch (runs and is tested on CPU): the layout, the merge, and torch
twins of the two FlashInfer wrappers with the same `plan`/`forward_return_lse` calls. The
SGLang backend that drives the real wrappers is `flashinfer_draft.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftLayout:
    """Where a step's draft block and context live; one per step, shared by every layer.

    Host indptrs feed FlashInfer's `plan` without a device-to-host read; the context
    indices stay on the device (gathered from `req_to_token`, no host round trip).
    """

    block_size: int
    qo_indptr: torch.Tensor  # [bs + 1] int32 host: B rows per request (ragged q and kv)
    context_indptr: torch.Tensor  # [bs + 1] int32 host
    context_indices: torch.Tensor  # [sum context] int32 device: draft-pool slots
    last_page_len: torch.Tensor  # [bs] int32 host: page size 1, so 1 (0 for no context)

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1


def draft_layout(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    block_size: int,
) -> DraftLayout:
    """The layout of a draft forward whose `seq_lens_cpu` = committed + block (as the
    worker and upstream's draft batch carry it). Rows padded by a CUDA graph runner may
    carry less than a block; their context is empty."""
    context = (seq_lens_cpu.to(torch.int64) - block_size).clamp(min=0)
    bs = context.numel()
    qo_indptr = torch.arange(0, (bs + 1) * block_size, block_size, dtype=torch.int32)
    context_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    context_indptr[1:] = torch.cumsum(context, 0)
    total = int(context_indptr[-1])

    device = req_to_token.device
    lens = context.to(device, non_blocking=True)
    starts = context_indptr[:-1].to(device=device, dtype=torch.int64, non_blocking=True)
    rows = torch.repeat_interleave(torch.arange(bs, device=device), lens, output_size=total)
    columns = torch.arange(total, device=device) - starts[rows]
    indices = req_to_token[req_pool_indices.to(torch.int64)[rows], columns].to(torch.int32)
    return DraftLayout(
        block_size=block_size,
        qo_indptr=qo_indptr,
        context_indptr=context_indptr,
        context_indices=indices,
        last_page_len=(context > 0).to(torch.int32),
    )


def merge_states(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of FlashInfer's `merge_state`: v `[n, heads, dim]`, s `[n, heads]`
    base-2 LSE (float32). A side with no keys has s = -inf and weighs nothing."""
    s = torch.logaddexp2(s_a.float(), s_b.float())
    w_a = torch.exp2(s_a.float() - s).unsqueeze(-1)
    w_b = torch.exp2(s_b.float() - s).unsqueeze(-1)
    v = w_a * v_a.float() + w_b * v_b.float()
    return v.to(v_a.dtype), s


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of one request: q `[n, H, D]`, k/v `[m, Hk, D]` (grouped
    heads) -> (o `[n, H, D]`, base-2 LSE `[n, H]`); m = 0 gives zeros and -inf."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if k.shape[0] == 0:
        return torch.zeros_like(q), q.new_full(q.shape[:2], -math.inf, dtype=torch.float32)
    k = k.float().repeat_interleave(heads // kv_heads, dim=1)
    v = v.float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale
    lse = torch.logsumexp(scores, dim=-1)  # natural log
    o = torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), v)
    return o.to(q.dtype), (lse / math.log(2.0)).transpose(0, 1).contiguous()


class TorchRaggedWrapper:
    """`BatchPrefillWithRaggedKVCacheWrapper`'s calls used here, in torch (non-causal)."""

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, **kw):
        assert not kw.get("causal", False)
        self._qo, self._kv = qo_indptr.tolist(), kv_indptr.tolist()
        self._scale = kw.get("sm_scale") or head_dim_qk**-0.5

    def forward_return_lse(self, q, k, v, causal=False, sm_scale=None, **_):
        assert not causal
        scale = sm_scale or self._scale
        parts = [
            attention_lse(q[q0:q1], k[k0:k1], v[k0:k1], scale)
            for q0, q1, k0, k1 in zip(self._qo, self._qo[1:], self._kv, self._kv[1:], strict=False)
        ]
        return torch.cat([o for o, _ in parts]), torch.cat([s for _, s in parts])


class TorchPagedWrapper:
    """`BatchPrefillWithPagedKVCacheWrapper`'s calls used here, in torch, page size 1."""

    def plan(
        self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
        num_qo_heads, num_kv_heads, head_dim_qk, page_size, **kw,
    ):  # fmt: skip
        assert page_size == 1 and not kw.get("causal", False)
        self._qo, self._kv = qo_indptr.tolist(), paged_kv_indptr.tolist()
        self._indices = paged_kv_indices.long()
        self._scale = kw.get("sm_scale") or head_dim_qk**-0.5

    def forward_return_lse(self, q, paged_kv_cache, causal=False, sm_scale=None, **_):
        assert not causal
        k_cache, v_cache = paged_kv_cache
        scale = sm_scale or self._scale
        parts = []
        for q0, q1, k0, k1 in zip(self._qo, self._qo[1:], self._kv, self._kv[1:], strict=False):
            slots = self._indices[k0:k1]
            parts.append(attention_lse(q[q0:q1], k_cache[slots], v_cache[slots], scale))
        return torch.cat([o for o, _ in parts]), torch.cat([s for _, s in parts])
