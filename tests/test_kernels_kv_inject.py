"""The stacked injections — `kernels.kv_inject` (Triton) and `kv_injection.inject_stacked`
(torch, CPU serving) — against `kv_injection.inject` on SGLang's own draft model and KV pool.

The draft is upstream's `DFlashDraftModel` with random weights, built inside a private
runtime context (tp=1); the pool is a real `MHATokenToKVPool` filled with noise (both from
`tests.draft_kv`). After the fused path, committed slots must match the torch path and
every other slot must be bit-identical to before. The `check_*` bodies take the device
first and run where the `kernel_runner` fixture sends them: interpreted on CPU, or
compiled on CUDA with DFLASH_KERNEL_DEVICE=cuda; the torch form runs in this process.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dflash_sglang.cpu_platform import install_sgl_kernel_shim

install_sgl_kernel_shim()  # the interpreter process imports this module without conftest

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.models.dflash import DFlashDraftModel  # noqa: E402
from sglang.srt.runtime_context import use_context  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

from dflash_sglang import kv_injection  # noqa: E402
from dflash_sglang.kernels import kv_inject  # noqa: E402
from tests.draft_kv import random_draft, random_pool, runtime  # noqa: E402

POOL_SLOTS = 300
LAYERS = 3
KV_HEADS, HEAD_DIM = 2, 16
# bf16: the torch path rounds after the GEMM, the norm and each RoPE product, the kernel
# once (truncating under the interpreter, to nearest on CUDA): a few ulps apart.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2e-2)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = {
    "qwen3": ({}, {}),
    # Partial rotary (the tail is normed only) and a drafter value scale.
    "partial_rope_vscale": ({"partial_rotary_factor": 0.5}, {"attention_value_scale": 0.5}),
}


@functools.cache
def make_draft(variant: str, dtype: torch.dtype, device: torch.device) -> DFlashDraftModel:
    config_extra, dflash_extra = VARIANTS[variant]
    config = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=512,
        max_position_embeddings=4096,
        rope_theta=100000.0,
    )
    for key, value in {"num_target_layers": 4, "block_size": 16, **config_extra}.items():
        setattr(config, key, value)
    config.dflash_config = {"mask_token_id": 3, "target_layer_ids": [0, 2], **dflash_extra}
    return random_draft(config, dtype, device)


@pytest.fixture(params=["triton", "torch"])
def run_stacked(request):
    """Run a `check_injected` case with the Triton kernel (where `kernel_runner` sends it) or
    with its torch form, in this process on CPU."""
    if request.param == "triton":
        return request.getfixturevalue("kernel_runner")
    return lambda fn, *args: fn(torch.device("cpu"), *args, "torch")


def make_pool(dtype: torch.dtype, seed: int, device: torch.device) -> MHATokenToKVPool:
    return random_pool(POOL_SLOTS, dtype, KV_HEADS, HEAD_DIM, LAYERS, device, seed)


def buffers(pool: MHATokenToKVPool) -> list[torch.Tensor]:
    return [*pool.k_buffer, *pool.v_buffer]


def make_rows(bs: int, block: int, seed: int):
    """Random features, positions after a random prefix, distinct slots and commit lengths."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(bs * block, 2 * 64, generator=gen)
    prefix = torch.randint(0, 3000, (bs, 1), generator=gen)
    positions = (prefix + torch.arange(block)).view(-1)
    cache_loc = torch.randperm(POOL_SLOTS, generator=gen)[: bs * block] + 1  # slot 0 is padding
    commit_lens = torch.randint(0, block + 1, (bs,), generator=gen, dtype=torch.int32)
    return hidden, positions, cache_loc, commit_lens


def stacked_injection(impl: str):
    return {"triton": kv_inject.inject_committed, "torch": kv_injection.inject_stacked}[impl]


