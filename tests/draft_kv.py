"""Upstream's `DFlashDraftModel` with random weights and a real `MHATokenToKVPool`, no server.

Shared by the injection kernel tests (tiny shapes, CPU or CUDA) and
`bench/bench_kernels_gpu.py` (Qwen3-8B-like shapes on CUDA), so both drive the kernels
through the same SGLang objects.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from dflash_sglang.cpu_platform import install_sgl_kernel_shim

install_sgl_kernel_shim()  # the interpreter process imports this module without conftest

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.model_loader.utils import set_default_torch_dtype  # noqa: E402
from sglang.srt.models.dflash import DFlashDraftModel  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, create_context, use_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402


@functools.cache
def runtime():
    """SGLang's layers read tp size/rank from a runtime context; a private one, tp=1."""
    args = ServerArgs(model_path="dummy", device="cpu")
    context = create_context(args, role="test", ranks=SpawnRanks(world_rank=0))
    with use_context(context):
        group = SimpleNamespace(rank_in_group=0, world_size=1)
        context.parallel.override_permanently(tp_group=group, attn_tp_group=group)
    return context


def random_draft(
    config, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> DFlashDraftModel:
    """A `DFlashDraftModel` for `config` (its `dflash_config` set) in `dtype` on `device`.

    Built under `dtype` as default, as SGLang's loader builds it: buffers get the dtype SGLang
    gives them (RoPE's cos/sin cache stays float32 on CUDA), and models of different dtypes
    do not share a cached RoPE module. Weights are N(0, 0.2²) and norm weights
    1 + N(0, 0.3²), drawn in float32 on `device`, so norms and RoPE see values far from 0, 1.
    """
    with torch.device(device), set_default_torch_dtype(dtype), use_context(runtime()):
        model = DFlashDraftModel(config)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, device=device)
            param.copy_(1 + 0.3 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model


def random_pool(
    slots: int,
    dtype: torch.dtype,
    kv_heads: int,
    head_dim: int,
    layers: int,
    device: torch.device,
    seed: int,
) -> MHATokenToKVPool:
    """A page-size-1 pool of `slots` slots (plus padding slot 0), filled with noise."""
    pool = MHATokenToKVPool(
        size=slots,
        page_size=1,
        dtype=dtype,
        head_num=kv_heads,
        head_dim=head_dim,
        layer_num=layers,
        device=str(device),
        enable_memory_saver=False,
    )
    gen = torch.Generator(device).manual_seed(seed)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=gen, device=device))
    return pool
