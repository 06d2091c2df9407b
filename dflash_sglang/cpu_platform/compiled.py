"""The target model's decode and verify forwards compiled with torch.compile on CPU.

A CPU decode step of a small model is mostly Python and op dispatch: ~2,800 ATen calls per
forward of the embedded SmolLM2, most of them tiny (README, "Against the peers"). Inductor
fuses the elementwise work (norms, RoPE, SiLU, residuals) into a few C++ loops and calls
the GEMMs directly, so one compiled forward replaces thousands of dispatches.

Attention stays eager, as one opaque custom op per layer (`dflash_cpu::radix_attention`):
it writes the KV pool and reads SGLang's per-forward metadata, neither of which belongs in
a graph. The op runs the layer's own `RadixAttention.forward` with the forward batch of
the current forward context, so whatever attention backend serves eagerly serves here.

Only token-count-shaped modes are compiled (decode, target verify): one graph with a
symbolic token count serves every batch size and verify width; prefill stays eager.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.runner_utils.forward_batch import (
    get_forward_batch,
    set_forward_batch,
)

from dflash_sglang.cpu_platform import COMPILE_ENV, register_hook_once

logger = logging.getLogger(__name__)


# Layers the op can run, by the index the compiled graph passes it.
_LAYERS: list[RadixAttention] = []
# While compiling before serving the op must not touch the KV pool: it returns zeros.
_WARMING = False


@torch.library.custom_op("dflash_cpu::radix_attention", mutates_args=())
def radix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int) -> torch.Tensor:
    """One attention layer, eager, with the current forward batch (writes its KV)."""
    layer = _LAYERS[index]
    if _WARMING:
        return q.new_zeros(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
    out = RadixAttention.forward(layer, q, k, v, get_forward_batch())
    return out.reshape(q.shape[0], -1)


@radix_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int) -> torch.Tensor:
    layer = _LAYERS[index]
    return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)


class CompilableRadixAttention(RadixAttention):
    """A `RadixAttention` that, inside a compiled region, is the opaque op above."""

    dflash_index: int

    def forward(self, q, k, v, forward_batch, save_kv_cache: bool = True, **kwargs):
        if (torch.compiler.is_compiling() or _WARMING) and save_kv_cache and not kwargs:
            return torch.ops.dflash_cpu.radix_attention(q, k, v, self.dflash_index)
        return super().forward(q, k, v, forward_batch, save_kv_cache, **kwargs)


def _adopt_layers(body: torch.nn.Module) -> None:
    for module in body.modules():
        if type(module) is RadixAttention:
            module.__class__ = CompilableRadixAttention
            module.dflash_index = len(_LAYERS)
            _LAYERS.append(module)


def compiled_modes(forward_batch: Any) -> bool:
    mode = forward_batch.forward_mode
    return mode.is_decode() or mode.is_target_verify()


def decoder_stack(body: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor):
    """`LlamaModel.forward` for one rank without SGLang's residual-stream bookkeeping.

    The same modules in the same order (norm, attention, norm, MLP, residual adds fused
    into the norms, final norm), and the same captures: the residual stream entering each
    layer of `layers_to_capture`. The bookkeeping (layer boundaries, msgspec structs) is
    what torch.compile cannot trace.
    """
    hidden = body.embed_tokens(input_ids)
    residual = None
    aux = []
    for i, layer in enumerate(body.layers):
        if i in body.layers_to_capture:
            aux.append(hidden if residual is None else hidden + residual)
        if residual is None:
            residual, hidden = hidden, layer.input_layernorm(hidden)
        else:
            hidden, residual = layer.input_layernorm(hidden, residual)
        # The forward batch reaches attention through the forward context, not the graph.
        hidden = layer.self_attn(positions=positions, hidden_states=hidden, forward_batch=None)
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        hidden = layer.mlp(hidden)
    hidden, _ = body.norm(hidden, residual)
    return (hidden, aux) if aux else hidden


class CompiledBody:
    """Stands in for `model.model.forward`: compiled for decode and verify, eager otherwise."""

    def __init__(self, body: torch.nn.Module) -> None:
        self.eager = body.forward
        self.stack = functools.partial(decoder_stack, body)
        self.fast = torch.compile(self.stack, dynamic=True)

    def warm_up(self) -> None:
        """Compile both graphs before serving, with attention skipped (no KV is touched).

        Dynamo specialises a single token apart from the rest, so both are compiled here;
        otherwise a compile would stall a decode step, and the adaptive planner would take
        that step's seconds for what a step costs. One eager pass first: SGLang's modules
        pick their kernels on first call, a platform query Dynamo cannot trace.
        """
        global _WARMING
        _WARMING = True
        try:
            for run, n in ((self.stack, 2), (self.fast, 2), (self.fast, 1)):
                tokens = torch.zeros(n, dtype=torch.int64)
                with torch.no_grad():
                    run(tokens, tokens.clone())
        finally:
            _WARMING = False

    def __call__(self, input_ids, positions, forward_batch, *args, **kwargs):
        # Only input ids: embeddings or pipeline proxies from outside keep the eager path.
        plain = all(value is None for value in (*args, *kwargs.values()))
        if plain and compiled_modes(forward_batch):
            with torch.no_grad(), set_forward_batch(forward_batch):
                return self.fast(input_ids, positions)
        return self.eager(input_ids, positions, forward_batch, *args, **kwargs)


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `decoder_stack` would not compute what `model`'s own forward computes, if so."""
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_world_size
    from sglang.srt.models.llama import LlamaDecoderLayer, LlamaModel

    body = getattr(model, "model", None)
    if type(body) is not LlamaModel:
        return f"{type(model).__name__}: only Llama-architecture targets"
    if not all(type(layer) is LlamaDecoderLayer for layer in body.layers):
        return f"{type(model).__name__}: a decoder layer other than Llama's"
    if get_tensor_model_parallel_world_size() != 1 or body.pp_group.world_size != 1:
        return "tensor or pipeline parallelism (the stack does not reduce across ranks)"
    return None


