from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
if not torch.cuda.is_available():  # on a GPU the suite runs SGLang's CUDA engine
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from dflash_sglang.cpu_platform import install_sgl_kernel_shim  # noqa: E402

install_sgl_kernel_shim()

from tests.fixtures import (  # noqa: E402
    make_tiny_draft,
    make_tiny_target,
    steer_token_zero,
    zero_final_norm,
)
from tests.server import PURE_DFLASH, Server  # noqa: E402


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    target = make_tiny_target(root / "target")
    return {
        "target": target,
        "draft": make_tiny_draft(target, root / "draft", block_size=4, num_layers=1),
        "draft2": make_tiny_draft(
            target, root / "draft2", block_size=8, num_layers=2, target_layer_ids=[0, 2]
        ),
    }


@pytest.fixture(scope="session")
def echo_models(tmp_path_factory) -> dict[str, Path]:
    """A target/draft pair that agrees on every token: acceptance is exactly full."""
    root = tmp_path_factory.mktemp("echo")
    target = zero_final_norm(make_tiny_target(root / "target"), "model.norm.weight")
    draft = zero_final_norm(make_tiny_draft(target, root / "draft", block_size=4), "norm.weight")
    return {"target": target, "draft": draft}


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> tuple[Path, list[str]]:
    """The embedded default target, really converted once per session into a private cache."""
    from dflash_sglang import default_model

    logs: list[str] = []
    root = tmp_path_factory.mktemp("cache")
    return default_model.ensure_default_target(root, log=logs.append), logs


@pytest.fixture(scope="session")
def half_models(tmp_path_factory) -> dict[str, Path]:
    """A pair whose acceptance is partial and varies by prompt and position (block 8)."""
    root = tmp_path_factory.mktemp("half")
    # Heads of 16: the steering scale below was tuned for that model's random weights.
    target = make_tiny_target(root / "target", head_dim=16)
    target = steer_token_zero(zero_final_norm(target, "model.norm.weight"), scale=8.0)
    return {"target": target, "draft": make_tiny_draft(target, root / "draft", block_size=8)}


def _half_server(half_models, tmp_path_factory, name: str, extra: list[str]):
    args = ["--model-path", str(half_models["target"]), "--dtype", "float32"]
    server = Server(
        [*args, "--max-total-tokens", "8192", *extra],
        tmp_path_factory.mktemp(f"{name}_logs") / f"{name}.log",
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def live_dflash(half_models, tmp_path_factory):
    """One DFLASH_X server (metrics on, whole block every step) shared by every test that
    only reads from it."""
    draft = ["--speculative-draft-model-path", str(half_models["draft"]), *PURE_DFLASH]
    yield from _half_server(half_models, tmp_path_factory, "live_dflash", draft)


@pytest.fixture(scope="session")
def live_ar(half_models, tmp_path_factory):
    """The same target without speculation: the baseline beside `live_dflash`."""
    no_spec = ["--speculative-algorithm", "NONE"]
    yield from _half_server(half_models, tmp_path_factory, "live_ar", no_spec)


@pytest.fixture(scope="session")
def interpret():
    """Call a test module's function with Triton interpreting kernels on CPU.

    TRITON_INTERPRET is read when `triton.language` is imported (its own reductions are
    `@triton.jit` functions), and conftest's SGLang import loaded Triton long before, so
    calls go to one fresh spawned process that imports everything with the variable set.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if _interpreting():  # this process was started interpreting
        yield lambda fn, *args: fn(*args)
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        worker = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        worker.submit(int).result()  # spawn it now, while the variable is set
    with worker:
        yield lambda fn, *args: worker.submit(fn, *args).result()


@pytest.fixture(scope="session")
def kernel_runner(request):
    """Call a kernel test's `check_*(device, *args)` where DFLASH_KERNEL_DEVICE says.

    `cpu` (the default): Triton interprets the kernels, in the `interpret` process.
    `cuda`: compiled kernels on the GPU, in this process; skipped without a CUDA device.
    The variable is read here only: the bodies build their tensors on the device they get.
    """
    device = os.environ.get("DFLASH_KERNEL_DEVICE", "cpu")
    if device == "cpu":
        run = request.getfixturevalue("interpret")
        yield lambda fn, *args: run(fn, torch.device("cpu"), *args)
        return
    if device != "cuda":
        raise pytest.UsageError(f"DFLASH_KERNEL_DEVICE must be cpu or cuda, got {device!r}")
    if not torch.cuda.is_available():
        pytest.skip("DFLASH_KERNEL_DEVICE=cuda but torch sees no CUDA device")
    if _interpreting():
        raise pytest.UsageError("DFLASH_KERNEL_DEVICE=cuda compiles kernels: drop TRITON_INTERPRET")
    yield lambda fn, *args: fn(torch.device("cuda"), *args)


def _interpreting() -> bool:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)
