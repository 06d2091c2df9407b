"""N DFLASH_X replicas behind SGLang's router on one host: `python -m dflash_sglang.cluster`.

    python -m dflash_sglang.cluster --replicas 2 [--port 30000] [--policy cache_aware] \\
        [launcher args for every replica...]

Replica i listens on `--port + 1 + i`, the router on `--port`, the router's Prometheus
exporter on `--port + 1 + N`. Each replica is our launcher (its own `/metrics`,
`/dflash/stats`, status page) with a KV pool sized for 1/N of the host
(`DFLASH_HOST_REPLICAS`); on CUDA replica i takes GPU i. The router is `sglang-router`
(Rust; cache-aware routing by default) — no routing of ours.

A supervisor, not a fire-and-forget script: a replica that exits is taken out of the router
at once (a thread waits on its process, so no request is sent to it after it is gone; the
router's own health checks would take ~1 s), restarted on its port and added back once it
answers; a router that exits is restarted. SIGINT/SIGTERM stops the router first, then
every replica, each with its whole process tree.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import requests

from dflash_sglang import platform
from dflash_sglang.launch_server import flag_value, has_flag
from dflash_sglang.managed_server import ManagedProcess, Server

logger = logging.getLogger("dflash_sglang.cluster")

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
RESTART_BACKOFF_S = 2.0
# The router's own health checks, a fallback behind the supervisor's watchers (replicas
# outside its control): a dead replica is out after ~1-2 s, back ~1 s after it answers.
ROUTER_HEALTH = {"health_check_interval_secs": 1, "health_failure_threshold": 2,
                 "health_success_threshold": 1}  # fmt: skip


class ClusterError(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(f"dflash_sglang.cluster: {message}")


class Router(ManagedProcess):
    """`sglang-router` in front of the replicas' URLs."""

    health_path = "/readiness"

    def __init__(
        self,
        workers: list[str],
        log_path: Path,
        port: int,
        policy: str,
        metrics_port: int,
        host: str = "127.0.0.1",
    ) -> None:
        self.metrics_url = f"http://{host}:{metrics_port}"
        health_flags = [
            x for k, v in ROUTER_HEALTH.items() for x in (f"--{k.replace('_', '-')}", str(v))
        ]
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host,
               "--port", str(port), "--policy", policy, "--worker-urls", *workers,
               "--prometheus-host", host, "--prometheus-port", str(metrics_port),
               *health_flags, "--log-level", "warn"]  # fmt: skip
        log_path.write_text("")
        super().__init__(cmd, log_path, port, env=dict(os.environ, NO_COLOR="1"), wait=False)

    def worker_ids(self) -> dict[str, str]:
        """Worker URL -> the router's id for it (its control-plane API, `GET /workers`)."""
        body = requests.get(self.url + "/workers", timeout=5).json()
        return {w["url"]: w["id"] for w in body["workers"]}

    def remove_worker(self, url: str) -> None:
        """Out of rotation now (the router applies it within milliseconds); no-op if absent."""
        worker_id = self.worker_ids().get(url)
        if worker_id is not None:
            requests.delete(f"{self.url}/workers/{worker_id}", timeout=5).raise_for_status()

    def add_worker(self, url: str) -> None:
        """Back in rotation, with the health checks the router gave it at start-up."""
        if url in self.worker_ids():
            return
        body = {"url": url, **ROUTER_HEALTH}
        requests.post(self.url + "/workers", json=body, timeout=5).raise_for_status()


def our_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_sglang.cluster",
        description="N DFLASH_X replicas behind sglang-router; other arguments go to every "
        "replica's launcher (python -m dflash_sglang.launch_server).",
    )
    p.add_argument("--replicas", type=int, default=2, help="number of replicas (default 2)")
    p.add_argument("--port", type=int, default=30000, help="the router's port (default 30000)")
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware", help="routing policy")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per replica on CPU (default: cores / replicas)")  # fmt: skip
    p.add_argument("--log-dir", default="cluster-logs", help="one log per process")
    return p


def metrics_port(args: argparse.Namespace) -> int:
    return args.port + 1 + args.replicas


def replica_ports(args: argparse.Namespace) -> list[int]:
    return [args.port + 1 + i for i in range(args.replicas)]


def check_args(args: argparse.Namespace, replica_args: Sequence[str]) -> None:
    """Fail before starting anything, naming the flag."""
    if args.replicas < 1:
        raise ClusterError(f"--replicas must be at least 1, got {args.replicas}")
    if args.threads is not None and args.threads < 1:
        raise ClusterError(f"--threads must be at least 1, got {args.threads}")
    if has_flag(replica_args, "--base-gpu-id"):
        raise ClusterError("--base-gpu-id is set per replica by the cluster (replica i: GPU i)")
    if has_flag(replica_args, "--port"):
        raise ClusterError("--port is the router's; replicas take the ports after it")
    if not (0 < args.port and metrics_port(args) < 65536):
        raise ClusterError(f"--port {args.port} leaves no room for {args.replicas} replicas")
    for port in [args.port, *replica_ports(args), metrics_port(args)]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                raise ClusterError(
                    f"port {port} is in use (--port {args.port} with --replicas "
                    f"{args.replicas} needs {args.port}..{metrics_port(args)})"
                ) from None