def compile_target(model: torch.nn.Module) -> None:
    """Route `model`'s decode and verify forwards through inductor, where supported."""
    reason = unsupported(model)
    if reason is not None:
        logger.info("Target forward not compiled: %s", reason)
        return
    _adopt_layers(model.model)
    model.model.forward = CompiledBody(model.model)
    logger.info("Target decode/verify forward: compiled (torch.compile, inductor)")


_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"


def _after_load_model(result: Any, model_runner: Any, *args: Any, **kwargs: Any) -> Any:
    if enabled(os.environ) and not model_runner.is_draft_worker:
        compile_target(model_runner.model)
    return result


def _after_init_cuda_graphs(result: Any, model_runner: Any, *args: Any, **kwargs: Any) -> Any:
    """Compile where SGLang captures its graphs: after the attention backends, with which
    the scheduler configures the drafter's hidden-state captures that the graph bakes in."""
    forward = getattr(getattr(model_runner.model, "model", None), "forward", None)
    if isinstance(forward, CompiledBody):
        start = time.perf_counter()
        forward.warm_up()
        logger.info("Target forward compiled in %.1f s", time.perf_counter() - start)
    return result


def enabled(env: Mapping[str, str]) -> bool:
    """The launcher's `--dflash-cpu-compile`, as it reaches the scheduler processes."""
    return env.get(COMPILE_ENV, "off") == "on"


def register_hooks() -> None:
    """Called once per CPU process by the plugin, before SGLang applies plugin hooks."""
    from sglang.srt.plugins.hook_registry import HookType

    register_hook_once(f"{_RUNNER}.load_model", _after_load_model, HookType.AFTER)
    register_hook_once(f"{_RUNNER}.init_cuda_graphs", _after_init_cuda_graphs, HookType.AFTER)
