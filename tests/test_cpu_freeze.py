"""`--dflash-cpu-freeze`: what it switches on, and the LM head's prepacked path (the compiled
layers' packing is inductor's, checked end to end against SGLang's own forward in
test_server_lossless)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

from dflash_sglang.cpu_platform import FREEZE_ENV, compiled


def _processor(**changes) -> SimpleNamespace:
    return SimpleNamespace(**{"use_fp32_lm_head": False, "rl_on_policy_target": None, **changes})


def _head(dtype: torch.dtype = torch.bfloat16, vocab: int = 300) -> torch.nn.Module:
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(torch.randn(vocab, 64, dtype=dtype), requires_grad=False)
    head.quant_method = UnquantizedEmbeddingMethod()
    return head


def _sglang(*_args, **_kwargs) -> str:
    return "sglang"


packable = pytest.mark.skipif(
    not compiled.bf16_packable(), reason="no oneDNN bf16 on this CPU (AVX-512 or AVX-NE-CONVERT)"
)


def test_freeze_follows_the_flag(monkeypatch):
    # `config.patch` restores the setting; monkeypatch would delete it (not in __dict__).
    with torch._inductor.config.patch(freezing=False):
        model = torch.nn.Linear(2, 2)
        monkeypatch.setenv(FREEZE_ENV, "off")
        assert not compiled.freeze(model)
        assert not torch._inductor.config.freezing
        assert getattr(model, "_derived_weight_cache_error", None) is None
        monkeypatch.setenv(FREEZE_ENV, "on")
        assert compiled.freeze(model)
        assert torch._inductor.config.freezing
        assert "--dflash-cpu-freeze off" in model._derived_weight_cache_error


@packable
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_packed_lm_head_is_the_plain_matmul_to_the_bit(rows):
    model = SimpleNamespace(lm_head=_head())
    assert compiled.pack_lm_head(model)
    hidden = torch.randn(rows, 64, dtype=torch.bfloat16)

    def fell_back(*_args, **_kwargs):
        raise AssertionError("a packed bf16 head fell back to SGLang's matmul")

    got = compiled._packed_lm_head(fell_back, _processor(), hidden, model.lm_head)
    assert torch.equal(got, hidden @ model.lm_head.weight.T)


@packable
def test_heads_and_cases_it_does_not_cover_stay_sglangs():
    fp32 = SimpleNamespace(lm_head=_head(torch.float32))
    assert not compiled.pack_lm_head(fp32)  # MKL's sgemm: rounding differs by row count
    quantized = SimpleNamespace(lm_head=_head())
    quantized.lm_head.quant_method = object()
    assert not compiled.pack_lm_head(quantized)
    assert not compiled.pack_lm_head(SimpleNamespace())

    packed = SimpleNamespace(lm_head=_head())
    assert compiled.pack_lm_head(packed)
    hidden = torch.randn(2, 64, dtype=torch.bfloat16)
    head = packed.lm_head
    bias = torch.zeros(300)
    assert compiled._packed_lm_head(_sglang, _processor(), hidden, fp32.lm_head) == "sglang"
    assert compiled._packed_lm_head(_sglang, _processor(), hidden, head, bias) == "sglang"
    fp32_head = _processor(use_fp32_lm_head=True)
    assert compiled._packed_lm_head(_sglang, fp32_head, hidden, head) == "sglang"
    on_policy = _processor(rl_on_policy_target="fsdp")
    assert compiled._packed_lm_head(_sglang, on_policy, hidden, head) == "sglang"


@packable
def test_a_packed_linear_computes_what_it_did():
    linear = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    before = linear(x)
    assert compiled.pack_linear(linear)
    assert torch.equal(linear(x), before)  # leading dims kept, bit for bit
    biased = torch.nn.Linear(64, 48).to(torch.bfloat16)
    rows = torch.randn(3, 64, dtype=torch.bfloat16)
    before = biased(rows)
    assert compiled.pack_linear(biased)
    torch.testing.assert_close(biased(rows), before)


def test_linears_it_does_not_cover_stay_as_they_are():
    fp32 = torch.nn.Linear(8, 8)
    forward = fp32.forward
    assert not compiled.pack_linear(fp32)
    assert fp32.forward == forward
    assert not compiled.pack_linear(None)
    assert not compiled.pack_linear(torch.nn.Identity())


def test_without_onednn_bf16_nothing_is_packed_and_the_log_says_so(monkeypatch):
    # oneDNN's bf16 reorder raises on such a CPU (AVX2 only): the server must still start.
    monkeypatch.setattr(compiled, "bf16_packable", lambda: False)
    monkeypatch.setenv(FREEZE_ENV, "on")
    model = SimpleNamespace(lm_head=_head())
    assert not compiled.pack_lm_head(model)
    assert not hasattr(model.lm_head, "dflash_packed_weight")
    linear = torch.nn.Linear(8, 8).to(torch.bfloat16)
    forward = linear.forward
    assert not compiled.pack_linear(linear)
    assert linear.forward == forward

    def pack() -> bool:
        raise AssertionError("packed without oneDNN bf16")

    with torch._inductor.config.patch(freezing=False):
        said = compiled._freeze_and_pack(linear, "fc", pack)
        assert torch._inductor.config.freezing
    assert said == ", weights frozen, not prepacked (no oneDNN bf16 on this CPU)"
    with torch._inductor.config.patch(freezing=False):
        fp32 = torch.nn.Linear(8, 8)
        assert compiled._freeze_and_pack(fp32, "fc", lambda: False) == ", weights prepacked"


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.double = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if self.double else x


def _scaled_stack(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def test_compiled_forwards_keep_input_guards_and_drop_module_guards():
    """Module attributes are read once, at compile: a change after it is not seen (the
    guards that would notice it cost ~1 ms a step); the inputs still pick the graph."""
    torch._dynamo.reset()
    module = _Scaled()
    forward = compiled.CompiledForward(module, _scaled_stack)
    x = torch.ones(3)
    assert torch.equal(forward.fast(x), x * 2)
    module.double = False
    assert torch.equal(forward.fast(x), x * 2)  # no guard on the flag, no recompile
    assert torch.equal(forward.fast(x.double()), x.double())  # a new dtype: a new graph
