"""Paged attention for few query rows on CPU (`cpu/paged_attention.cpp`), built on first use.

The first build takes ~30 s (`cpu_build`); `available()` is False, with the reason logged
once, when no compiler can build it: callers then keep their torch path.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from dflash_sglang.kernels.cpu_build import SOURCES, try_build

logger = logging.getLogger(__name__)

SOURCE = SOURCES / "paged_attention.cpp"
# What the source's `#if` demands (`-march=native` enables exactly the CPU's own flags).
NEEDS = frozenset({"avx512f", "avx512bw"})


@functools.cache
def extension() -> ModuleType | None:
    """The compiled module, or None (logged) when it cannot be built here."""
    logger.info("Loading the CPU paged attention kernel (the first build takes ~30 s)")
    return try_build(SOURCE, "dflash_cpu_paged_attention", "using the torch path", NEEDS)


def available() -> bool:
    """Whether the kernel is built (building it now if needed)."""
    return extension() is not None


def paged_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slot_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_lens: torch.Tensor,
    q_starts: torch.Tensor,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """`[tokens, heads, v_dim]` attention of packed query rows over their requests' keys.

    Query row r of request b is token `q_starts[b] + r` and sits at key position
    `kv_lens[b] - q_lens[b] + r`; causal rows see keys up to it, others all `kv_lens[b]`.
    Keys and values are read through `slot_table[b, :kv_lens[b]]` from the pool buffers
    (`[slots, kv_heads, dim]`); softmax and accumulation in fp32. Equal to
    `torch_paged_attention`, which the tests hold it to.
    """
    ext = extension()
    if ext is None:
        raise RuntimeError("CPU paged attention is not built here (see the log)")
    return ext.paged_attention(
        q, k_buffer, v_buffer, slot_table, kv_lens, q_lens, q_starts, causal, scale
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
) -> None:
    """`k_buffer[loc] = k; v_buffer[loc] = v` in one call: rows `[tokens, kv_heads, dim]`
    (any token stride, e.g. views into a fused QKV output) into `[slots, kv_heads, dim]`
    buffers of the same dtype; a slot outside the pool is refused."""
    ext = extension()
    if ext is None:
        raise RuntimeError("CPU paged attention is not built here (see the log)")
    ext.store_kv(k, v, k_buffer, v_buffer, loc.long())


def torch_paged_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slot_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_lens: torch.Tensor,
    q_starts: torch.Tensor,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """The same attention, one request at a time in plain fp32 torch: the reference."""
    heads, v_dim = q.shape[1], v_buffer.shape[-1]
    out = q.new_empty((q.shape[0], heads, v_dim))
    for b in range(kv_lens.shape[0]):
        kv_len, rows, start = int(kv_lens[b]), int(q_lens[b]), int(q_starts[b])
        slots = slot_table[b, :kv_len]
        group = heads // k_buffer.shape[1]
        key = k_buffer[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)
        value = v_buffer[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)
        query = q[start : start + rows].float().transpose(0, 1)
        scores = query @ key.transpose(-1, -2) * scale
        if causal:
            position = kv_len - rows + torch.arange(rows)
            hidden = torch.arange(kv_len)[None, :] > position[:, None]
            scores = scores.masked_fill(hidden, float("-inf"))
        out[start : start + rows] = (scores.softmax(-1) @ value).transpose(0, 1).to(q.dtype)
    return out
