"""SGLang attention backend `dflash_cpu`: batched SDPA over the paged KV pool.

SGLang's `torch_native` backend loops over requests in Python and has no TARGET_VERIFY
path, and `intel_amx` needs the sgl-kernel CPU build. This backend pads the whole batch
once per forward (slot table, query rows, masks) and runs every layer as one
`scaled_dot_product_attention` call. Batches with few query rows per request (decode,
narrow verify) take our C++ kernel (`dflash_sglang.kernels.cpu_attention`), which reads
K/V straight from the pool through the slot table; where it cannot be built, two grouped
matmuls over gathered K/V, which SDPA's CPU kernel is several times slower than there. It
serves the target model (extend, decode, causal verify) and the
DFlash draft (non-causal verify block, `AttentionType.ENCODER_ONLY`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from dflash_sglang.cpu_platform import ATTENTION_ENV
from dflash_sglang.kernels import cpu_attention
from dflash_sglang.platform import CPU_ATTENTION_BACKEND

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


@dataclass(frozen=True)
class PaddedBatch:
    """A batch's padded geometry, built once per forward and shared by every layer.

    Keys live in a `[bs, kv_max]` grid, queries in a `[bs, q_rows]` grid. Masks are None
    when they would mask nothing, so SDPA can take its unmasked path. Masks and packed
    rows are built on first use: a forward whose every layer takes the C++ kernel (which
    reads only slots and lengths) never builds them.
    """

    batch_size: int
    q_rows: int
    q_max: int
    kv_max: int
    num_tokens: int
    # [bs, kv_max] pool slot of every key; padding points at the request's first key.
    kv_slots: torch.Tensor
    # Query row r of every request sits at key position r (`q_rows == kv_max`), so SDPA's
    # own `is_causal` is exact and its kernel skips the masked half of the scores.
    position_aligned: bool
    # Few query rows per request in a batch (decode, narrow verify): `grouped_attention`.
    grouped: bool
    # Up to a block's query rows per request, the C++ kernel built:
    # `cpu_attention.paged_attention`, which reads `kv_slots` through these int64 [bs]
    # lengths and packed query offsets.
    paged: bool
    kv_lens: torch.Tensor
    q_lens: torch.Tensor
    q_starts: torch.Tensor
    # [bs] grid row of each request's first query.
    first_rows: torch.Tensor
    # Tree verify (`tree.VerifyTree.ancestors`): [bs, w, w], query i sees block key j.
    tree_ancestors: torch.Tensor | None = None
    # A prefill of requests of unequal lengths, attended in groups of similar length
    # (`length_groups`): (packed token indices of the group, its own padded batch) each.
    # Empty when the batch is attended as one grid.
    parts: tuple[tuple[torch.Tensor, PaddedBatch], ...] = ()

    @functools.cached_property
    def token_rows(self) -> torch.Tensor | None:
        """Packed token -> row of the flattened query grid; None when that is the identity."""
        if self.num_tokens == self.batch_size * self.q_rows:
            return None
        return packed_token_rows(self.q_lens, self.first_rows, self.q_rows, self.num_tokens)

    @functools.cached_property
    def causal_mask(self) -> torch.Tensor | None:
        """[bs, 1, q_rows, kv_max] for causal layers; None when position-aligned."""
        if self.position_aligned:
            return None
        mask = attention_mask(self.q_lens, self.kv_lens, self.q_max, self.kv_max, causal=True)
        if self.tree_ancestors is not None:
            return tree_mask(mask, self.tree_ancestors, self.kv_lens)
        return None if bool(mask.all()) else mask

    @functools.cached_property
    def full_mask(self) -> torch.Tensor | None:
        """[bs, 1, 1, kv_max]: every query sees all of its request's keys (ENCODER_ONLY)."""
        mask = attention_mask(self.q_lens, self.kv_lens, self.q_max, self.kv_max, causal=False)
        return None if bool(mask.all()) else mask


def kv_slot_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_max: int,
) -> torch.Tensor:
    """Pool slots of every request's keys as one `[bs, kv_max]` int64 table.

    Columns past a request's length hold stale or zero slots; they are redirected to
    the request's own first key so the gathered padding is real, finite KV (masked
    scores are added to -inf, and NaN + -inf would still be NaN).
    """
    slots = req_to_token[req_pool_indices, :kv_max].long()
    valid = torch.arange(kv_max, device=slots.device) < kv_lens.unsqueeze(1)
    return torch.where(valid, slots, slots[:, :1])


