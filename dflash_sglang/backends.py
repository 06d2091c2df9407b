"""Our attention backends under SGLang's names, registered in every process by the plugin.

`dflash_cpu` (target and draft, CPU) and `dflash_flashinfer` (the DFlash draft on CUDA:
`dflash_sglang.kernels.flashinfer_draft`). Factories import their backend on first use, so
registering costs nothing in processes that never build one.
"""

from __future__ import annotations

from collections.abc import Callable

from sglang.srt.arg_groups import choices
from sglang.srt.layers.attention.attention_registry import register_attention_backend

from dflash_sglang.platform import CPU_ATTENTION_BACKEND, DRAFT_FLASHINFER_BACKEND


def _cpu(model_runner):
    from dflash_sglang.cpu_platform.attention import DFlashCPUAttnBackend

    return DFlashCPUAttnBackend(model_runner)


def _flashinfer_draft(model_runner):
    from dflash_sglang.kernels.flashinfer_draft import DraftFlashInferBackend

    return DraftFlashInferBackend(model_runner)


def _register(name: str, factory: Callable, target: bool) -> None:
    register_attention_backend(name)(factory)
    if target and name not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([name])
    if name not in choices.DRAFT_ATTENTION_BACKEND_CHOICES:
        choices.add_draft_attention_backend_choices([name])


def register() -> None:
    """Make `--attention-backend dflash_cpu` and the draft flag's two names valid;
    idempotent."""
    _register(CPU_ATTENTION_BACKEND, _cpu, target=True)
    _register(DRAFT_FLASHINFER_BACKEND, _flashinfer_draft, target=False)
