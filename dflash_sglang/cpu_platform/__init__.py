"""CPU platform layer: what SGLang needs to serve DFLASH_X on a machine without a GPU.

Active only on CPU. Pieces:
- `shim/sgl_kernel`: stands in for the CPU sgl-kernel build (not on PyPI) when none is installed;
  spawned SGLang children get it through PYTHONPATH, set by `child_environment`.
- `attention`: an attention backend for extend, decode, target verify and the non-causal
  draft block over SGLang's paged KV pool.
- `triton_fallbacks`: torch versions of the Triton kernels the DFlash path calls, so no
  Triton interpreter runs on the serving hot path.
- `upstream_dflash`: SGLang's own `--speculative-algorithm DFLASH` on CPU, for comparison.
- `compiled`: the target's decode/verify/prefill forwards and the drafter's block forward
  through torch.compile.
And, per process, a cache in front of CPython's arena allocator (`kernels.arena_cache`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

SHIM_DIR = Path(__file__).resolve().parent / "shim"
# `--dflash-cpu-compile` (on | target | off) as the launcher hands it to the schedulers.
COMPILE_ENV = "DFLASH_SGLANG_CPU_COMPILE"
# `--dflash-cpu-freeze` (on | off), likewise.
FREEZE_ENV = "DFLASH_SGLANG_CPU_FREEZE"
# `--dflash-cpu-attention` (grouped | sdpa), likewise.
ATTENTION_ENV = "DFLASH_SGLANG_CPU_ATTENTION"
# `--dflash-cpu-arena-cache` (on | off), likewise.
ARENA_CACHE_ENV = "DFLASH_SGLANG_CPU_ARENA_CACHE"


def real_sgl_kernel_installed() -> bool:
    """True when an sgl_kernel other than our shim is importable."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        return False
    return not Path(spec.origin).resolve().is_relative_to(SHIM_DIR)


def child_environment(env: dict[str, str]) -> dict[str, str]:
    """Environment for SGLang processes on CPU: CPU engine on, shim on PYTHONPATH if needed."""
    env = dict(env)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    if not real_sgl_kernel_installed():
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(SHIM_DIR) not in parts:
            env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), *parts])
    return env


def install_sgl_kernel_shim() -> None:
    """Make the shim importable in this process (tests, the launcher's own process)."""
    if not real_sgl_kernel_installed() and str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))


_original_record_stream = torch.Tensor.record_stream


def _record_stream(tensor: torch.Tensor, stream) -> None:
    # Stream bookkeeping is meaningless for host memory; CUDA tensors keep the real call.
    if tensor.device.type == "cpu":
        return None
    return _original_record_stream(tensor, stream)


def register_hook_once(target: str, hook, hook_type) -> None:
    """Register `hook` on `target` in SGLang's plugin `HookRegistry` unless it already is
    (the plugin may run more than once per process)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    if all(registered is not hook for _, registered, _ in HookRegistry._hooks.get(target, [])):
        HookRegistry.register(target, hook, hook_type)


def activate() -> None:
    """Per-process CPU patches; idempotent. Called by the plugin in every SGLang process."""
    from dflash_sglang.cpu_platform import compiled, upstream_dflash

    torch.Tensor.record_stream = _record_stream
    if os.environ.get(ARENA_CACHE_ENV, "off") == "on":
        from dflash_sglang.kernels import arena_cache

        arena_cache.install()
    upstream_dflash.register_hooks()
    compiled.register_hooks()
