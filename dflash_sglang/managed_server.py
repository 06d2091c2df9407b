"""Our launcher as a child process on a free loopback port: for data generation and tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scheduler_processes(pid: int) -> list[psutil.Process]:
    """The `sglang::scheduler` processes below a launcher process."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith("sglang::scheduler"):
                found.append(child)
        except psutil.Error:  # exited while we looked
            pass
    return found


class Server:
    """`python -m dflash_sglang.launch_server ARGS` on a free loopback port."""

    def __init__(self, args: list[str], log_path: Path, threads: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), SGLANG_CPU_OMP_THREADS_BIND="all")
        cmd = [sys.executable, "-m", "dflash_sglang.launch_server", "--port", str(self.port), *args]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"server not ready in {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def generate(
        self,
        text: str | None = None,
        input_ids: list[int] | None = None,
        request: dict | None = None,
        **sampling,
    ):
        """POST /generate; `sampling` goes to sampling_params, `request` to the top level."""
        body = {"sampling_params": {"temperature": 0, **sampling}, **(request or {})}
        body |= {"text": text} if input_ids is None else {"input_ids": input_ids}
        r = requests.post(self.url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