def attention_mask(
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    q_max: int,
    kv_max: int,
    causal: bool,
) -> torch.Tensor:
    """Boolean SDPA mask (True = attend) for queries appended at the end of each request.

    Query j of request i sits at position `kv_lens[i] - q_lens[i] + j`. Causal queries see
    keys up to that position; non-causal ones all `kv_lens[i]` keys (shape
    `[bs, 1, 1, kv_max]`, broadcast over queries). Padded query rows (j >= q_lens[i]) land
    at or past the last key, so they see every key and never produce a NaN row.
    """
    key_pos = torch.arange(kv_max, device=kv_lens.device)
    in_range = key_pos < kv_lens[:, None, None]
    if not causal:
        return in_range.unsqueeze(1)
    query_pos = (kv_lens - q_lens)[:, None, None] + torch.arange(q_max, device=kv_lens.device)[
        None, :, None
    ]
    return (in_range & (key_pos <= query_pos)).unsqueeze(1)


def tree_mask(causal: torch.Tensor, ancestors: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor:
    """The causal mask `[bs, 1, w, kv_max]` of a verify block narrowed to each query's
    ancestors inside the block (the block's w keys end each request's keys)."""
    bs, w, _ = ancestors.shape
    kv_max = causal.shape[-1]
    column = torch.arange(kv_max, device=kv_lens.device) - (kv_lens - w).view(-1, 1)
    in_block = (column >= 0).view(bs, 1, kv_max)
    index = column.clamp(0, w - 1).view(bs, 1, kv_max).expand(bs, w, kv_max)
    allowed = ~in_block | ancestors.gather(2, index)
    return causal & allowed.unsqueeze(1)


def packed_token_rows(
    q_lens: torch.Tensor, first_rows: torch.Tensor, q_rows: int, num_tokens: int
) -> torch.Tensor:
    """Row of the flattened `[bs * q_rows]` query grid each packed token goes to.

    Request i's queries fill rows `first_rows[i]` onward of its own block of `q_rows`.
    """
    request = torch.repeat_interleave(
        torch.arange(q_lens.shape[0], device=q_lens.device), q_lens, output_size=num_tokens
    )
    starts = torch.cumsum(q_lens, 0) - q_lens
    offset = torch.arange(num_tokens, device=q_lens.device) - starts[request]
    return request * q_rows + first_rows[request] + offset


# Query rows up to which a batch of requests takes `grouped_attention` instead of SDPA. Measured
# on a 2-core AVX-512 CPU (bf16, 9 query / 3 KV heads of 64, 16 requests of 100-700 keys): one
# decode layer 4.3 ms in SDPA vs 1.1 ms grouped; 4 / 8 query rows 1.8 / 2.5 vs 1.6 / 2.2 ms.
# A request alone stays in SDPA: timed alone grouped is faster from ~128 keys on
# (`bench/proposers/attention_paths.md`), but in the server it was slower (README, "Dynamo's
# guards and the grouped path's KV layout").
GROUPED_MAX_ROWS = 8
# Query rows up to which the C++ kernel serves a batch (when built): a whole DFlash block. At
# 16 rows (the drafter's block, and a verify of the whole block) it took 0.56-0.71x the time
# of SDPA's path over 1-5 requests of 128-1024 keys, five layers and the metadata timed, bf16,
# 2 threads; at 8 rows and below it replaced the grouped matmuls (README, "Closing the
# engine gap: attention read straight from the pool").
PAGED_MAX_ROWS = 16
# A position-aligned grid (prefill) costs batch size x longest request² while each request
# needs only its own length²: 16 MT-Bench prompts of 42-402 tokens padded to one grid took
# 53% of a prefill forward in attention. Requests are grouped so that a group's grid costs at
# most `RAGGED_SLACK` x its requests' own squares, a request of up to `RAGGED_MIN_KEYS` keys
# counting as that many (one more SDPA call and its gathers cost about what attending a
# request of ~64 keys does, bf16, 9 heads, 2 threads).
RAGGED_SLACK = 1.5
RAGGED_MIN_KEYS = 64


def length_groups(kv_lens: list[int], slack: float = RAGGED_SLACK) -> list[list[int]]:
    """Request indices in groups, longest first, each group's padded grid
    (`len(group) * longest**2`) within `slack` x the sum of its requests' own squares, with
    a request's length counted as at least `RAGGED_MIN_KEYS`."""
    groups: list[list[int]] = []
    longest = squares = 0
    for i in sorted(range(len(kv_lens)), key=lambda i: -kv_lens[i]):
        own = max(kv_lens[i], RAGGED_MIN_KEYS) ** 2
        if groups and (len(groups[-1]) + 1) * longest**2 <= slack * (squares + own):
            groups[-1].append(i)
            squares += own
        else:
            groups.append([i])
            longest, squares = max(kv_lens[i], RAGGED_MIN_KEYS), own
    return groups


def build_padded_batch(
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    grouped_max_rows: int = GROUPED_MAX_ROWS,
    paged: bool = False,
    tree_ancestors: torch.Tensor | None = None,
    ragged: bool = True,
) -> PaddedBatch:
    """Everything the layers share for one forward; maxima are read once here.

    Two query grids: `q_max` rows with an explicit causal mask (cost ~ q_max * kv_max,
    right for decode and verify), or `kv_max` rows placing each query at its own position
    so the kernel's built-in causal skipping applies (cost ~ kv_max**2 / 2, right for
    prefill). The lengths are host tensors on CPU: the `int(...)` reads cost no sync.
    `paged`: the kernel is built and allowed; batches with at most `PAGED_MAX_ROWS` rows
    per request, a request alone included, then take it (not a tree verify: the kernel's
    mask is causal only). `ragged`: a position-aligned batch of unequal lengths is split
    into `parts` (`length_groups`).
    """
    q_lens, kv_lens = q_lens.long(), kv_lens.long()
    batch_size = q_lens.shape[0]
    q_max, kv_max = int(q_lens.max()), int(kv_lens.max())
    position_aligned = 2 * q_max > kv_max and tree_ancestors is None
    q_rows, first_rows = (
        (kv_max, kv_lens - q_lens) if position_aligned else (q_max, torch.zeros_like(q_lens))
    )
    few_rows = not position_aligned and q_rows <= grouped_max_rows
    kernel_rows = not position_aligned and q_rows <= PAGED_MAX_ROWS
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    parts = ()
    if position_aligned and ragged and batch_size > 1:
        groups = length_groups(kv_lens.tolist())
        if len(groups) > 1:
            parts = tuple(
                _part(
                    group,
                    q_lens,
                    q_starts,
                    kv_lens,
                    req_to_token,
                    req_pool_indices,
                    grouped_max_rows,
                )
                for group in groups
            )
    return PaddedBatch(
        batch_size=batch_size,
        q_rows=q_rows,
        q_max=q_max,
        kv_max=kv_max,
        num_tokens=int(q_lens.sum()),
        kv_slots=kv_slot_table(req_to_token, req_pool_indices, kv_lens, kv_max),
        position_aligned=position_aligned,
        grouped=few_rows and batch_size > 1,
        paged=paged and kernel_rows and tree_ancestors is None,
        kv_lens=kv_lens,
        q_lens=q_lens,
        q_starts=q_starts,
        first_rows=first_rows,
        tree_ancestors=tree_ancestors,
        parts=parts,
    )


def _part(
    group: list[int],
    q_lens: torch.Tensor,
    q_starts: torch.Tensor,
    kv_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    grouped_max_rows: int,
) -> tuple[torch.Tensor, PaddedBatch]:
    """One group of a ragged prefill: its requests' packed token indices, in group order,
    and their own padded batch (the same paths allowed, never the kernel's: prefill)."""
    index = torch.tensor(group, device=q_lens.device)
    tokens = torch.cat(
        [torch.arange(int(q_starts[i]), int(q_starts[i] + q_lens[i])) for i in group]
    )
    batch = build_padded_batch(
        q_lens[index],
        kv_lens[index],
        req_to_token,
        req_pool_indices[index],
        grouped_max_rows,
        ragged=False,
    )
    return tokens.to(q_lens.device), batch


def batch_lengths(forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request (query count, key count including the queries) for a forward mode.

    TARGET_VERIFY batches carry no extend_* fields: `seq_lens` is the committed prefix and
    each request appends `spec_info.draft_token_num` tokens after it. `seq_lens_cpu` is
    not used: DFlash workers widen it to prefix + block in verify, plain prefix elsewhere.
    """
    mode = forward_batch.forward_mode
    seq_lens = forward_batch.seq_lens
    if mode.is_decode():
        return torch.ones_like(seq_lens), seq_lens
    if mode.is_target_verify():
        spec_info = forward_batch.spec_info
        if getattr(spec_info, "custom_mask", None) is not None:
            raise NotImplementedError(
                f"{CPU_ATTENTION_BACKEND}: tree verify (spec_info.custom_mask)"
            )
        if getattr(spec_info, "ragged_verify_layout", None) is not None:
            raise NotImplementedError(f"{CPU_ATTENTION_BACKEND}: ragged verify layouts")
        width = spec_info.draft_token_num
        return torch.full_like(seq_lens, width), seq_lens + width
    if forward_batch.extend_seq_lens is None:
        raise NotImplementedError(f"{CPU_ATTENTION_BACKEND}: forward mode {mode.name}")
    return forward_batch.extend_seq_lens, seq_lens


def layer_unsupported(layer: RadixAttention) -> list[str]:
    """What of `layer` itself this backend does not compute (the same for every call)."""
    unsupported = []
    if layer.is_cross_attention:
        unsupported.append("cross-attention")
    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        unsupported.append("sliding-window attention")
    if layer.logit_cap > 0 and layer.logit_capping_method != "tanh":
        unsupported.append(f"logit capping method {layer.logit_capping_method!r}")
    return unsupported


def check_layer_supported(layer: RadixAttention, forward_batch: ForwardBatch, extra: dict) -> None:
    """Refuse features our models never use instead of computing them wrong."""
    unsupported = [name for name, value in extra.items() if value is not None]
    if forward_batch.encoder_lens is not None:
        unsupported.append("encoder-decoder models")
    unsupported += layer_unsupported(layer)
    if unsupported:
        raise NotImplementedError(
            f"{CPU_ATTENTION_BACKEND} does not support: {', '.join(unsupported)}"
        )


def soft_capped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    cap: float,
) -> torch.Tensor:
    """SDPA with `cap * tanh(score / cap)` logits, which SDPA itself cannot apply."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    scores = cap * torch.tanh(scores / cap)
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(value.dtype), value)


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention for few query rows as two batched matmuls, one per KV head group.

    `query` `[bs, heads, rows, dim]`, `key`/`value` `[bs, kv_heads, keys, dim]`, `mask`
    `[bs, 1, rows | 1, keys]` or None. The query heads sharing a KV head are stacked as
    rows of one matmul (heads are KV-head-major, as in GQA), so K and V are read once per
    group instead of once per head. Scores come out of the matmul in the input dtype
    (fp32 accumulation inside), softmax runs in fp32: as SDPA's CPU kernel, except that
    bf16 scores are rounded once more before the softmax.
    """
    bs, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    stacked = query.reshape(bs, kv_heads, heads // kv_heads * rows, dim)
    scores = torch.matmul(stacked, key.transpose(-1, -2)).float().mul_(scale)
    scores = scores.view(bs, kv_heads, heads // kv_heads, rows, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = scores.softmax(-1).to(value.dtype).view(bs, kv_heads, heads // kv_heads * rows, -1)
    return torch.matmul(probs, value).view(bs, heads, rows, value.shape[-1])


def kernel_fits(layer: RadixAttention, dtype: torch.dtype, pool_dtype: torch.dtype) -> bool:
    """What `cpu_attention.paged_attention` computes: plain softmax, its dims and dtypes."""
    return (
        layer.logit_cap <= 0
        and layer.qk_head_dim in (64, 128)
        and layer.v_head_dim == layer.qk_head_dim
        and dtype in (torch.bfloat16, torch.float32)
        and pool_dtype == dtype
    )


def plain_pool(pool) -> bool:
    """A pool whose `set_kv_buffer` is exactly `k_buffer[loc] = k` (SGLang's own MHA pool,
    unquantized, row layout, locs physical by allocation), so `store_kv` may write it."""
    return (
        type(pool) is MHATokenToKVPool
        and not pool.is_quantized_kv_cache
        and pool.store_dtype == pool.dtype
        and not getattr(pool, "use_hnd", False)
        and getattr(pool, "kv_cache_layout", None) != "vectorized_5d"
        and not pool.requires_physical_write_loc
    )


class DFlashCPUAttnBackend(AttentionBackend):
    """Batched attention over SGLang's paged KV pool, for CPU serving."""

    def __init__(self, model_runner: ModelRunner):
        super().__init__()
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.forward_metadata: PaddedBatch | None = None
        # The launcher's `--dflash-cpu-attention`: `paged` (the kernel, else grouped),
        # `grouped`, or `sdpa` (never the kernel nor the grouped matmuls).
        mode = os.environ.get(ATTENTION_ENV, "paged")
        self.grouped_max_rows = 0 if mode == "sdpa" else GROUPED_MAX_ROWS
        self.paged = mode == "paged" and cpu_attention.available()
        self._check_pool_supported()
        self.direct_kv_write = self.paged and plain_pool(self.token_to_kv_pool)
        self._kernel_layers: dict[int, bool] = {}  # layer id -> `_kernel_serves`

    def _check_pool_supported(self) -> None:
        pool = self.token_to_kv_pool
        if isinstance(pool, SWAKVPool):
            raise NotImplementedError(f"{CPU_ATTENTION_BACKEND}: sliding-window KV pools")
        if getattr(pool, "use_hnd", False):
            raise NotImplementedError(f"{CPU_ATTENTION_BACKEND}: HND KV cache layout")
        if pool.dtype.itemsize == 1:
            raise NotImplementedError(f"{CPU_ATTENTION_BACKEND}: {pool.dtype} KV cache")

    def init_forward_metadata_out_graph(
        self, forward_batch: ForwardBatch, in_capture: bool = False
    ) -> None:
        """Build the padded batch once; all layers of this forward reuse it.

        The base `init_forward_metadata` calls this, as do the graph runners' eager paths.
        """
        if forward_batch.forward_mode.is_idle() or forward_batch.batch_size == 0:
            self.forward_metadata = None
            return
        q_lens, kv_lens = batch_lengths(forward_batch)
        tree = getattr(forward_batch.spec_info, "tree", None)
        self.forward_metadata = build_padded_batch(
            q_lens,
            kv_lens,
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            self.grouped_max_rows,
            self.paged,
            None if tree is None else tree.ancestors(),
        )

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def support_triton(self) -> bool:
        return False

    def forward_paged(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor | None:
        """One layer of a kernel batch (decode, a verify, the drafter's block), written and
        attended as `_forward` does, without SGLang's per-layer dispatch on the way to it
        (`RadixAttention.forward`, `forward`, `forward_decode`, the layer checks): ~45 µs of
        Python a layer, as long as the kernel itself at four requests, ~1 ms a target forward.
        Those steps do nothing here: no graph scope on a CPU, no padded extend rows in these
        modes, and the layer checks are the same for every call of a layer. None where
        `_forward` would not take the kernel (the caller then goes through SGLang)."""
        batch = self.forward_metadata
        if (
            batch is None
            or not batch.paged
            or forward_batch.encoder_lens is not None
            or not self._kernel_serves(layer, q.dtype)
        ):
            return None
        k = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
        v = v.view(-1, layer.tp_v_head_num, layer.v_head_dim)
        self._write_kv(layer, forward_batch, k, v)
        return self._paged_attention(q, layer, batch)

    def _kernel_serves(self, layer: RadixAttention, dtype: torch.dtype) -> bool:
        """`layer_unsupported` and `kernel_fits` for the pool's dtype, once a layer."""
        pool_dtype = self.token_to_kv_pool.dtype
        serves = self._kernel_layers.get(layer.layer_id)
        if serves is None:
            serves = not layer_unsupported(layer) and kernel_fits(layer, pool_dtype, pool_dtype)
            self._kernel_layers[layer.layer_id] = serves
        return serves and dtype == pool_dtype

    def _paged_attention(
        self, q: torch.Tensor, layer: RadixAttention, batch: PaddedBatch
    ) -> torch.Tensor:
        heads, head_dim = layer.tp_q_head_num, layer.qk_head_dim
        out = cpu_attention.paged_attention(
            q.reshape(-1, heads, head_dim).contiguous(),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            batch.kv_slots,
            batch.kv_lens,
            batch.q_lens,
            batch.q_starts,
            causal=layer.attn_type != AttentionType.ENCODER_ONLY,
            scale=layer.scaling,
        )
        return out.view(-1, heads * layer.v_head_dim)

    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
        extra: dict,
    ) -> torch.Tensor:
        check_layer_supported(layer, forward_batch, extra)
        heads, v_head_dim = layer.tp_q_head_num, layer.v_head_dim
        if q.shape[0] == 0:
            return q.new_empty((0, heads * v_head_dim))
        # As in SGLang's backends: k is None when another layer already wrote this KV.
        if save_kv_cache and k is not None and v is not None:
            self._write_kv(layer, forward_batch, k, v)
        batch = self.forward_metadata
        if batch is None:
            raise RuntimeError(f"{CPU_ATTENTION_BACKEND}: init_forward_metadata was not called")
        if batch.paged and self._kernel_serves(layer, q.dtype):
            return self._paged_attention(q, layer, batch)
        if not batch.parts:
            return self._padded_attention(q, layer, batch)
        out = q.new_empty(q.shape[0], heads * v_head_dim)
        for tokens, part in batch.parts:
            part_out = self._padded_attention(q.index_select(0, tokens), layer, part)
            out.index_copy_(0, tokens, part_out)
        return out

    def _padded_attention(
        self, q: torch.Tensor, layer: RadixAttention, batch: PaddedBatch
    ) -> torch.Tensor:
        """Packed queries `[tokens, heads * dim]` attended on the batch's padded grid."""
        heads, head_dim, v_head_dim = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        query = self._padded_queries(q.reshape(-1, heads, head_dim), batch)
        key = self._gathered(self.token_to_kv_pool.get_key_buffer(layer.layer_id), batch, q.dtype)
        value = self._gathered(
            self.token_to_kv_pool.get_value_buffer(layer.layer_id), batch, q.dtype
        )
        out = self._attend(query, key, value, layer, batch)
        out = out.transpose(1, 2).reshape(batch.batch_size * batch.q_rows, heads * v_head_dim)
        return out if batch.token_rows is None else out.index_select(0, batch.token_rows)

    def _write_kv(
        self, layer: RadixAttention, forward_batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """The new tokens' K/V into the pool: one C++ call on a plain pool, else SGLang's
        `set_kv_buffer` (casts, quantized and unified pools, its checks)."""
        pool = self.token_to_kv_pool
        if self.direct_kv_write and k.dtype == pool.dtype and v.dtype == pool.dtype:
            cpu_attention.store_kv(
                k.view(k.shape[0], layer.tp_k_head_num, layer.qk_head_dim),
                v.view(v.shape[0], layer.tp_v_head_num, layer.v_head_dim),
                pool.get_key_buffer(layer.layer_id),
                pool.get_value_buffer(layer.layer_id),
                forward_batch.out_cache_loc,
            )
            return
        pool.set_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch), k, v)

    @staticmethod
    def _attend(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: RadixAttention,
        batch: PaddedBatch,
    ) -> torch.Tensor:
        """One attention call for the whole padded batch: `[bs, heads, q_rows, v_dim]`."""
        causal = layer.attn_type != AttentionType.ENCODER_ONLY
        mask = batch.causal_mask if causal else batch.full_mask
        is_causal = causal and batch.position_aligned
        if layer.logit_cap > 0:
            return soft_capped_attention(
                query, key, value, mask, is_causal, layer.scaling, layer.logit_cap
            )
        if batch.grouped:
            return grouped_attention(query, key, value, mask, layer.scaling)
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            is_causal=is_causal,
            scale=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        )

    @staticmethod
    def _padded_queries(q: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
        """Packed `[tokens, heads, dim]` queries as `[bs, heads, q_rows, dim]`."""
        if batch.token_rows is not None:
            grid = q.new_zeros((batch.batch_size * batch.q_rows, *q.shape[1:]))
            q = grid.index_copy_(0, batch.token_rows, q)
        return q.view(batch.batch_size, batch.q_rows, *q.shape[1:]).transpose(1, 2)

    @staticmethod
    def _gathered(buffer: torch.Tensor, batch: PaddedBatch, dtype: torch.dtype) -> torch.Tensor:
        """One layer's keys or values for the whole batch as `[bs, kv_heads, kv_max, dim]`,
        contiguous for the grouped matmuls: on the gathered rows' transposed view they run
        1.1-2.6x slower than on a copy, the copy included (16 requests x 512 keys at one
        row: 0.61 vs 0.24 ms per layer, `bench/proposers/attention_paths.md`); SDPA takes
        either at the same speed. One copy at most, with the cast if there is one."""
        rows = buffer.index_select(0, batch.kv_slots.view(-1))
        rows = rows.view(batch.batch_size, batch.kv_max, *buffer.shape[1:]).transpose(1, 2)
        layout = torch.contiguous_format if batch.grouped else torch.preserve_format
        return rows.to(dtype, memory_format=layout)
