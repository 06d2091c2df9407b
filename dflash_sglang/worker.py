"""The DFLASH_X worker: one speculative step = draft a block, verify it, accept, inject KV.

Built on upstream `DFlashWorkerV2` (model loading, draft runner, memory pools, CUDA graphs,
prefill-time KV injection stay upstream's); the decode step is ours, split into the seams
later work extends: block building, drafting, verification width, acceptance, KV injection.
Plain DFlash drafts only: selector, Domino and LiLiCorr variants are rejected at start.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.srt.layers.dp_attention import get_dp_tp_group
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.mem_cache.kv_index_translator import KVLocPlan
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    enable_num_token_non_padded,
)
from sglang.srt.runtime_context import get_exec, get_parallel
from sglang.srt.speculative.base_spec_worker import HiCacheDraftMode
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments
from sglang.srt.speculative.dflash_worker_v2 import (
    DFlashWorkerV2,
    _resolve_dflash_embedding_module,
)
from sglang.srt.speculative.draft_worker_common import make_draft_input_v2
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite
from sglang.srt.speculative.spec_utils import (
    GrammarTree,
    build_grammar_vocab_mask,
    draft_tp_context,
)

from dflash_sglang import (
    acceptance,
    draft_vocab,
    kv_injection,
    platform,
    suffix_corpus,
    verify_graphs,
)
from dflash_sglang.adaptive import DEFAULT_CPU_PRIOR, CostModel
from dflash_sglang.block import assemble_candidates, build_draft_block
from dflash_sglang.held_rows import HeldRows, Rows
from dflash_sglang.metrics import PrometheusMetrics
from dflash_sglang.options import SpecOptions
from dflash_sglang.proposals import Planner, StepPlan
from dflash_sglang.suffix import SharedSuffixIndex, SuffixIndex, SuffixProposal
from dflash_sglang.tree import TreeAcceptance, VerifyTree, build_tree, permute_rows
from dflash_sglang.tree import accept as walk_tree
from dflash_sglang.tree import custom_mask as tree_custom_mask

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockSlots:
    """Where `width` tokens past each request's prefix go: absolute positions `[bs*w]`,
    target KV slots `[bs*w]` and the target/draft KV-location plan."""

    positions: torch.Tensor
    cache_loc: torch.Tensor
    kv_loc_plan: KVLocPlan
    width: int
    # After a tree walk: per request, the verify rows in chain order (`tree.accept`); the
    # KV-location plan keeps the verify's own row order.
    order: torch.Tensor | None = None


@dataclass
class TreeVerifyInput(DFlashVerifyInput):
    """A verify whose rows form `tree.VerifyTree`s: our CPU attention backend reads `tree`
    (its ancestors, `[bs, w, w]`); on GPU FlashInfer reads the same tree as SGLang's flat
    `custom_mask` (`tree.custom_mask`), which is dense over every prefix column."""

    tree: VerifyTree | None = None


@dataclass(frozen=True)
class StepRecord:
    """What one decode step did; handed to `DFlashXWorker.step_observers` (metrics)."""

    plan: StepPlan  # width, draft on/off, source per request, predicted seconds
    accept_lens: torch.Tensor  # [bs] accepted drafts per request (bonus excluded)
    draft_seconds: float  # proposing: drafter pass (if any) and suffix rows
    verify_seconds: float


class DFlashXWorker(DFlashWorkerV2):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker) -> None:
        # Read before upstream init, which may fold a full-vocabulary head into a CUDA graph.
        self._draft_head: torch.Tensor | None = None  # its lm_head rows, on first use
        self._draft_vocab = draft_vocab.load_ids(server_args.speculative_draft_model_path)
        if self._draft_vocab is not None and get_parallel().tp_size > 1:
            logger.warning("draft vocabulary ignored under TP > 1 (the lm_head is sharded)")
            self._draft_vocab = None
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        if self.selector is not None or self.lilicorr is not None or self._is_domino:
            raise ValueError(
                "DFLASH_X serves plain DFlash drafts; this checkpoint has a selector, "
                "LiLiCorr or Domino head (use --speculative-algorithm DFLASH for those)"
            )
        if self._need_mamba_verify_commit:
            raise ValueError("DFLASH_X does not support hybrid (Mamba/linear-attention) targets")
        self.platform = platform.of_process()
        self.platform.prepare_draft_model(self.draft_model, self.draft_parallel_layout)
        platform.keep_embeds_in_model_dtype(self.draft_model)
        self._generator: torch.Generator | None = None
        self.options = SpecOptions.from_env(os.environ)
        self.planner = Planner(
            int(self.block_size),
            self.options.candidate_widths(int(self.block_size)),
            CostModel(DEFAULT_CPU_PRIOR),
            max_match=self.options.suffix_max_match,
            explore_every=self.options.explore_every,
            explore_budget=self.options.explore_budget,
            prefer_suffix=self.options.suffix_always,
            tree=self.options.tree if self._trees_run(target_worker) else "off",
        )
        # Per-request state dies with the request objects.
        self._suffix_indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._shared: SharedSuffixIndex | None = None
        if self.options.shared_tokens and self._looks_up:
            self._shared = SharedSuffixIndex(
                self.options.shared_tokens,
                self.options.suffix_max_match,
                self.options.max_proposal(self.block_size),
            )
            if self.options.suffix_warm:
                self._warm_shared(server_args)
        self._previous_reqs: list = []  # the last decode batch's requests (shared lookup)
        self._radix_counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._prompt_extras: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Plans awaiting accepted counts, with a tree step's per-branch counts.
        self._pending_plans: deque[tuple[StepPlan, TreeAcceptance | None]] = deque(maxlen=4)
        self._held: HeldRows | None = None
        if self.platform.defer_injection and self.options.defer_rows:
            self._held = HeldRows(self.options.defer_rows)
        self._ours = self.platform.triton_kernels and self.options.kernels == "ours"
        self._verify_graphs = self.platform.verify_graphs(
            self.target_worker.model_runner, self.planner.widths, int(self.block_size)
        )
        # The last decode step: plan, batch size, start time, draft-forward timer (or None).
        self._last_step: tuple[StepPlan, int, float, object | None] | None = None
        self.step_observers: list[Callable[[StepRecord], None]] = []
        self.metrics: PrometheusMetrics | None = None
        # One exporter per DP group, as SGLang's own scheduler metrics: counters from every
        # TP rank would be summed across processes and multiply by the TP size.
        if server_args.enable_metrics and get_parallel().attn_tp_rank == 0:
            self.metrics = PrometheusMetrics(max_verify_width=int(self.block_size))
            self.step_observers.append(self._export_step)
            self.metrics.set_shared_tokens(len(self._shared) if self._shared is not None else 0)
        logger.info(
            "DFLASH_X worker ready: block_size=%d mask_token_id=%d draft=%s %s",
            self.block_size,
            self._mask_token_id,
            type(self.draft_model).__name__,
            self.options,
        )

    # ---- the step -------------------------------------------------------------------------

    def forward_batch_generation(
        self,
        batch: ScheduleBatch,
        on_publish=None,
        grammar_barrier=None,
        pp_proxy_tensors=None,
    ) -> GenerationBatchResult:
        mode = batch.forward_mode
        if mode.is_extend() or batch.is_extend_in_batch or mode.is_idle():
            self._before_prefill(batch)
            # Prefill (target forward + KV injection of prompt features) is upstream's.
            result = super().forward_batch_generation(
                batch, on_publish, grammar_barrier, pp_proxy_tensors
            )
            self._last_step = None  # a prefill's time is not a decode step's
            if self.metrics is not None:
                self.metrics.observe_prefill(radix_hit_tokens(batch.reqs, self._radix_counted))
        else:
            result = self.decode_step(batch, on_publish, grammar_barrier)
        if self.metrics is not None:
            allocator = self.model_runner.token_to_kv_pool_allocator
            self.metrics.set_draft_kv_rows(allocator.size - allocator.available_size())
            if self._held is not None:
                self.metrics.set_held_rows(len(self._held), self._held.dropped)
        return result

    def decode_step(self, batch: ScheduleBatch, on_publish, grammar_barrier):
        draft_input: DFlashDraftInputV2 = batch.spec_info
        self.platform.adopt_tensor(batch.seq_lens)  # carried over from the last iteration
        prefix_lens = batch.seq_lens
        host_lens = self._host_prefix_lens(batch, draft_input)
        start = self._observe_step_start()
        if self._held is not None:
            self._held.retire(batch.reqs)
        plan = self.plan_step(batch, host_lens)

        # 1) Propose; 2) verify the first `width` tokens in one target forward (a chain, or
        # a tree of DFlash and suffix branches); 3) accept the longest matching prefix plus
        # the target's bonus token.
        t0 = time.perf_counter()
        timer = self.platform.start_timer() if plan.run_draft else None
        candidates = self.propose(batch, draft_input, plan, prefix_lens, host_lens)
        if timer is not None:
            timer.stop()
        t1 = time.perf_counter()
        self._last_step = (plan, len(host_lens), start, timer)
        rows = self._tree_of(plan, candidates)
        slots = self._block_slots(batch, prefix_lens, host_lens, plan.width, rows)
        logits_output, target_predict, can_run_cuda_graph = self.verify(
            batch, candidates, slots, host_lens + plan.width, grammar_barrier, rows
        )
        walked = None
        if rows is None:
            logits = logits_output.next_token_logits
            accepted = self.accept(candidates, logits, batch, draft_input, target_predict)
        else:
            accepted, walked, slots = self._accept_tree(
                rows, logits_output, batch, slots, target_predict
            )
        t2 = time.perf_counter()
        next_token_ids = accepted.out_tokens.reshape(-1)
        if batch.return_logprob:
            compute_spec_logprobs(batch, logits_output, next_token_ids, chain_stride=plan.width)
        new_seq_lens = prefix_lens + accepted.commit_lens.to(prefix_lens.dtype)
        if on_publish is not None:
            on_publish(new_seq_lens)

        # 4) Inject the committed tokens' target features into the draft KV cache, whichever
        # source proposed them, so the drafter can resume at any step.
        self._inject_committed(logits_output, slots, accepted.commit_lens, batch.reqs)
        self._pending_plans.append((plan, walked))
        record = StepRecord(plan, accepted.accept_lens, t1 - t0, t2 - t1)
        for observe in self.step_observers:
            observe(record)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=next_token_ids,
            accept_lens=accepted.commit_lens,
            can_run_cuda_graph=can_run_cuda_graph,
            next_draft_input=make_draft_input_v2(
                bonus_tokens=accepted.bonus, new_seq_lens=new_seq_lens
            ),
            speculative_num_draft_tokens=plan.width,
            new_seq_lens=new_seq_lens,
        )

    def propose(self, batch, draft_input, plan: StepPlan, prefix_lens, host_lens) -> torch.Tensor:
        """`[bs, width]` = anchor + proposal per request: the DFlash block (drafted at full
        width, its graphs unchanged) when any request takes it; suffix proposals replace
        the rows of requests that take them."""
        if plan.run_draft:
            if self._held is not None:  # the drafter reads its batch's committed draft KV
                self._write_rows(self._held.take_running())
            drafts = self.draft_block(batch, draft_input, prefix_lens, host_lens)
        else:
            drafts = draft_input.bonus_tokens.view(-1, 1).to(torch.int64)
        chains = [None if plan.is_tree(r) else p for r, p in enumerate(plan.suffix)]
        return assemble_candidates(drafts, chains, plan.width, int(self._mask_token_id))

    @staticmethod
    def _tree_of(plan: StepPlan, candidates: torch.Tensor) -> VerifyTree | None:
        """A tree step's rows: tree requests' suffix branches beside their DFlash chains."""
        if not plan.trees:
            return None
        taken = [p if plan.is_tree(r) else None for r, p in enumerate(plan.suffix)]
        return build_tree(candidates, taken, plan.width, plan.tree_dflash)

    # ---- seams ----------------------------------------------------------------------------

    def plan_step(self, batch: ScheduleBatch, host_lens: torch.Tensor) -> StepPlan:
        """Source per request, verify width and draft on/off (`proposals.Planner`).

        Every TP rank sees the same requests and counts but times its own steps, so its
        planner may choose differently: under TP > 1 rank 0's choice is broadcast.
        """
        plan = self.planner.plan(self._suffix_proposals(batch, host_lens))
        if plan.trees and batch.has_grammar:  # grammar masks follow chains only
            plan = replace(plan, tree_dflash=0, trees=())
        group = get_dp_tp_group()
        if group.world_size == 1:
            return plan
        return plan.with_choice(group.broadcast_object(plan.choice(), src=0))

    def _suffix_proposals(self, batch, host_lens) -> list[tuple[SuffixProposal, ...]]:
        """Each request's index catches up with its committed text, then looks itself up,
        and up in the shared index: the planner takes the proposal it expects more from.

        The text must end at the pending bonus token (the block's anchor, the one committed
        token without KV yet): with overlap scheduling `output_ids` trails by a step, and
        such a request gets no proposal. Checked on host lengths, so no device sync.
        """
        if not self._looks_up:
            return [()] * len(batch.reqs)
        if self._shared is not None:
            self._share_finished(batch.reqs)
        out = []
        for req, kv_len in zip(batch.reqs, host_lens.tolist(), strict=True):
            index = self._suffix_indexes.get(req)
            if index is None:
                index = self._suffix_indexes[req] = SuffixIndex(
                    self.options.suffix_max_match, self.options.max_proposal(self.block_size)
                )
            prompt = req.origin_input_ids
            done = len(index)
            if done < len(prompt):
                index.extend(prompt[done:])
            index.extend(req.output_ids[len(index) - len(prompt) :])
            if len(index) != kv_len + 1:  # not at the anchor
                out.append(())
                continue
            found = [index.propose()]
            if self._shared is not None:
                found.append(self._shared.propose(index.tail(index.max_match)))
            out.append(tuple(p for p in found if p is not None))
        return out

    @property
    def _looks_up(self) -> bool:
        """Suffix lookup is on and some width could verify a proposal (not at
        `--dflash-widths 1`, where building and warming the shared index would be waste)."""
        return self.options.suffix and self.planner.widths[-1] > 1

    def _warm_shared(self, server_args) -> None:
        """The shared index starts from a corpus of past requests (`--dflash-suffix-warm`);
        every TP rank reads the same file, so every rank's index is the same."""
        start = time.perf_counter()
        docs = suffix_corpus.load(
            self.options.suffix_warm,
            server_args.tokenizer_path or server_args.model_path,
            server_args.trust_remote_code,
        )
        added = self._shared.warm(docs)
        logger.info(
            "DFLASH_X shared suffix lookup warmed from %s: the last %d of %d requests, "
            "%d tokens, in %.1f s",
            self.options.suffix_warm,
            added,
            len(docs),
            len(self._shared),
            time.perf_counter() - start,
        )

    def _share_finished(self, reqs) -> None:
        """Outputs of requests that left the batch finished join the shared index, in batch
        order: every TP rank sees the same batches, so every rank's index is the same."""
        present = {id(req) for req in reqs}
        added = False
        for req in self._previous_reqs:
            if id(req) not in present and req.finished():
                self._shared.add(req.origin_input_ids, req.output_ids)
                added = True
        self._previous_reqs = list(reqs)
        if added and self.metrics is not None:
            self.metrics.set_shared_tokens(len(self._shared))

    def _observe_step_start(self) -> float:
        """Step cost for the planner: from one decode step's start to the next, scheduler
        overhead included (that is what a wider step is traded against). A prefill in
        between breaks the chain (`forward_batch_generation` clears `_last_step`). The draft
        forward is timed on its own, so the cost model prices the drafter from its own
        measurement; a device timer not read out yet skips the step."""
        now = time.perf_counter()
        if self._last_step is not None:
            plan, bs, start, timer = self._last_step
            draft_seconds = timer.seconds() if timer is not None else 0.0
            if draft_seconds is not None:
                self.planner.observe_seconds(plan, bs, now - start, draft_seconds)
            if self.metrics is not None:
                self.metrics.observe_step_seconds(plan, now - start)
        return now

    def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int], batch_size: int = 0):
        """Accepted counts reach the host after the step: feed the planner (one step late)."""
        if self._pending_plans:
            plan, walked = self._pending_plans.popleft()
            if len(plan.suffix) == len(num_correct_drafts_per_req):
                branches = walked.branches() if walked is not None else None
                self.planner.observe(plan, num_correct_drafts_per_req, branches)

    def _block_slots(
        self, batch, prefix_lens, host_lens, width: int, rows: VerifyTree | None = None
    ) -> BlockSlots:
        """Positions, KV slots and the KV-location plan of `width` tokens past each prefix
        (a tree's rows sit at their depths)."""
        bs = prefix_lens.numel()
        cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=self.model_runner.req_to_token_pool.req_to_token,
            start_offset=prefix_lens,
            end_offset=prefix_lens + width,
            batch_size=bs,
            draft_token_num=width,
            device=self.device,
        )
        offsets = torch.arange(width, dtype=torch.int64, device=prefix_lens.device)
        if rows is not None:
            offsets = rows.depths
        positions = (prefix_lens.view(-1, 1).to(torch.int64) + offsets).reshape(-1)
        kv_loc_plan = self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix_lens,
            seq_lens_cpu=host_lens,
            write_virtual=cache_loc,
            read_extent=width,
        )
        return BlockSlots(positions, cache_loc, kv_loc_plan, width)

    def draft_block(self, batch, draft_input, prefix_lens, host_lens) -> torch.Tensor:
        """Run the drafter on `[bonus, MASK x (B-1)]`; return `[bs, B]` = anchor + proposals."""
        width = int(self.block_size)
        block_ids = build_draft_block(draft_input.bonus_tokens, width, int(self._mask_token_id))
        slots = self._block_slots(batch, prefix_lens, host_lens, width)
        bs = block_ids.shape[0]
        target_model = self.target_worker.model_runner.model
        if self._full_embed_gpu is not None:
            embeds = torch.nn.functional.embedding(block_ids, self._full_embed_gpu)
        else:
            embed = _resolve_dflash_embedding_module(self.draft_model, target_model)
            embeds = unwrap_lora_layer(embed)(block_ids)
        if self._noise_embed_scale != 1.0:
            embeds = embeds * self._noise_embed_scale

        seq_lens_cpu = host_lens + width
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix_lens,
            out_cache_loc=slots.cache_loc,
            seq_lens_sum=int(seq_lens_cpu.sum()),
            seq_lens_cpu=seq_lens_cpu,
            positions=slots.positions,
            input_embeds=embeds.view(-1, embeds.shape[-1]),
            spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            num_token_non_padded=(
                torch.full((), bs * width, dtype=torch.int32, device=self.device)
                if enable_num_token_non_padded()
                else None
            ),
            global_num_token_non_padded_cpu=bs * width,
            can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
        )
        slots.kv_loc_plan.bind(forward_batch, self.draft_model_runner.kv_index_translator)
        with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
            draft_out = self.draft_model_runner.forward(forward_batch)
            if self._draft_sampler is not None and draft_out.can_run_graph:
                proposals = self._draft_sampler.out[: bs * (width - 1)].view(bs, width - 1)
            elif self._draft_vocab is not None:
                hidden = draft_out.logits_output.hidden_states.view(bs, width, -1)
                head, ids = self._restricted_head(target_model)
                proposals = draft_vocab.select_extended(
                    hidden[:, 1:, :],
                    head,
                    ids,
                    unwrap_lora_layer(target_model.lm_head).weight,
                    self._extras_of(batch.reqs, ids),
                )
            else:
                hidden = draft_out.logits_output.hidden_states.view(bs, width, -1)
                proposals = self._greedy_sample_from_vocab_parallel_head(
                    hidden_states=hidden[:, 1:, :].reshape(-1, hidden.shape[-1]),
                    lm_head=unwrap_lora_layer(target_model.lm_head),
                ).view(bs, width - 1)
        return torch.cat([block_ids[:, :1], proposals.to(torch.int64)], dim=1)

    @functools.cached_property
    def _stacked_injection(self) -> tuple[kv_injection.StackedKV, Callable] | None:
        """Stacked weights and the injection that reads them, chosen at the first injection
        (the draft KV pool does not exist at `__init__`): our Triton kernel where compiled
        Triton runs, its torch form where it does not (CPU); None for upstream's fused path
        (`--dflash-kernels upstream`) or the per-layer one."""
        if self.platform.triton_kernels and not self._ours:
            return None
        fits, reason = kv_injection.can_stack(
            self.draft_model, self.draft_model_runner.token_to_kv_pool
        )
        if not fits:
            logger.info("DFLASH_X stacked KV injection off (%s): per-layer path", reason)
            return None
        if self._ours:
            from dflash_sglang.kernels.kv_inject import inject_committed as inject
        else:
            inject = kv_injection.inject_stacked
        return kv_injection.stack_kv_weights(self.draft_model), inject

    def _maybe_build_draft_sampler(self):
        """Upstream folds the full-vocabulary head into the draft graph; ours the restricted."""
        if self._draft_vocab is None:
            return super()._maybe_build_draft_sampler()
        head, ids = self._restricted_head(self.target_worker.model_runner.model)
        max_bs = max(get_exec().graph.cuda_graph_config.decode.bs)
        return draft_vocab.InGraphHead(head, ids, int(self.block_size), max_bs)

    def _extras_of(self, reqs, vocab_ids: torch.Tensor) -> torch.Tensor:
        """[bs, E] each request's prompt tokens outside the draft vocabulary
        (`--dflash-prompt-vocab`), found once per request. Not in the CUDA-graph head, which
        keeps the static vocabulary."""
        extras = []
        for req in reqs:
            extra = self._prompt_extras.get(req)
            if extra is None:
                extra = draft_vocab.prompt_extra(
                    req.origin_input_ids, vocab_ids.cpu(), self.options.prompt_vocab
                )
                self._prompt_extras[req] = extra
            extras.append(extra)
        return draft_vocab.pad_extras(extras).to(vocab_ids.device)

    def _restricted_head(self, target_model) -> tuple[torch.Tensor, torch.Tensor]:
        """(lm_head rows of the draft vocabulary, their ids), built once on first use."""
        if self._draft_head is None:
            weight = unwrap_lora_layer(target_model.lm_head).weight
            self._draft_vocab = self._draft_vocab.to(weight.device)
            self._draft_head = weight[self._draft_vocab]
        return self._draft_head, self._draft_vocab

    def _trees_run(self, target_worker) -> bool:
        if self.options.tree == "off":
            return False
        if self.platform.tree_verify(target_worker.model_runner):
            return True
        logger.info("--dflash-tree ignored: the target's attention backend takes no tree mask")
        return False

    def verify(
        self, batch, candidates, slots: BlockSlots, host_seq_lens, grammar_barrier=None, rows=None
    ):
        """Target forward over the chain or tree, capturing the hidden states KV injection needs.

        Returns the logits output (grammar-masked when the batch has grammars), the target's
        argmax per row when it was taken without the full logits (else None), and whether
        the forward ran in a CUDA graph. `prepare_for_verify` rewrites the batch it is
        given, so it gets a shallow copy: the caller's batch keeps its draft input, lengths
        and mode. The grammar tree is built first so grammar work overlaps the forward.
        """
        width = candidates.shape[1]
        grammar_tree = GrammarTree.from_linear_chain(candidates) if batch.has_grammar else None
        fields = dict(
            draft_token=(candidates if rows is None else rows.tokens).reshape(-1),
            positions=slots.positions,
            draft_token_num=width,
            custom_mask=None,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            kv_loc_plan=slots.kv_loc_plan,
        )
        graphs = contextlib.nullcontext()
        if rows is None:
            verify_input = DFlashVerifyInput(**fields)
            if self._verify_graphs is not None:
                graphs = self._verify_graphs.using(width)
        else:
            if self.platform.tree_custom_mask:
                fields["custom_mask"] = tree_custom_mask(rows, host_seq_lens - width)
                graphs = verify_graphs.eager(self.target_worker.model_runner)
            verify_input = TreeVerifyInput(**fields, tree=rows)
        view = copy.copy(batch)
        view.out_cache_loc = slots.cache_loc
        view.seq_lens_cpu, view.seq_lens_sum = host_seq_lens, int(host_seq_lens.sum())
        with graphs:
            forward_batch, _ = verify_input.prepare_for_verify(view, self.target_worker)
            out = self.target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch, is_verify=True,
                skip_attn_backend_init=True,
            )  # fmt: skip
        logits_output = out.logits_output
        target_predict = self._finish_verify_logits(batch, logits_output, width)
        if grammar_tree is not None:
            build_grammar_vocab_mask(
                reqs=batch.reqs,
                tree=grammar_tree,
                sampling_info=batch.sampling_info,
                device=logits_output.next_token_logits.device,
                barrier=grammar_barrier,
            ).apply(logits_output.next_token_logits)
        return logits_output, target_predict, out.can_run_cuda_graph

    def _finish_verify_logits(self, batch, logits_output, width: int) -> torch.Tensor | None:
        """Under TP the verify logits stay vocabulary shards until needed. A greedy batch
        that needs nothing else from them gathers only each rank's row maxima (upstream's
        rule and kernel); otherwise the full logits are gathered and adjusted (penalties,
        bias) for acceptance. Returns the argmax in the first case, None in the second."""
        lp, logits = self._target_logits_processor, logits_output.next_token_logits
        if lp is not None and lp.is_deferred_shard(logits):
            if self._can_skip_verify_logits(batch, batch.sampling_info):
                logits_output.next_token_logits = None
                return lp.deferred_argmax(logits)
            logits_output.next_token_logits = lp.finish_deferred_gather(logits)
        if batch.sampling_info is not None:
            apply_dflash_verify_logits_adjustments(
                next_token_logits=logits_output.next_token_logits,
                sampling_info=batch.sampling_info,
                draft_token_num=width,
            )
        return None

    def accept(
        self, candidates, logits, batch, draft_input, target_predict=None
    ) -> acceptance.Acceptance:
        """Greedy prefix match, or exact speculative sampling when any request samples.

        The top-k settings of a fused sampling kernel come from `draft_input`, the step's
        draft input: after `prepare_for_verify`, `batch.spec_info` is the verify input.
        Min-p batches take the exact torch path: the fused kernel knows no min-p.
        """
        bs, width = candidates.shape
        info = batch.sampling_info
        if self._ours and (target_predict is None or not (info is None or info.is_all_greedy)):
            return self._accept_triton(candidates, logits, info)
        if info is None or info.is_all_greedy:
            if target_predict is None:
                target_predict = acceptance.row_argmax(logits)
            predict = target_predict.view(bs, width)
            self._tp_sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_GREEDY, predict)
            return acceptance.greedy_accept(candidates, predict)
        fused = self.platform.sampling_verify
        if fused is not None and not info.need_min_p_sampling:
            accept_lens, bonus = fused(
                candidates=candidates,
                next_token_logits=logits,
                sampling_info=info,
                max_top_k=draft_input.max_top_k,
                uniform_top_k_value=draft_input.uniform_top_k_value,
            )
        else:
            accepted = self._sample_accept_torch(candidates, logits, info, width)
            accept_lens, bonus = accepted.accept_lens, accepted.bonus
        self._tp_sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE, accept_lens)
        self._tp_sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE, bonus)
        return acceptance.commit(candidates, accept_lens, bonus)

    def _accept_triton(self, candidates, logits, info) -> acceptance.Acceptance:
        """`dflash_sglang.kernels.accept`: greedy argmax, prefix match and bonus in one
        kernel, or exact sampling (min-p included) from the logits. Rank 0's result is
        broadcast under TP, and the emitted tokens rebuilt from it."""
        from dflash_sglang.kernels import accept

        bs, width = candidates.shape
        if info is None or info.is_all_greedy:
            site, accepted = (
                SpecTpSyncSite.DFLASH_ACCEPT_GREEDY,
                accept.greedy_accept(logits, candidates),
            )
        else:
            site = SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE
            coins = torch.rand(bs, width - 1, device=logits.device, generator=self._generator)
            draws = torch.rand(bs, device=logits.device, generator=self._generator)
            accepted = accept.sampled_accept(
                logits,
                candidates,
                info.temperatures.view(-1),
                info.top_ks.view(-1),
                info.top_ps.view(-1),
                info.min_ps.view(-1) if info.need_min_p_sampling else None,
                coins=coins,
                draws=draws,
            )
        self._tp_sync.sync(site, accepted.accept_lens)
        self._tp_sync.sync(site, accepted.bonus)
        return acceptance.commit(candidates, accepted.accept_lens, accepted.bonus)

    def _sample_accept_torch(self, candidates, logits, info, width) -> acceptance.Acceptance:
        bs = candidates.shape[0]
        probs = self._row_probs(logits, info, width).view(bs, width, -1)
        # Greedy rows in a mixed batch have top_k == 1: a one-hot p accepts iff draft == argmax.
        coins = torch.rand(bs, width - 1, device=logits.device, generator=self._generator)
        return acceptance.sampled_accept(candidates, probs, coins, self._generator)

    @staticmethod
    def _row_probs(logits, info, width: int) -> torch.Tensor:
        """The target's sampling distribution at every verify row, `[bs * width, V]`."""

        def per_row(values):
            return torch.repeat_interleave(values.view(-1), width)

        return acceptance.sampling_probs(
            logits,
            per_row(info.temperatures),
            per_row(info.top_ks),
            per_row(info.top_ps),
            per_row(info.min_ps) if info.need_min_p_sampling else None,
        )

    def _accept_tree(
        self, rows: VerifyTree, logits_output, batch, slots: BlockSlots, target_predict=None
    ) -> tuple[acceptance.Acceptance, TreeAcceptance, BlockSlots]:
        """Walk the tree with the target's token at every row (argmax, or one draw each),
        then reorder the step's rows so the accepted path is a chain prefix: its KV slots
        take positions prefix.. in `req_to_token` (a permutation of the slots the step
        already holds, so nothing is allocated or freed), and the hidden states, logits
        and injection slots follow; commit, injection and logprobs then see a chain."""
        bs, width = rows.tokens.shape
        info, logits = batch.sampling_info, logits_output.next_token_logits
        if info is None or info.is_all_greedy:
            site = SpecTpSyncSite.DFLASH_ACCEPT_GREEDY
            target = acceptance.row_argmax(logits) if target_predict is None else target_predict
        else:
            site = SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE
            probs = self._row_probs(logits, info, width)
            target = torch.multinomial(probs, 1, generator=self._generator)
        target = self._tp_sync.sync(site, target.view(bs, width).contiguous())
        walked = walk_tree(rows, target)
        order = walked.order
        chain = permute_rows(rows.tokens, order)
        cache_loc = permute_rows(slots.cache_loc.view(bs, width), order)
        offsets = torch.arange(width, dtype=torch.int64, device=order.device)
        columns = batch.seq_lens.view(-1, 1).to(torch.int64) + offsets
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        req_to_token[batch.req_pool_indices.view(-1, 1), columns] = cache_loc.to(req_to_token.dtype)
        logits_output.hidden_states = permute_rows(logits_output.hidden_states, order)
        if batch.return_logprob:
            logits_output.next_token_logits = permute_rows(logits, order)
        slots = replace(
            slots, positions=columns.view(-1), cache_loc=cache_loc.view(-1), order=order
        )
        return acceptance.commit(chain, walked.accept_lens, walked.bonus), walked, slots

    def _inject_committed(self, logits_output, slots: BlockSlots, commit_lens, reqs) -> None:
        """Write the committed rows' draft K/V now, or hold them until read (`HeldRows`,
        CPU)."""
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DFLASH_X verify returned no target hidden states")
        logits_output.hidden_states = None
        bs, width = commit_lens.numel(), slots.width
        draft_loc = self._draft_write_ids(slots.kv_loc_plan)
        if slots.order is not None:
            draft_loc = permute_rows(draft_loc.view(bs, width), slots.order).view(-1)
        hidden = hidden[: bs * width]
        # HiCache may copy draft KV to the host once a step returns: rows must be written.
        if self._held is not None and self.hicache_draft_plan.mode == HiCacheDraftMode.NONE:
            if self._held.room() < draft_loc.numel():
                self._write_rows(self._held.flush())
            self._held.add(hidden, slots.positions, draft_loc, commit_lens, reqs)
            return
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=hidden,
            cache_loc=draft_loc,
            positions=slots.positions,
            cache_loc_2d=draft_loc.view(bs, width),
            commit_lens=commit_lens,
        )

    def _before_prefill(self, batch: ScheduleBatch) -> None:
        """A prefill writes draft KV at its new slots and a later draft reads its prefix:
        held rows at the new slots are stale, held rows in a radix-cached prefix (the last
        turn's reply) are written now. Draft KV ids are the target's here (CPU: no translation)."""
        if self._held is None or batch.forward_mode.is_idle() or batch.prefix_lens is None:
            return
        if batch.out_cache_loc is not None:
            self._held.discard(batch.out_cache_loc)
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        prefixes = [
            req_to_token[pool_index, :length]
            for pool_index, length in zip(
                batch.req_pool_indices.tolist(), batch.prefix_lens, strict=True
            )
            if length
        ]
        if prefixes:
            self._write_rows(self._held.take_slots(torch.cat(prefixes)))

    def _write_rows(self, rows: Rows | None) -> None:
        """Inject held rows (all of them committed) in one call."""
        if rows is not None:
            hidden, positions, draft_loc = rows
            self._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=hidden, cache_loc=draft_loc, positions=positions
            )

    def _append_target_hidden_to_draft_kv_by_loc(
        self,
        *,
        target_hidden: torch.Tensor,
        cache_loc: torch.Tensor,
        positions: torch.Tensor,
        cache_loc_2d: torch.Tensor | None = None,
        commit_lens: torch.Tensor | None = None,
        extend_lens: torch.Tensor | None = None,
    ) -> None:
        """KV injection seam: the stacked path (our Triton kernel, or its torch form on CPU),
        else upstream's fused path (GPU), else `kv_injection.inject` per layer."""
        stacked = self._stacked_injection
        if stacked is not None:
            weights, inject = stacked
            with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
                return inject(
                    self.draft_model,
                    weights,
                    self.draft_model_runner.token_to_kv_pool,
                    target_hidden[: cache_loc.numel()],
                    positions,
                    cache_loc.to(torch.int64),
                    commit_lens,
                )
        if self._use_fused_kv_materialize and self._fused_kv_helper is not None:
            return super()._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=target_hidden,
                cache_loc=cache_loc,
                positions=positions,
                cache_loc_2d=cache_loc_2d,
                commit_lens=commit_lens,
                extend_lens=extend_lens,
            )
        target_hidden = target_hidden[: cache_loc.numel()]
        if commit_lens is not None:
            width = cache_loc.numel() // commit_lens.numel()
            rows = kv_injection.committed_rows(commit_lens, width)
            target_hidden, positions, cache_loc = (
                target_hidden[rows],
                positions[rows],
                cache_loc[rows],
            )
        with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
            kv_injection.inject(
                self.draft_model,
                self.draft_model_runner.token_to_kv_pool,
                target_hidden.to(self.device),
                positions.to(self.device),
                cache_loc.to(self.device),
            )

    def _export_step(self, record: StepRecord) -> None:
        self.metrics.observe_step(
            record.plan, record.accept_lens, record.draft_seconds, record.verify_seconds
        )

    @staticmethod
    def _host_prefix_lens(batch: ScheduleBatch, draft_input: DFlashDraftInputV2) -> torch.Tensor:
        if batch.seq_lens_cpu is not None:
            return batch.seq_lens_cpu
        if draft_input.nxt_kv_lens_cpu is not None:
            return draft_input.nxt_kv_lens_cpu
        return batch.seq_lens.cpu()


def radix_hit_tokens(reqs, counted: weakref.WeakKeyDictionary) -> int:
    """Prompt tokens served from the radix cache (their draft KV included) since last asked.

    SGLang's `req.cached_tokens` grows only by radix hits: not by earlier chunks of a chunked
    prefill, and not for the running requests a mixed batch carries (`prefix_lens` counts
    both). `counted` remembers what each live request has already reported.
    """
    hits = 0
    for req in reqs:
        cached = int(req.cached_tokens)
        hits += cached - counted.get(req, 0)
        counted[req] = cached
    return hits
