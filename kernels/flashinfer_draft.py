"""SGLang attention backend `dflash_flashinfer`: upstream's FlashInfer backend with the
DFlash draft block split into a ragged and a paged pass (`draft_attention`).

Chosen with `--speculative-draft-attention-backend dflash_flashinfer` (opt-in until it has
run on a GPU). The draft block forward (TARGET_VERIFY on the draft runner) takes the split
path, eager and under CUDA graphs (one wrapper pair per captured batch size, planned
outside the graph before every replay, as upstream's wrappers are). Everything else, and
configurations the split does not cover (sliding-window or cross-attention wrappers,
translated KV reads), runs upstream's code unchanged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
from sglang.srt.layers.radix_attention import AttentionType

from dflash_sglang.kernels.draft_attention import DraftLayout, draft_layout, merge_states

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

# FlashInfer's kernel family for the paged context pass. "auto" is fa3 on Hopper, fa2
# elsewhere; "trtllm-gen" is FlashInfer's SM100 family (non-causal paged supported), to be
# measured against it on the first B200 (`bench/bench_kernels_gpu.py`). The ragged block
# pass always asks "auto", which picks cuDNN or CUTLASS on SM100 by itself.
PAGED_BACKEND_ENV = "DFLASH_DRAFT_PAGED_BACKEND"


@dataclass(frozen=True)
class Heads:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype  # the draft cache's (may be fp8); the block's own K/V are q_dtype


@dataclass(frozen=True)
class Wrappers:
    block: Any  # BatchPrefillWithRaggedKVCacheWrapper or its torch twin
    context: Any  # BatchPrefillWithPagedKVCacheWrapper or its torch twin


class SplitDraftAttention:
    """Plans a step's two passes and runs one layer: apart from SGLang's backend class, so
    a CPU test drives it with the torch twins of the wrappers and of `merge_state`."""

    def __init__(self, heads: Heads, merge: Callable = merge_states) -> None:
        self.heads = heads
        self.merge = merge

    def plan(self, wrappers: Wrappers, layout: DraftLayout) -> Wrappers:
        h = self.heads
        wrappers.block.plan(
            layout.qo_indptr, layout.qo_indptr, h.num_qo_heads, h.num_kv_heads, h.head_dim,
            causal=False, q_data_type=h.q_dtype, kv_data_type=h.q_dtype,
        )  # fmt: skip
        wrappers.context.plan(
            layout.qo_indptr, layout.context_indptr, layout.context_indices,
            layout.last_page_len, h.num_qo_heads, h.num_kv_heads, h.head_dim, 1,
            causal=False, q_data_type=h.q_dtype, kv_data_type=h.kv_dtype, non_blocking=True,
        )  # fmt: skip
        return wrappers

    def run(
        self,
        wrappers: Wrappers,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """One draft layer; writes nothing to the draft cache."""
        heads, dim, v_dim = layer.tp_q_head_num, layer.head_dim, layer.v_head_dim
        q = q.contiguous().view(-1, heads, dim)
        o_block, s_block = wrappers.block.forward_return_lse(
            q,
            k.view(-1, layer.tp_k_head_num, dim),
            v.view(-1, layer.tp_v_head_num, v_dim),
            causal=False,
            sm_scale=layer.scaling,
            logits_soft_cap=layer.logit_cap,
        )
        o_context, s_context = wrappers.context.forward_return_lse(
            q,
            kv_cache,
            causal=False,
            sm_scale=layer.scaling,
            logits_soft_cap=layer.logit_cap,
            k_scale=layer.k_scale_float,
            v_scale=layer.v_scale_float,
        )
        o, _ = self.merge(o_block, s_block, o_context, s_context)
        return o.reshape(-1, heads * v_dim)


def make_wrappers(
    workspace: torch.Tensor, graph_bs: int | None = None, indices: torch.Tensor | None = None
) -> Wrappers:
    """FlashInfer's two wrappers; for a CUDA graph, over fixed buffers for `graph_bs`
    requests (`indices` shared by every batch size: graphs replay one at a time)."""
    from flashinfer import (
        BatchPrefillWithPagedKVCacheWrapper,
        BatchPrefillWithRaggedKVCacheWrapper,
    )

    paged_backend = os.environ.get(PAGED_BACKEND_ENV, "auto")
    if graph_bs is None:
        return Wrappers(
            BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="auto"),
            BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=paged_backend),
        )

    def indptr() -> torch.Tensor:
        return torch.zeros(graph_bs + 1, dtype=torch.int32, device=workspace.device)

    return Wrappers(
        BatchPrefillWithRaggedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=indptr(),
            kv_indptr_buf=indptr(), backend="auto",
        ),
        BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=indptr(),
            paged_kv_indptr_buf=indptr(), paged_kv_indices_buf=indices,
            paged_kv_last_page_len_buf=torch.zeros(
                graph_bs, dtype=torch.int32, device=workspace.device
            ),
            backend=paged_backend,
        ),
    )  # fmt: skip


class DraftFlashInferBackend(FlashInferAttnBackend):
    def __init__(self, model_runner, *args, **kwargs) -> None:
        super().__init__(model_runner, *args, **kwargs)
        self._req_to_token = model_runner.req_to_token_pool.req_to_token
        self._context_len = int(model_runner.model_config.context_len)
        self._split = self._make_split()
        self._eager: Wrappers | None = None
        self._graph: dict[int, Wrappers] = {}
        self._graph_indices: torch.Tensor | None = None
        self._step: Wrappers | None = None  # planned for this forward; None: upstream's

    def _make_split(self) -> SplitDraftAttention | None:
        translated = getattr(self.kv_index_translator, "reads_are_translated", False)
        if self.dispatch_reason is not None or translated:
            logger.warning(
                "dflash_flashinfer: %s; the draft runs upstream's FlashInfer path",
                "translated KV reads" if translated else self.dispatch_reason,
            )
            return None
        from flashinfer import merge_state

        updater = self.indices_updater_prefill
        heads = Heads(
            updater.num_qo_heads,
            updater.num_kv_heads,
            updater.head_dim,
            updater.q_data_type,
            updater.data_type,
        )
        return SplitDraftAttention(heads, merge=merge_state)

    def _covers(self, forward_batch: ForwardBatch) -> bool:
        return self._split is not None and forward_batch.forward_mode.is_target_verify()

    def _plan(self, forward_batch: ForwardBatch, wrappers: Wrappers) -> Wrappers:
        if forward_batch.seq_lens_cpu is None:
            raise RuntimeError("dflash_flashinfer plans the draft block from seq_lens_cpu")
        bs = forward_batch.batch_size
        layout = draft_layout(
            self._req_to_token,
            forward_batch.req_pool_indices[:bs],
            forward_batch.seq_lens_cpu[:bs],
            forward_batch.positions.numel() // bs,
        )
        return self._split.plan(wrappers, layout)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if not self._covers(forward_batch):
            self._step = None
            return super().init_forward_metadata(forward_batch)
        if self._eager is None:
            self._eager = make_wrappers(self.workspace_buffer)
        self._step = self._plan(forward_batch, self._eager)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        self._graph_indices = torch.zeros(
            max_bs * self._context_len, dtype=torch.int32, device=self.workspace_buffer.device
        )

    def init_forward_metadata_out_graph(
        self, forward_batch: ForwardBatch, in_capture: bool = False
    ) -> None:
        if not self._covers(forward_batch):
            self._step = None
            return super().init_forward_metadata_out_graph(forward_batch, in_capture)
        bs = forward_batch.batch_size
        if in_capture:
            self._graph[bs] = make_wrappers(self.workspace_buffer, bs, self._graph_indices)
        self._step = self._plan(forward_batch, self._graph[bs])

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if self._step is None:
            return super().forward_extend(
                q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs
            )
        if layer.attn_type != AttentionType.ENCODER_ONLY:
            raise RuntimeError(
                "dflash_flashinfer serves DFlash draft layers (non-causal); layer "
                f"{layer.layer_id} is {layer.attn_type}"
            )
        kv_cache = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        return self._split.run(self._step, q, k, v, layer, kv_cache)
