"""The `DFLASH_X` algorithm object SGLang dispatches on, and its server-argument resolution.

SGLang calls `handle_server_args` with a stand-in whose field writes become declared
resolutions; workers read the result through `runtime_context.get_spec()`. Upstream
`_handle_dflash` is not called for plugin algorithms, so its defaults are re-stated here.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from dflash_sglang import platform
from dflash_sglang.checkpoint import CheckpointError, check_pair
from dflash_sglang.options import DEFAULT_BLOCK_SIZE

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 48


def resolve_block_size(server_args: Any) -> int:
    """Block size = verify width: explicit flags first, then the draft config, then 16."""
    block_flag = server_args.speculative_dflash_block_size
    tokens_flag = server_args.speculative_num_draft_tokens
    if block_flag is not None and tokens_flag is not None and int(block_flag) != int(tokens_flag):
        raise ValueError(
            "--speculative-num-draft-tokens and --speculative-dflash-block-size differ "
            f"({tokens_flag} vs {block_flag}); for DFLASH_X they are the same block size"
        )
    explicit = block_flag if block_flag is not None else tokens_flag
    if explicit is not None:
        return int(explicit)
    info = check_pair(server_args.model_path, server_args.speculative_draft_model_path)
    return info.block_size or DEFAULT_BLOCK_SIZE


def validate_server_args(server_args: Any) -> None:
    """Reject configurations DFLASH_X does not serve, naming the flag at fault."""
    plat = platform.for_device(server_args.device)  # raises, naming --device
    if server_args.speculative_draft_model_path is None:
        raise ValueError("DFLASH_X requires --speculative-draft-model-path")
    if int(server_args.pp_size or 1) != 1:
        raise ValueError("DFLASH_X requires --pp-size 1")
    if server_args.enable_dp_attention:
        raise ValueError("DFLASH_X does not support --enable-dp-attention")
    if server_args.speculative_draft_window_size is not None:
        raise ValueError("DFLASH_X does not support --speculative-draft-window-size yet")
    if (server_args.disaggregation_mode or "null") != "null":
        raise ValueError("DFLASH_X does not support --disaggregation-mode")
    for flag, value in (
        ("--speculative-num-draft-tokens", server_args.speculative_num_draft_tokens),
        ("--speculative-dflash-block-size", server_args.speculative_dflash_block_size),
    ):
        if value is not None and int(value) < 2:
            raise ValueError(f"{flag} must be at least 2 (anchor + one draft), got {value}")
    draft_backend = server_args.speculative_draft_attention_backend
    if plat is platform.CPU and draft_backend not in (None, plat.attention_backend):
        raise ValueError(
            f"--speculative-draft-attention-backend {draft_backend} does not run on CPU; "
            f"use {plat.attention_backend}"
        )
    try:
        check_pair(server_args.model_path, server_args.speculative_draft_model_path)
    except CheckpointError as e:
        raise ValueError(str(e)) from e


def resolve_server_args(server_args: Any) -> None:
    """DFlash defaults: one chain step, block-wide verify, a draft backend, a batch cap."""
    for field in ("speculative_num_steps", "speculative_eagle_topk"):
        value = getattr(server_args, field)
        if value is not None and int(value) != 1:
            logger.warning("DFLASH_X uses %s=1; overriding %s", field, value)
        setattr(server_args, field, 1)
    server_args.speculative_num_draft_tokens = resolve_block_size(server_args)

    plat = platform.for_device(server_args.device)
    if server_args.speculative_draft_attention_backend is None:
        server_args.speculative_draft_attention_backend = plat.attention_backend
    if not plat.overlap_schedule:
        server_args.disable_overlap_schedule = True
    if server_args.max_running_requests is None:
        server_args.max_running_requests = DEFAULT_MAX_RUNNING_REQUESTS


class DFlashXSpec(CustomSpecAlgo):
    """Reports itself as DFlash so SGLang's aux-hidden capture, pool sizing and graphs apply."""

    def is_dflash(self) -> bool:
        return True

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def supports_prefill_shared_read_done(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        return True

    def supports_mixed_chunk(self) -> bool:
        return True

    # The four enum methods SGLang 0.5.23's CustomSpecAlgo lacks.
    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def get_platform_worker_cls(self) -> type | None:
        return None

    def create_future_map(
        self,
        device,
        req_to_token_pool,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(
            device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay
        )

    def handle_server_args(self, server_args: Any) -> None:
        resolve_server_args(server_args)
