"""`python -m dflash_sglang.cluster`: replicas behind sglang-router, on loopback.

The end-to-end test runs the real thing (two launcher replicas on a tiny model, the Rust
router in front): requests through the router reach both replicas, a replica killed with
SIGKILL is routed around and restarted by the supervisor, rejoins, and SIGTERM ends every
process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from dflash_sglang import cluster
from dflash_sglang.launch_server import LaunchError, host_replicas
from dflash_sglang.managed_server import ephemeral_low, free_port


def _args(*argv: str):
    return cluster.our_parser().parse_known_args(list(argv))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--replicas", "0"], "--replicas"),
        (["--threads", "0"], "--threads"),
        (["--port", "65534", "--replicas", "2"], "--port 65534"),
        (["--base-gpu-id", "1"], "--base-gpu-id"),
    ],
)
def test_bad_arguments_fail_before_starting_anything(argv, message):
    args, rest = _args(*argv)
    with pytest.raises(SystemExit, match=message):
        cluster.check_args(args, rest)


def test_free_ports_are_below_the_ephemeral_range_and_bindable(tmp_path):
    """Outgoing connections take ephemeral ports, so a server's port (bound tens of seconds
    after it is chosen) comes from below that range."""
    low = ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports) and len(ports) > 1
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    ranges = tmp_path / "range"
    ranges.write_text("40000\t60999\n")
    assert ephemeral_low(str(ranges)) == 40000
    assert ephemeral_low(str(tmp_path / "missing")) == 32768


def test_replica_port_flag_is_refused():
    args, rest = _args("--port", str(free_port()), "--", "--port", "1234")
    with pytest.raises(SystemExit, match="--port is the router's"):
        cluster.check_args(args, rest[1:] if rest[:1] == ["--"] else rest)


def test_a_port_in_use_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        args, rest = _args("--port", str(taken - 1), "--replicas", "1")
        with pytest.raises(SystemExit, match=f"port {taken} is in use"):
            cluster.check_args(args, rest)


def test_ports_follow_the_router_port():
    args, _ = _args("--port", "31000", "--replicas", "3")
    assert cluster.replica_ports(args) == [31001, 31002, 31003]
    assert cluster.metrics_port(args) == 31004


def test_host_replicas_divides_the_default_kv_pool(capsys):
    assert host_replicas({}) == 1
    assert host_replicas({"DFLASH_HOST_REPLICAS": "3"}) == 3
    with pytest.raises(LaunchError):
        host_replicas({"DFLASH_HOST_REPLICAS": "0"})
    assert "DFLASH_HOST_REPLICAS must be a positive integer" in capsys.readouterr().err


def _free_block(n: int) -> int:
    """A port p with p..p+n bindable, below the kernel's ephemeral range: a port from that
    range can be taken as the source port of any outgoing connection (this test's own
    polling, the replicas' start-up) in the seconds before a replica binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, low - n - 1)
        if all(_free(base + i) for i in range(n + 1)):
            return base
    raise RuntimeError("no free port block")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _requests_served(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:num_requests_total")
    )


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def _ok(url: str, path: str) -> bool:
    try:
        return requests.get(url + path, timeout=5).status_code == 200
    except requests.RequestException:
        return False


def _router_workers(router: str) -> list[str]:
    return sorted(w["url"] for w in requests.get(router + "/workers", timeout=5).json()["workers"])


def _listener(port: int) -> psutil.Process:
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            return psutil.Process(conn.pid)
    raise AssertionError(f"nothing listens on {port}")


@pytest.mark.server
def test_cluster_routes_survives_a_killed_replica_and_stops_cleanly(models, tmp_path):
    port = _free_block(3)
    cmd = [
        sys.executable, "-m", "dflash_sglang.cluster", "--replicas", "2", "--port", str(port),
        "--policy", "round_robin", "--threads", "1", "--log-dir", str(tmp_path),
        "--model-path", str(models["target"]), "--dtype", "float32",
        "--speculative-draft-model-path", str(models["draft"]), "--max-total-tokens", "4096",
    ]  # fmt: skip
    log = open(tmp_path / "cluster.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    router = f"http://127.0.0.1:{port}"
    replicas = [f"http://127.0.0.1:{port + 1 + i}" for i in range(2)]

    def generate(i: int) -> requests.Response:
        body = {"text": f"Request {i}: count to five.", "sampling_params": {
            "temperature": 0, "max_new_tokens": 8}}  # fmt: skip
        return requests.post(router + "/generate", json=body, timeout=120)

    try:
        _wait(lambda: _ok(router, "/readiness") or proc.poll() is not None, 600, "the router")
        assert proc.poll() is None, (tmp_path / "cluster.log").read_text()[-3000:]
        for i in range(6):
            assert generate(i).status_code == 200
        assert all(_requests_served(url) >= 2 for url in replicas), "round robin reaches both"
        # Prometheus' file_sd lists (deploy/prometheus/cluster.yml) and the router's exporter.
        listed = json.loads((tmp_path / "replicas.targets.json").read_text())
        assert listed == [{"targets": [f"127.0.0.1:{port + 1}", f"127.0.0.1:{port + 2}"]}]
        (router_target,) = json.loads((tmp_path / "router.targets.json").read_text())
        assert router_target["targets"] == [f"127.0.0.1:{port + 3}"]
        exported = requests.get(f"http://127.0.0.1:{port + 3}/metrics", timeout=10).text
        assert f'smg_worker_health{{worker="{replicas[0]}"}} 1' in exported

        # SIGKILL replica 1's whole tree: the supervisor takes it out of the router at once
        # (the router's health checks alone take ~1-2 s), restarts it and adds it back.
        victim = _listener(port + 2)
        os.killpg(os.getpgid(victim.pid), signal.SIGKILL)
        _wait(lambda: _router_workers(router) == [replicas[0]], 5, "replica 1 out of the router")
        statuses = [generate(10 + i).status_code for i in range(6)]
        assert statuses == [200] * 6, statuses
        _wait(lambda: _ok(replicas[1], "/health"), 600, "replica 1 to restart")
        _wait(lambda: len(_router_workers(router)) == 2, 30, "replica 1 back in the router")
        before = _requests_served(replicas[1])

        def rejoined() -> bool:
            generate(99)
            return _requests_served(replicas[1]) > before

        _wait(rejoined, 60, "the router to send to the restarted replica")
        log_text = (tmp_path / "cluster.log").read_text()
        assert "restart 1" in log_text and "back in rotation" in log_text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        log.close()
    assert code == 0
    connections = psutil.net_connections("tcp")
    listening = {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
    assert not listening & set(range(port, port + 4)), "a process outlived the cluster"
