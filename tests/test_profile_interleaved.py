"""`bench/profile_interleaved.py`: per-function ms per step from py-spy's raw stacks, and
its argument checks (before any server starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _module():
    sys.path.insert(0, str(BENCH))
    import profile_interleaved

    return profile_interleaved


def test_function_ms_counts_the_event_loop_thread_inclusively_per_step():
    loop = "Thread 1 (active)"
    lines = [
        # 40 samples in the forward, 20 of them inside a recursive helper (counted once)
        f"{loop};Scheduler.run_event_loop (scheduler.py:10);Scheduler.run_batch "
        "(scheduler.py:20);ModelRunner.forward (model_runner.py:30) 20",
        f"{loop};Scheduler.run_event_loop (scheduler.py:10);Scheduler.run_batch "
        "(scheduler.py:21);ModelRunner.forward (model_runner.py:31);f (m.py:1);f (m.py:2) 20",
        # another thread's samples stay out
        "Thread 2 (idle);Worker.loop (w.py:5);ModelRunner.forward (model_runner.py:30) 99",
    ]
    ms = _module().function_ms(lines, steps=4)
    # 200 Hz: 5 ms a sample
    assert ms["Scheduler.run_batch (scheduler.py)"] == pytest.approx(40 * 5 / 4)
    assert ms["ModelRunner.forward (model_runner.py)"] == pytest.approx(40 * 5 / 4)
    assert ms["f (m.py)"] == pytest.approx(20 * 5 / 4)
    assert "Worker.loop (w.py)" not in ms


def test_timed_calls_summarise_full_batch_calls_per_label():
    lines = [
        "attention 16 1600 16 160000",  # 160 us over 1,600 keys
        "attention 16 800 16 120000",
        "attention 16 800 16 80000",
        "attention 3 90 3 5000",  # a ramp-up batch: left out
        "CompiledBody 16 700 16 30000000",
        "CompiledBody 16 700 32 36000000",  # a verify of width 2: its own entry
        "worker.verify 16 700 64 40000000",
        "CompiledBody.prefill 16 900 1200 90000000",  # prompts' tokens: no width
        "CompiledBody.prefill 16 900 1300 110000000",
        "",
    ]
    summary = _module().timed_calls(lines, batch=16)
    attention = summary["attention"]
    assert attention["calls"] == 3
    assert attention["mean_us"] == pytest.approx(120.0)
    assert attention["median_us"] == pytest.approx(120.0)
    assert attention["ns_per_key"] == pytest.approx(360000 / 3200)
    assert attention["keys_per_call"] == pytest.approx(3200 / 3)
    assert summary["CompiledBody"]["mean_us"] == pytest.approx(30000.0)
    assert summary["CompiledBody w2"]["mean_us"] == pytest.approx(36000.0)
    assert summary["worker.verify w4"]["calls"] == 1
    assert summary["CompiledBody.prefill"]["mean_us"] == pytest.approx(100000.0)
    assert _module().timed_calls(lines, batch=8) == {}


def test_the_call_timer_wraps_the_kernel_when_imported_and_writes_its_calls(tmp_path):
    """The timer as the servers load it: a fresh interpreter with it on PYTHONPATH; the
    kernel's module is imported after start-up, as in a server."""
    script = (
        "import sys, torch\n"
        "assert 'dflash_sglang.kernels.cpu_attention' not in sys.modules\n"
        "from dflash_sglang.kernels import cpu_attention as m\n"
        "if not m.available():\n"
        "    raise SystemExit(3)\n"
        "q = torch.randn(2, 4, 64)\n"
        "k = torch.randn(10, 2, 64)\n"
        "slots = torch.arange(10).view(2, 5)\n"
        "lens = torch.tensor([5, 4])\n"
        "ones = torch.ones(2, dtype=torch.long)\n"
        "starts = torch.arange(2)\n"
        "out = m.paged_attention(q, k, k, slots, lens, ones, starts, True, 0.125)\n"
        "ref = m.torch_paged_attention(q, k, k, slots, lens, ones, starts, True, 0.125)\n"
        "assert torch.allclose(out, ref, atol=1e-4)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(BENCH / "call_timer"),
           "DFLASH_CALL_TIMES": str(tmp_path)}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    if done.returncode == 3:
        pytest.skip("the C++ kernel cannot be built here")
    assert done.returncode == 0, done.stderr
    (written,) = tmp_path.glob("*.txt")
    label, requests, keys, rows, ns = written.read_text().split()
    assert (label, requests, keys, rows) == ("attention", "2", "9", "2") and int(ns) > 0


def test_the_call_timer_times_worker_phases_that_exist():
    """A renamed worker method would leave its phase untimed without a word."""
    import importlib.util

    from dflash_sglang.worker import DFlashXWorker

    path = BENCH / "call_timer" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("timer", path)
    timer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timer)  # DFLASH_CALL_TIMES unset: no import hook installed
    for name in (*timer.WORKER_PHASES, "decode_step"):
        assert callable(getattr(DFlashXWorker, name)), name
    # Timed inside a drafting step, looked up where the worker finds them.
    from sglang.srt.models.dflash import DFlashDraftModel

    from dflash_sglang import worker

    assert callable(worker.draft_vocab.select_extended)
    assert callable(DFlashDraftModel.project_target_hidden)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--arms", "plain"], "--arms: two or more"),
        (["--arms", "plain,plain"], "--arms: two or more"),
        (["--arms", "plain,nope"], "--arms: two or more"),
        (["--slice", "0"], "must be positive"),
    ],
)
def test_bad_arguments_name_the_flag(args, message):
    done = subprocess.run(
        [sys.executable, str(BENCH / "profile_interleaved.py"), *args],
        capture_output=True,
        text=True,
        cwd=BENCH,
    )
    assert done.returncode == 2
    assert message in done.stderr
