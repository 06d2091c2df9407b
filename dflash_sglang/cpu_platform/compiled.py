"""The target's forwards (decode, verify, prefill) and the DFlash drafter's block forward
compiled with torch.compile on CPU.

A CPU decode step of a small model is mostly Python and op dispatch: ~2,800 ATen calls per
forward of the embedded SmolLM2, most of them tiny (README, "Against the peers"). Inductor
fuses the elementwise work (norms, RoPE, SiLU, residuals) into a few C++ loops and calls
the GEMMs directly, so one compiled forward replaces thousands of dispatches.

Attention stays eager, as one opaque custom op per layer (`dflash_cpu::radix_attention`):
it writes the KV pool and reads SGLang's per-forward metadata, neither of which belongs in
a graph. The op runs the layer's own `RadixAttention.forward` with the forward batch of
the current forward context, so whatever attention backend serves eagerly serves here.

The graph has one symbolic token count and no notion of the forward mode (attention, the
only part that differs between modes, is the opaque op), so one graph serves decode, target
verify (the drafter's block runs in that mode) and plain prefill chunks of any size. Prefill
on CPU was mostly elementwise work in eager mode (norms and activation: 43% of a 16-request
prefill's forward in a py-spy sample, against 31% in the linears), which inductor fuses.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import torch
import torch._inductor.config
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import get_attn_backend
from sglang.srt.model_executor.runner_utils.forward_batch import (
    get_forward_batch,
    set_forward_batch,
)

from dflash_sglang.cpu_platform import COMPILE_ENV, FREEZE_ENV, register_hook_once
from dflash_sglang.cpu_platform.attention import DFlashCPUAttnBackend

logger = logging.getLogger(__name__)


# Layers the op can run, by the index the compiled graph passes it.
_LAYERS: list[RadixAttention] = []
# While compiling before serving the op must not touch the KV pool: it returns zeros.
_WARMING = False


@torch.library.custom_op("dflash_cpu::radix_attention", mutates_args=())
def radix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int) -> torch.Tensor:
    """One attention layer, eager, with the current forward batch (writes its KV): straight
    to our backend's kernel where it serves the batch (`forward_paged`), else through
    SGLang's `RadixAttention.forward`."""
    layer = _LAYERS[index]
    if _WARMING:
        return q.new_zeros(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
    forward_batch, backend, out = get_forward_batch(), get_attn_backend(), None
    if isinstance(backend, DFlashCPUAttnBackend):
        out = backend.forward_paged(q, k, v, layer, forward_batch)
    if out is None:
        out = RadixAttention.forward(layer, q, k, v, forward_batch)
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
    return mode.is_decode() or mode.is_target_verify() or mode == ForwardMode.EXTEND


def pre_norm_layer(layer: torch.nn.Module, positions, hidden, residual):
    """One decoder layer as SGLang's Llama and DFlash layers compute it: norm, attention,
    norm, MLP, the residual adds fused into the norms. The forward batch reaches attention
    through the forward context, not the graph."""
    if residual is None:
        residual, hidden = hidden, layer.input_layernorm(hidden)
    else:
        hidden, residual = layer.input_layernorm(hidden, residual)
    hidden = layer.self_attn(positions=positions, hidden_states=hidden, forward_batch=None)
    hidden, residual = layer.post_attention_layernorm(hidden, residual)
    return layer.mlp(hidden), residual


def decoder_stack(body: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor):
    """`LlamaModel.forward` for one rank without SGLang's residual-stream bookkeeping.

    The same modules in the same order, final norm included, and the same captures: the
    residual stream entering each layer of `layers_to_capture`. The bookkeeping (layer
    boundaries, msgspec structs) is what torch.compile cannot trace.
    """
    hidden = body.embed_tokens(input_ids)
    residual = None
    aux = []
    for i, layer in enumerate(body.layers):
        if i in body.layers_to_capture:
            aux.append(hidden if residual is None else hidden + residual)
        hidden, residual = pre_norm_layer(layer, positions, hidden, residual)
    hidden, _ = body.norm(hidden, residual)
    return (hidden, aux) if aux else hidden


def draft_stack(model: torch.nn.Module, input_embeds: torch.Tensor, positions: torch.Tensor):
    """`DFlashDraftModel.forward` on the block's embeddings, as hidden states."""
    hidden, residual = input_embeds, None
    for layer in model.layers:
        hidden, residual = pre_norm_layer(layer, positions, hidden, residual)
    hidden, _ = model.norm(hidden, residual)
    return hidden


class _Stack(torch.nn.Module):
    """`stack(module, ...)` as a module that holds `module`: compiled as a module, its
    weights are attributes of the graph, which freezing needs to treat them as constants
    (compiling a function that reads them sees graph inputs, and packs nothing)."""

    def __init__(self, module: torch.nn.Module, stack) -> None:
        super().__init__()
        self.inner = module
        self.stack = stack

    def forward(self, *inputs: torch.Tensor):
        return self.stack(self.inner, *inputs)


def freeze(model: torch.nn.Module) -> bool:
    """`--dflash-cpu-freeze on`: the weights become constants of the compiled graphs, and
    inductor prepacks every linear's for oneDNN (`mkldnn._linear_pointwise`). At decode
    sizes a prepacked bf16 GEMM runs 1.5-2x faster than `mm` on the plain weight
    (`bench/packed_gemm.py`: a 3072x576 projection at one row, 0.038 vs 0.074 ms).

    Inductor reads `freezing` from its global config when it compiles (a per-compile
    `options` entry is ignored); our forwards are all this process compiles. The compiled
    forward then serves copies of the weights, so an online weight update would not reach
    it: `model` says so through SGLang's `_derived_weight_cache_error` seam, and every
    update path refuses before writing anything.
    """
    if os.environ.get(FREEZE_ENV, "off") != "on":
        return False
    torch._inductor.config.freezing = True
    model._derived_weight_cache_error = (
        "Online weight updates are not supported with --dflash-cpu-freeze on: the compiled "
        "CPU forward holds prepacked copies of the weights. Restart with "
        "--dflash-cpu-freeze off to update weights online."
    )
    return True


def bf16_packable() -> bool:
    """Whether oneDNN runs bf16 linears on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT).
    Without it `_reorder_linear_weight` raises on a bf16 weight, and inductor's freezing
    leaves bf16 linears unpacked."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _freeze_and_pack(model: torch.nn.Module, part: str, pack) -> str:
    """`freeze(model)`, and when frozen `pack()` its eager `part` too; what was done, as the
    compile log says it."""
    if not freeze(model):
        return ""
    dtype = next(model.parameters()).dtype
    if dtype == torch.bfloat16 and not bf16_packable():
        return ", weights frozen, not prepacked (no oneDNN bf16 on this CPU)"
    return ", weights prepacked" + (f", {part} prepacked" if pack() else "")


def _prepacked(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[out, in]` reordered once for oneDNN's linear, as freezing reorders the
    compiled layers' (`mkldnn._linear_pointwise` takes it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def pack_linear(linear: torch.nn.Module | None) -> bool:
    """Prepack an eager bf16 `nn.Linear` outside the compiled graphs (the drafter's `fc`,
    which projects the target's features for KV injection every step: at one row 0.7 ms
    of the 1.2 ms injection took in a py-spy sample of a plain-width step)."""
    if (
        type(linear) is not torch.nn.Linear
        or linear.weight.dtype != torch.bfloat16
        or not bf16_packable()
    ):
        return False
    packed, bias = _prepacked(linear.weight), linear.bias
    linear.forward = functools.partial(_packed_linear, packed=packed, bias=bias)
    return True


def pack_lm_head(model: torch.nn.Module) -> bool:
    """Prepack the LM head for oneDNN, as freezing packs the compiled layers: it runs
    eagerly in SGLang's logits processor after the compiled body, and at one row its
    plain `mm` takes ~2x the prepacked call (49152 x 576 bf16, `bench/packed_gemm.py`).
    `_packed_lm_head` uses the copy where the processor would run that plain matmul.
    bf16 only: there the result is the same to the bit; fp32 (MKL's sgemm, already fast)
    would round differently at one row and at several, and greedy ties could flip."""
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if (
        weight is None
        or type(getattr(head, "quant_method", None)) is not UnquantizedEmbeddingMethod
        or getattr(head, "bias", None) is not None
        or weight.dtype != torch.bfloat16
        or not bf16_packable()
    ):
        return False
    head.dflash_packed_weight = _prepacked(weight)
    return True


def _packed_lm_head(original, processor, hidden_states, lm_head, embedding_bias=None, **kw):
    """`LogitsProcessor._compute_lm_head` on a head `pack_lm_head` packed, in the case where
    SGLang computes `hidden @ weight.T` in the weight's dtype; every other case is SGLang's."""
    packed = getattr(lm_head, "dflash_packed_weight", None)
    if (
        packed is None
        or embedding_bias is not None
        or processor.use_fp32_lm_head
        or processor.rl_on_policy_target is not None
    ):
        return original(processor, hidden_states, lm_head, embedding_bias, **kw)
    return _packed_linear(hidden_states.to(lm_head.weight.dtype), packed, None)


class CompiledForward:
    """Stands in for a module's `forward`: a compiled stack for decode, verify and prefill batches,
    the module's own forward otherwise.

    Dynamo checks guards before every call of a compiled graph. Tracing SGLang's modules
    leaves ~7,000 of them on module attributes (types, ids, dict keys, flags, epsilons),
    1.1-1.5 ms of every one-request step in a py-spy sample, as much as the LM head. The
    modules are never reconfigured after start-up (the drafter's captures are set before
    the compile; weights are frozen or read as graph inputs, not guarded), so those
    guards are dropped (`skip_guard_on_all_nn_modules_unsafe`); the inputs' dtype, rank and
    token-count guards, which pick between the graphs, stay.
    """

    # Token counts compiled at start-up. Dynamo specialises a single token apart from the
    # rest, so a forward that can see one token compiles both.
    warm_tokens: tuple[int, ...] = (2, 1)
    # The grad mode the forward runs under when serving: Dynamo guards on it, so warming
    # up under another would leave a compile for the first step.
    grad_mode = torch.no_grad

    def __init__(self, module: torch.nn.Module, stack) -> None:
        self.eager = module.forward
        self.stack = _Stack(module, stack)
        self.fast = torch.compile(
            self.stack,
            dynamic=True,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )

    def warm_inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.zeros(n, dtype=torch.int64)
        return tokens, tokens.clone()

    def warm_up(self) -> None:
        """Compile the graphs before serving, with attention skipped (no KV is touched);
        otherwise a compile would stall a step, and the adaptive planner would take that
        step's seconds for what a step costs. One eager pass first: SGLang's modules pick
        their kernels on first call, a platform query Dynamo cannot trace.
        """
        global _WARMING
        _WARMING = True
        try:
            runs = [(self.stack, self.warm_tokens[0])]
            runs += [(self.fast, n) for n in self.warm_tokens]
            for run, n in runs:
                inputs = self.warm_inputs(n)  # made outside: inference tensors guard apart
                with self.grad_mode():
                    run(*inputs)
        finally:
            _WARMING = False

    def run_fast(self, inputs: torch.Tensor, positions: torch.Tensor, forward_batch):
        with self.grad_mode(), set_forward_batch(forward_batch):
            return self.fast(inputs, positions)


class CompiledBody(CompiledForward):
    """The target's `model.model.forward`."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__(body, decoder_stack)

    def __call__(self, input_ids, positions, forward_batch, *args, **kwargs):
        # Only input ids: embeddings or pipeline proxies from outside keep the eager path.
        plain = all(value is None for value in (*args, *kwargs.values()))
        if plain and compiled_modes(forward_batch):
            return self.run_fast(input_ids, positions, forward_batch)
        return self.eager(input_ids, positions, forward_batch, *args, **kwargs)


class CompiledDraft(CompiledForward):
    """The DFlash drafter's `forward`; its block (target-verify mode, B tokens per request,
    embedded by the worker) is never a single token."""

    warm_tokens = (2,)
    grad_mode = torch.inference_mode  # as the worker drafts

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, draft_stack)
        self.hidden_size = int(model.config.hidden_size)
        self.dtype = model.norm.weight.dtype

    def warm_inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = torch.zeros(n, self.hidden_size, dtype=self.dtype)
        return embeds, torch.zeros(n, dtype=torch.int64)

    def __call__(
        self,
        input_ids,
        positions,
        forward_batch,
        input_embeds=None,
        get_embedding: bool = False,
        pp_proxy_tensors=None,
    ):
        block = input_embeds is not None and input_embeds.shape[0] > 0
        if block and not get_embedding and pp_proxy_tensors is None:
            if forward_batch.forward_mode.is_target_verify():
                hidden = self.run_fast(input_embeds, positions, forward_batch)
                return LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden)
        return self.eager(
            input_ids, positions, forward_batch, input_embeds, get_embedding, pp_proxy_tensors
        )