class Cluster:
    def __init__(
        self, args: argparse.Namespace, replica_args: list[str], start_router: bool = True
    ) -> None:
        self.args = args
        self.start_router = start_router
        self.log_dir = Path(args.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        device = flag_value(replica_args, "--device") or platform.detect_device()
        cuda = platform.for_device(device) is platform.CUDA
        threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
        self.replicas: list[Server] = []
        for i, port in enumerate(replica_ports(args)):
            extra = ["--base-gpu-id", str(i)] if cuda else []
            env = {"DFLASH_HOST_REPLICAS": str(args.replicas)}
            self.replicas.append(
                Server(
                    [*replica_args, *extra],
                    self.log_dir / f"replica{i}.log",
                    threads,
                    port=port,
                    env=env,
                    wait=False,
                )  # fmt: skip
            )
        self.router: Router | None = None
        # Every router in front of the replicas: ours, and any a caller adds (a benchmark's).
        self.routers: list[Router] = []
        self.restarts = [0] * args.replicas
        self._out: set[int] = set()  # replicas taken out of the routers, added back when ready
        self._stopping = False
        for i in range(len(self.replicas)):
            self._watch(i)

    def wait_ready(self) -> None:
        for replica in self.replicas:
            replica.wait_ready()
        if not self.start_router:
            return
        # Written before the router starts, so a client that sees the router ready finds them.
        self.write_scrape_targets()
        a = self.args
        self.router = Router([r.url for r in self.replicas], self.log_dir / "router.log",
                             a.port, a.policy, metrics_port(a), a.host)  # fmt: skip
        self.router.wait_ready(timeout_s=120)
        self.routers.append(self.router)

    def _watch(self, i: int) -> None:
        """Take replica i out of every router the moment its current process exits."""
        proc = self.replicas[i].proc

        def on_exit() -> None:
            proc.wait()
            if not self._stopping:
                self._take_out(i)

        threading.Thread(target=on_exit, name=f"watch-replica{i}", daemon=True).start()

    def _take_out(self, i: int) -> None:
        url = self.replicas[i].url
        for router in list(self.routers):
            try:
                router.remove_worker(url)
            except requests.RequestException as e:  # its health checks will do it instead
                logger.warning("could not take %s out of %s: %s", url, router.url, e)
        self._out.add(i)

    def write_scrape_targets(self) -> None:
        """Prometheus file_sd lists (deploy/prometheus/cluster.yml reads them): every replica,
        and the router's exporter."""
        replicas = [{"targets": [f"127.0.0.1:{r.port}" for r in self.replicas]}]
        router = [{"targets": [f"127.0.0.1:{metrics_port(self.args)}"]}]
        for name, groups in (("replicas", replicas), ("router", router)):
            path = self.log_dir / f"{name}.targets.json"
            path.with_suffix(".tmp").write_text(json.dumps(groups, indent=1))
            path.with_suffix(".tmp").replace(path)  # Prometheus never reads half a file

    def supervise_once(self) -> None:
        """Restart whatever exited, add restarted replicas back once they answer; called
        every second until stopped."""
        for i, replica in enumerate(self.replicas):
            if not replica.alive() and not self._stopping:
                self.restarts[i] += 1
                logger.warning(
                    "replica %d (port %d) exited with %s; restart %d",
                    i, replica.port, replica.proc.returncode, self.restarts[i],
                )  # fmt: skip
                self._take_out(i)  # done already by its watcher, unless that raced us
                replica.stop()
                time.sleep(RESTART_BACKOFF_S)
                replica.start()
                self._watch(i)
            elif i in self._out and replica.ready():
                try:
                    for router in list(self.routers):
                        router.add_worker(replica.url)
                except requests.RequestException as e:
                    logger.warning("could not add %s back yet: %s", replica.url, e)
                else:
                    self._out.discard(i)
                    logger.info("replica %d (port %d) back in rotation", i, replica.port)
        if self.router is not None and not self.router.alive() and not self._stopping:
            logger.warning("router exited with %s; restarting", self.router.proc.returncode)
            self.router.stop()
            self.router.start()

    def stop(self) -> None:
        self._stopping = True
        if self.router is not None:
            self.router.stop()
        for replica in self.replicas:
            replica.stop()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args, replica_args = our_parser().parse_known_args(argv)
    if replica_args[:1] == ["--"]:  # `cluster [ours] -- [launcher args]`
        replica_args = replica_args[1:]
    check_args(args, replica_args)
    cluster = Cluster(args, replica_args)
    stop = {"now": False, "ready": False}

    def on_signal(*_):
        stop["now"] = True
        if not stop["ready"]:
            raise SystemExit(130)  # out of the start-up wait; `finally` stops everything

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        try:
            cluster.wait_ready()
        except (RuntimeError, TimeoutError) as e:
            raise ClusterError(f"start-up failed: {e}") from None
        stop["ready"] = True
        logger.info(
            "cluster ready: router http://%s:%d (%s), replicas %s, router metrics :%d",
            args.host, args.port, args.policy, ", ".join(r.url for r in cluster.replicas),
            metrics_port(args),
        )  # fmt: skip
        while not stop["now"]:
            cluster.supervise_once()
            time.sleep(1)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
