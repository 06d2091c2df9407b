"""`ManagedProcess`: a benchmark's idle servers paused as whole trees; a start that is
interrupted leaves no process behind."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest

from dflash_sglang.managed_server import ManagedProcess, free_port, paused

# A parent that starts a child (as a launcher starts its scheduler) and both sleep.
TREE = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"  # noqa: E501


def tree_states(process: ManagedProcess) -> set[str]:
    root = psutil.Process(process.proc.pid)
    return {p.status() for p in [root, *root.children(recursive=True)]}


def settled(process: ManagedProcess, stopped: bool, timeout_s: float = 10.0) -> set[str]:
    """The tree's states once every process is stopped (or none is): signals land
    asynchronously, so a state read right after `kill` may still be the old one."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = tree_states(process)
        done = states == {psutil.STATUS_STOPPED} if stopped else psutil.STATUS_STOPPED not in states
        if done or time.monotonic() > deadline:
            return states
        time.sleep(0.02)


def test_paused_stops_each_whole_tree_and_resumes_it(tmp_path: Path) -> None:
    procs = [
        ManagedProcess([sys.executable, "-c", TREE], tmp_path / f"{i}.log", free_port(), wait=False)
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 30
        while any(len(psutil.Process(p.proc.pid).children()) < 1 for p in procs):
            assert time.monotonic() < deadline, "children did not start"
            time.sleep(0.05)
        with paused(procs[:1]):
            assert settled(procs[0], stopped=True) == {psutil.STATUS_STOPPED}
            assert psutil.STATUS_STOPPED not in tree_states(procs[1])
        assert psutil.STATUS_STOPPED not in settled(procs[0], stopped=False)
        assert all(p.alive() for p in procs)
    finally:
        for p in procs:
            p.stop()
    assert not any(p.alive() for p in procs)


def test_an_interrupted_start_stops_the_process(tmp_path: Path) -> None:
    """SIGTERM (as SystemExit) or Ctrl-C while waiting for readiness: the constructor
    raises before its caller holds the process, so the wait itself must stop it (a
    `generate` stopped during its server's start left that server running)."""
    started: list[ManagedProcess] = []

    class Interrupted(ManagedProcess):
        def start(self) -> None:
            super().start()
            started.append(self)

        def ready(self) -> bool:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Interrupted([sys.executable, "-c", TREE], tmp_path / "s.log", free_port())
    assert started and not started[0].alive()