def _one_rank() -> bool:
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size() == 1


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `decoder_stack` would not compute what `model`'s own forward computes, if so."""
    from sglang.srt.models.llama import LlamaDecoderLayer, LlamaModel

    body = getattr(model, "model", None)
    if type(body) is not LlamaModel:
        return f"{type(model).__name__}: only Llama-architecture targets"
    if not all(type(layer) is LlamaDecoderLayer for layer in body.layers):
        return f"{type(model).__name__}: a decoder layer other than Llama's"
    if not _one_rank() or body.pp_group.world_size != 1:
        return "tensor or pipeline parallelism (the stack does not reduce across ranks)"
    return None


def unsupported_draft(model: torch.nn.Module) -> str | None:
    """Why `draft_stack` would not compute what the drafter's own forward computes, if so."""
    from sglang.srt.models.dflash import DFlashDecoderLayer, DFlashDraftModel

    if type(model) is not DFlashDraftModel:
        return f"{type(model).__name__}: only SGLang's DFlashDraftModel"
    for layer in model.layers:
        if type(layer) is not DFlashDecoderLayer:
            return "a draft layer other than DFlashDecoderLayer"
        if layer.attention_conv is not None or layer.mlp_conv is not None:
            return "grouped-convolution draft layers"
        if layer.self_attn.v_scale is not None or layer.self_attn.attention_sink_bias is not None:
            return "value scaling or attention sinks"
    if not _one_rank():
        return "tensor parallelism (the stack does not reduce across ranks)"
    return None


