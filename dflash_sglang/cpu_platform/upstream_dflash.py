"""SGLang's own `--speculative-algorithm DFLASH` on CPU, for comparison with DFLASH_X on the
same engine, the same attention backend and the same drafter.

SGLang 0.5.23 gates DFLASH on the device (CUDA, NPU, XPU) unless an out-of-tree platform
claims it. Two hooks, registered through SGLang's plugin `HookRegistry` in CPU processes:
- around `_handle_dflash`: its checks run against a view of the platform that claims
  DFLASH with our `dflash_cpu` draft backend, so every other check still applies;
- around `SpeculativeAlgorithm.create_worker`: DFLASH gets `DFlashWorkerV2` with the draft
  model prepared as DFLASH_X prepares its own: torch q/k-norm + RoPE (the Triton path
  would run in the interpreter) and `input_embeds` in the model's dtype (SGLang's runner
  casts them to bf16, which breaks `--dtype float32`).
Upstream's worker already takes its own torch paths where GPU Triton is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dflash_sglang.platform import CPU_ATTENTION_BACKEND

UPSTREAM = "DFLASH"
_HOOKED_ARGS = "sglang.srt.arg_groups.speculative_hook._handle_dflash"
_HOOKED_WORKER = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker"


class DFlashOnCPUPlatform:
    """The current platform as `_handle_dflash` sees it on CPU: everything delegated, except
    that DFLASH is supported with the `dflash_cpu` draft backend."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm == UPSTREAM

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return algorithm == UPSTREAM and backend == CPU_ATTENTION_BACKEND

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return CPU_ATTENTION_BACKEND


def handle_dflash_on_cpu(original: Callable, server_args: Any) -> None:
    """Run upstream's DFLASH argument checks with the CPU platform claiming DFLASH."""
    from sglang.srt.arg_groups import speculative_hook

    if not str(server_args.device).startswith("cpu"):
        return original(server_args)
    platform = speculative_hook.current_platform
    speculative_hook.current_platform = DFlashOnCPUPlatform(platform)
    try:
        return original(server_args)
    finally:
        speculative_hook.current_platform = platform


def create_worker_on_cpu(original: Callable, algorithm: Any, server_args: Any) -> Any:
    """Upstream's DFLASH worker class, with its draft model kept off Triton."""
    worker_cls = original(algorithm, server_args)
    if algorithm.name != UPSTREAM:
        return worker_cls
    return cpu_worker_class(worker_cls)


def cpu_worker_class(worker_cls: type) -> type:
    """`worker_cls` with the draft-model preparation DFLASH_X gives its own on CPU."""
    from dflash_sglang import platform

    class UpstreamDFlashOnCPU(worker_cls):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            platform.CPU.prepare_draft_model(self.draft_model, self.draft_parallel_layout)
            platform.keep_embeds_in_model_dtype(self.draft_model)

    return UpstreamDFlashOnCPU


def register_hooks() -> None:
    """Called once per CPU process by the plugin, before SGLang applies plugin hooks."""
    from sglang.srt.plugins.hook_registry import HookType

    from dflash_sglang.cpu_platform import register_hook_once

    register_hook_once(_HOOKED_ARGS, handle_dflash_on_cpu, HookType.AROUND)
    register_hook_once(_HOOKED_WORKER, create_worker_on_cpu, HookType.AROUND)
