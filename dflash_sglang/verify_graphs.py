"""One target verify graph per candidate width (CUDA), swapped as a unit before each verify.

SGLang captures the target's verify graph for the block size only, so an adaptive step
verifying fewer tokens would run eager. Following upstream's adaptive EAGLE
(`adaptive_runtime_state.SpecRuntimeState`, `eagle_worker_v2.build_adaptive_runtime_state`),
every other candidate width gets its own attention backend (own workspace and graph
buffers) and decode-graph runner, captured once at start-up; `activate(width)` points the
target model runner at them. The draft's graphs are untouched: it always drafts the block.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyState:
    attn_backend: Any
    graph_runner: Any


def capture_state(model_runner: Any, width: int) -> VerifyState:
    """A fresh attention backend and a verify graph captured for `width` tokens per request."""
    tic = time.perf_counter()
    backup = model_runner.init_new_workspace  # `_get_attention_backend` may set it
    try:
        backend = model_runner._get_attention_backend(init_new_workspace=True)
    finally:
        model_runner.init_new_workspace = backup
    runner_cls = model_runner._decode_cuda_graph_runner_cls()
    runner = runner_cls(
        model_runner,
        attn_backend=backend,
        speculative_num_steps=1,
        speculative_num_draft_tokens=width,
    )
    logger.info("DFLASH_X verify graph for width %d captured in %.1f s", width,
                time.perf_counter() - tic)  # fmt: skip
    return VerifyState(backend, runner)


class VerifyGraphs:
    """The target model runner's attention backend and decode-graph runner, per width."""

    def __init__(self, model_runner: Any, states: dict[int, VerifyState], block_size: int) -> None:
        self.model_runner = model_runner
        self.states = states
        self.block_size = self.active = block_size

    @classmethod
    def build(
        cls,
        model_runner: Any,
        widths: tuple[int, ...],
        block_size: int,
        capture: Callable[[Any, int], VerifyState] = capture_state,
    ) -> VerifyGraphs | None:
        """None when there is nothing to swap: no verify graph was captured (graphs off) or
        the block is the only width."""
        if model_runner.decode_cuda_graph_runner is None or set(widths) <= {block_size}:
            return None
        current = VerifyState(model_runner.attn_backend, model_runner.decode_cuda_graph_runner)
        states = {w: capture(model_runner, w) for w in widths if w != block_size}
        states[block_size] = current
        return cls(model_runner, states, block_size)  # the block's state stays active

    def activate(self, width: int) -> None:
        """A width without its own graph runs eager on the block's backend (the block's
        graph cannot replay another width; SGLang falls back by itself)."""
        if width not in self.states:
            width = self.block_size
        if width == self.active:
            return
        state = self.states[width]
        self.model_runner.attn_backend = state.attn_backend
        self.model_runner.decode_cuda_graph_runner = state.graph_runner
        self.active = width

    @contextlib.contextmanager
    def using(self, width: int) -> Iterator[None]:
        """`width`'s state for one verify; the block's again afterwards, so prefill and
        everything else SGLang runs between steps sees the runner as it built it."""
        self.activate(width)
        try:
            yield
        finally:
            self.activate(self.block_size)


@contextlib.contextmanager
def eager(model_runner: Any) -> Iterator[None]:
    """One verify with no graph (a tree step: every verify graph was captured for chains,
    and FlashInfer plans its custom mask only on an eager wrapper)."""
    runner, model_runner.decode_cuda_graph_runner = model_runner.decode_cuda_graph_runner, None
    try:
        yield
    finally:
        model_runner.decode_cuda_graph_runner = runner