def check_injected(
    device: torch.device,
    variant: str,
    dtype_name: str,
    rows,
    commit_lens,
    block: int,
    impl: str = "triton",
) -> None:
    """Stacked vs per-layer injection into two identical pools."""
    dtype = DTYPES[dtype_name]
    model = make_draft(variant, dtype, device)
    hidden, positions, cache_loc = (t.to(device) for t in rows)
    hidden = hidden.to(dtype)
    if commit_lens is not None:
        commit_lens = commit_lens.to(device)
    reference, fused = make_pool(dtype, 0, device), make_pool(dtype, 0, device)
    before = [b.clone() for b in buffers(fused)]
    with use_context(runtime()), torch.inference_mode():
        ok, reason = kv_injection.can_stack(model, fused)
        assert ok, reason
        kv_inject.inject_committed_reference(
            model, reference, hidden, positions, cache_loc, commit_lens
        )
        stacked = kv_injection.stack_kv_weights(model)
        inject = stacked_injection(impl)
        inject(model, stacked, fused, hidden, positions, cache_loc, commit_lens)
    if commit_lens is None:
        written = cache_loc
    else:
        written = cache_loc[kv_injection.committed_rows(commit_lens, block)]
    untouched = torch.ones(POOL_SLOTS + 1, dtype=torch.bool, device=device)
    untouched[written] = False
    for i, (ref, out, old) in enumerate(
        zip(buffers(reference), buffers(fused), before, strict=True)
    ):
        what = f"{'KV'[i // LAYERS]} layer {i % LAYERS}"
        assert torch.equal(out[untouched], old[untouched]), f"{what}: an unwritten slot changed"
        assert torch.equal(ref[untouched], old[untouched]), f"{what}: reference wrote elsewhere"
        torch.testing.assert_close(
            out[written], ref[written], **TOLERANCE[dtype], msg=lambda m, what=what: f"{what}: {m}"
        )


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(
    "bs, block, seed", [(1, 1, 0), (3, 4, 1), (5, 8, 2), (2, 16, 3), (6, 16, 4)]
)
def test_committed_rows_match_torch(run_stacked, variant, dtype, bs, block, seed):
    hidden, positions, cache_loc, commit_lens = make_rows(bs, block, seed)
    rows = (hidden, positions, cache_loc)
    run_stacked(check_injected, variant, dtype, rows, commit_lens, block)


def test_every_commit_length(run_stacked):
    """One request per commit length 0..B in one batch."""
    block = 8
    hidden, positions, cache_loc, _ = make_rows(block + 1, block, seed=5)
    commit_lens = torch.arange(block + 1, dtype=torch.int32)
    rows = (hidden, positions, cache_loc)
    run_stacked(check_injected, "qwen3", "fp32", rows, commit_lens, block)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_prefill_writes_every_row(run_stacked, dtype):
    hidden, positions, cache_loc, _ = make_rows(1, 37, seed=6)
    rows = (hidden, positions, cache_loc)
    run_stacked(check_injected, "partial_rope_vscale", dtype, rows, None, 37)


def check_can_fuse_explains_a_mismatched_pool(device: torch.device) -> None:
    pool = random_pool(8, torch.float32, KV_HEADS, 2 * HEAD_DIM, LAYERS, device, seed=0)
    verdict = kv_injection.can_stack(make_draft("qwen3", torch.float32, device), pool)
    assert verdict == (False, "pool head shape differs from the draft's"), verdict


def test_can_fuse_explains_a_mismatched_pool(kernel_runner):
    kernel_runner(check_can_fuse_explains_a_mismatched_pool)


def check_rows_are_validated(device: torch.device) -> None:
    hidden, positions, cache_loc, commit_lens = (t.to(device) for t in make_rows(2, 4, seed=8))
    model = make_draft("qwen3", torch.float32, device)
    stacked = kv_injection.stack_kv_weights(model)
    pool = make_pool(torch.float32, 0, device)
    with pytest.raises(ValueError, match="commit_lens"):
        kv_inject.inject_committed(
            model, stacked, pool, hidden, positions, cache_loc, commit_lens.repeat(3)
        )
    with pytest.raises(ValueError, match="target_hidden"):
        kv_inject.inject_committed(model, stacked, pool, hidden[:-1], positions, cache_loc)


def test_rows_are_validated(kernel_runner):
    kernel_runner(check_rows_are_validated)
