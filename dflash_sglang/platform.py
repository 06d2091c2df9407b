"""Platform decisions in one place: what DFLASH_X does differently on CPU and on CUDA.

The launcher, the server-argument resolution and the worker ask a `Platform` instead of
testing device strings. A platform is plain data plus callables, so a CPU test can build
the CUDA one with torch stand-ins for its kernels and drive the worker's CUDA branch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dflash_sglang.verify_graphs import VerifyGraphs

CPU_ATTENTION_BACKEND = "dflash_cpu"  # `cpu_platform.attention`, registered by `backends`
# The draft on CUDA with the block split from the context (`kernels.flashinfer_draft`).
DRAFT_FLASHINFER_BACKEND = "dflash_flashinfer"
GPU_ATTENTION_BACKEND = "flashinfer"


def _no_op(*_args, **_kwargs) -> None:
    return None


def _record_on_current_stream(tensor: torch.Tensor) -> None:
    # Under overlap scheduling `seq_lens` comes from the previous iteration, possibly made
    # on another stream: without this its memory may be reused while we still read it.
    tensor.record_stream(torch.get_device_module(tensor.device).current_stream())


def _always(*_args, **_kwargs) -> bool:
    return True


def _flashinfer_target(model_runner: Any) -> bool:
    """FlashInfer's verify plans SGLang's flat custom mask (`tree.custom_mask`); other GPU
    backends' DFLASH verify is causal only."""
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    return isinstance(model_runner.attn_backend, FlashInferAttnBackend)


def _cpu_draft_model(draft_model: torch.nn.Module, layout: Any) -> None:
    from dflash_sglang.cpu_platform.compiled import compile_draft
    from dflash_sglang.cpu_platform.triton_fallbacks import use_torch_paths

    use_torch_paths(draft_model)
    compile_draft(draft_model, layout)


def keep_embeds_in_model_dtype(draft_model: torch.nn.Module) -> None:
    """SGLang's model runner casts `input_embeds` to bf16 whatever `--dtype` says; cast back."""
    dtype = draft_model.fc.weight.dtype
    if dtype == torch.bfloat16:
        return
    forward = draft_model.forward

    def forward_in_model_dtype(*args, input_embeds=None, **kwargs):
        if input_embeds is not None:
            input_embeds = input_embeds.to(dtype)
        return forward(*args, input_embeds=input_embeds, **kwargs)

    draft_model.forward = forward_in_model_dtype


def _upstream_sampling_verify() -> Callable | None:
    """SGLang's fused sampling verify, where this build has it (CUDA with sgl-kernel)."""
    from sglang.srt.speculative.dflash_utils import (
        compute_dflash_sampling_correct_drafts_and_bonus,
        is_dflash_sampling_verify_available,
    )

    if not is_dflash_sampling_verify_available():
        return None
    return compute_dflash_sampling_correct_drafts_and_bonus


class HostTimer:
    """Seconds of a region on a device the host waits for (CPU: exact at `stop`)."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._seconds: float | None = None

    def stop(self) -> None:
        self._seconds = time.perf_counter() - self._start

    def seconds(self) -> float | None:
        return self._seconds


class CudaTimer:
    """Device seconds of a region, read without synchronising: None until the GPU has run
    it (the caller asks a step later and skips the measurement if it is not done yet)."""

    def __init__(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def stop(self) -> None:
        self._end.record()

    def seconds(self) -> float | None:
        if not self._end.query():
            return None
        return self._start.elapsed_time(self._end) / 1000.0


@dataclass(frozen=True)
class Platform:
    name: str  # "cpu" or "cuda"
    attention_backend: str  # target and draft attention
    overlap_schedule: bool  # SGLang's CPU switch-off of overlap skips plugin algorithms
    sleep_on_idle: bool  # an idle scheduler otherwise busy-polls a core the busy one needs
    # Called once on the draft model and its parallel layout at worker start (CPU: torch
    # paths for Triton kernels, the block forward compiled).
    prepare_draft_model: Callable[[torch.nn.Module, Any], None] = _no_op
    # Called on tensors carried over from the previous overlap iteration.
    adopt_tensor: Callable[[torch.Tensor], None] = _no_op
    # A fused sampling verify with upstream's signature, or None for the exact torch path.
    # It applies temperature, top-k and top-p only: min-p batches take the torch path.
    sampling_verify: Callable | None = None
    # Compiled Triton is available: `dflash_sglang.kernels` may replace upstream's kernels.
    triton_kernels: bool = False
    # Times the draft forward for the planner's cost model (`start_timer()`, `.stop()`,
    # `.seconds()` later).
    start_timer: Callable[[], HostTimer | CudaTimer] = HostTimer
    # (target model runner, candidate widths, block size) -> per-width verify graphs, or
    # None where the target has no graphs to swap (CPU).
    verify_graphs: Callable[..., VerifyGraphs | None] = _no_op
    # Committed rows may wait for their draft-KV injection until read (`held_rows`): on CPU
    # each injection call and row costs; on GPU injection is one kernel per step.
    defer_injection: bool = False
    # Two-branch tree verify (`tree.py`): (target model runner) -> whether its attention
    # takes a tree. Our CPU backend reads `TreeVerifyInput.tree`; on GPU FlashInfer reads the
    # flat custom mask (`tree_custom_mask`), and tree steps run eager: the verify graphs
    # were captured for chains, without a mask buffer.
    tree_verify: Callable[[Any], bool] = _no_op
    tree_custom_mask: bool = False

    def with_(self, **changes) -> Platform:
        return dataclasses.replace(self, **changes)


CPU = Platform(
    name="cpu",
    attention_backend=CPU_ATTENTION_BACKEND,
    overlap_schedule=False,
    sleep_on_idle=True,
    prepare_draft_model=_cpu_draft_model,
    defer_injection=True,
    tree_verify=_always,
)
CUDA = Platform(
    name="cuda",
    attention_backend=GPU_ATTENTION_BACKEND,
    overlap_schedule=True,
    sleep_on_idle=False,
    adopt_tensor=_record_on_current_stream,
    triton_kernels=True,
    start_timer=CudaTimer,
    verify_graphs=VerifyGraphs.build,
    tree_verify=_flashinfer_target,
    tree_custom_mask=True,
)


def for_device(device: str | None) -> Platform:
    """The platform of a `--device` value (`cuda`, `cuda:1`, `cpu`)."""
    device = str(device or "")
    if device.startswith("cpu"):
        return CPU
    if device.startswith("cuda"):
        return CUDA
    raise ValueError(f"DFLASH_X supports --device cuda or cpu, got --device {device!r}")


def detect_device() -> str:
    """The launcher's default `--device`."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def of_process() -> Platform:
    """This scheduler process's platform, with the kernels its build really has."""
    from sglang.srt.utils import is_cpu

    if is_cpu():
        return CPU
    return CUDA.with_(sampling_verify=_upstream_sampling_verify())
