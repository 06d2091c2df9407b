"""Vectorised torch versions of the `sgl_kernel` CPU ops SGLang's CPU engine calls.

The CPU build of sgl-kernel is not on PyPI, so on a CPU machine without it these stand in
(see `shim/sgl_kernel`). Each op matches the semantics of the kernel it replaces; none loops
over requests in Python.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch


def segment_index(
    req_pool_indices: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    row_len: int,
) -> torch.Tensor:
    """Flat indices into a `[rows, row_len]` table for the segments `[start, end)` of each row.

    Segments are laid out back to back, request by request, as SGLang packs `out_cache_loc`.
    Equal lengths (every decode and verify step: 1 or `width` tokens per request) take a
    broadcast of three ops instead of the general path's ten: 20 vs 70-90 µs at 16
    requests in isolation (twice per DFLASH_X step; a whole step's gain is within noise).
    """
    lens = (end_offset - start_offset).to(torch.int64)
    if lens.numel() and bool((lens == lens[0]).all()):
        width = int(lens[0])
        rows = req_pool_indices.to(torch.int64) * row_len + start_offset.to(torch.int64)
        return (rows[:, None] + torch.arange(width, device=lens.device)).view(-1)
    total = int(lens.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.int64, device=lens.device)
    seg_start = torch.cumsum(lens, 0) - lens
    owner = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    within = torch.arange(total, device=lens.device) - seg_start[owner]
    cols = start_offset.to(torch.int64)[owner] + within
    return req_pool_indices.to(torch.int64)[owner] * row_len + cols


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int | None = None,
) -> None:
    """`req_to_token[req, start:end] = out_cache_loc[segment]` for every request."""
    flat = segment_index(req_pool_indices, start_offset, end_offset, req_to_token.shape[1])
    req_to_token.view(-1)[flat] = out_cache_loc[: flat.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int | None = None,
) -> None:
    """`out_cache_loc[segment] = req_to_token[req, start:end]`: the inverse of the op above."""
    table = req_to_token if req_to_token.is_contiguous() else req_to_token.contiguous()
    flat = segment_index(req_pool_indices, start_offset, end_offset, table.shape[1])
    out_cache_loc[: flat.numel()] = table.view(-1)[flat].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """Each request's `topk * num_cols` slots from `seq_lens` on, packed request by request."""
    width = topk * num_cols
    assign_extend_cache_locs_cpu(
        req_pool_indices, req_to_token, seq_lens, seq_lens + width, out_cache_loc
    )


def _byte_view(address: int, nbytes: int) -> torch.Tensor:
    buf = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.from_numpy(np.ctypeslib.as_array(buf))


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV rows `src_loc -> tgt_loc` in every layer buffer (raw pointers, byte strides).

    Gathers all source rows before writing, so overlapping moves are safe, as in the kernel.
    """
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        layer = _byte_view(int(address), rows * int(stride)).view(rows, int(stride))
        layer[tgt] = layer[src]
