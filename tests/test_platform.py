"""Platform decisions: one seam for device-dependent choices, and the GPU stack importable."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash_sglang import platform
from dflash_sglang.cpu_platform import attention


@pytest.mark.parametrize(
    ("device", "expected"),
    [("cpu", platform.CPU), ("cuda", platform.CUDA), ("cuda:1", platform.CUDA)],
)
def test_device_strings_map_to_platforms(device, expected):
    assert platform.for_device(device) is expected


@pytest.mark.parametrize("device", ["xpu", "", None])
def test_unknown_devices_name_the_flag(device):
    with pytest.raises(ValueError, match="--device"):
        platform.for_device(device)


def test_cpu_backend_name_is_defined_once():
    assert attention.CPU_ATTENTION_BACKEND is platform.CPU_ATTENTION_BACKEND
    assert platform.CPU.attention_backend == "dflash_cpu"
    assert not platform.CPU.overlap_schedule and platform.CUDA.overlap_schedule


def test_flashinfer_imports():
    """The GPU draft attention needs it; it must import even where it cannot run."""
    code = "import flashinfer, flashinfer.cascade; print(flashinfer.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_cpu_times_the_draft_forward_on_the_host_and_cuda_with_events():
    timer = platform.CPU.start_timer()
    assert timer.seconds() is None  # not stopped: nothing to report
    sum(range(10000))
    timer.stop()
    assert 0.0 < timer.seconds() < 5.0
    assert platform.CUDA.start_timer is platform.CudaTimer
