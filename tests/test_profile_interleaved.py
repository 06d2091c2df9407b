"""`bench/profile_interleaved.py`: per-function ms per step from py-spy's raw stacks, and
its argument checks (before any server starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _function_ms():
    sys.path.insert(0, str(BENCH))
    from profile_interleaved import function_ms

    return function_ms


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
    ms = _function_ms()(lines, steps=4)
    # 200 Hz: 5 ms a sample
    assert ms["Scheduler.run_batch (scheduler.py)"] == pytest.approx(40 * 5 / 4)
    assert ms["ModelRunner.forward (model_runner.py)"] == pytest.approx(40 * 5 / 4)
    assert ms["f (m.py)"] == pytest.approx(20 * 5 / 4)
    assert "Worker.loop (w.py)" not in ms


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