def compile_target(model: torch.nn.Module) -> None:
    """Route `model`'s decode, verify and prefill forwards through inductor, where supported."""
    reason = unsupported(model)
    if reason is not None:
        logger.info("Target forward not compiled: %s", reason)
        return
    packed = _freeze_and_pack(model, "LM head", lambda: pack_lm_head(model))
    _adopt_layers(model.model)
    model.model.forward = CompiledBody(model.model)
    logger.info("Target forward: compiled (torch.compile, inductor%s)", packed)


def compile_draft(model: torch.nn.Module, layout: Any) -> None:
    """Route the drafter's block forward through inductor, where supported and switched on,
    and compile it now. Called by the DFlash workers once the draft model is ready (after
    its torch paths are set), under the draft's parallel `layout`: Dynamo guards on the
    parallel state, so a graph compiled outside it would be compiled again on first use.
    """
    from sglang.srt.speculative.spec_utils import draft_tp_context

    if os.environ.get(COMPILE_ENV, "off") != "on":
        return
    reason = unsupported_draft(model)
    if reason is not None:
        logger.info("Draft forward not compiled: %s", reason)
        return
    packed = _freeze_and_pack(model, "fc", lambda: pack_linear(getattr(model, "fc", None)))
    _adopt_layers(model)
    model.forward = compiled = CompiledDraft(model)
    start = time.perf_counter()
    with draft_tp_context(layout):
        compiled.warm_up()
    logger.info(
        "Draft block forward: compiled (torch.compile, inductor%s) in %.1f s",
        packed,
        time.perf_counter() - start,
    )


_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
_LM_HEAD = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"


def _after_load_model(result: Any, model_runner: Any, *args: Any, **kwargs: Any) -> Any:
    """The target only: the drafter is compiled by its worker (`compile_draft`)."""
    on = os.environ.get(COMPILE_ENV, "off") in ("on", "target")
    if on and not model_runner.is_draft_worker:
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


def register_hooks() -> None:
    """Called once per CPU process by the plugin, before SGLang applies plugin hooks."""
    from sglang.srt.plugins.hook_registry import HookType

    register_hook_once(f"{_RUNNER}.load_model", _after_load_model, HookType.AFTER)
    register_hook_once(f"{_RUNNER}.init_cuda_graphs", _after_init_cuda_graphs, HookType.AFTER)
    register_hook_once(_LM_HEAD, _packed_lm_head, HookType.AROUND)
