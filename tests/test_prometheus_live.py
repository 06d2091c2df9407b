"""A real Prometheus scrapes a live DFLASH_X server and sglang-router in front of it; every
Grafana dashboard query returns data.

Prometheus (the Debian `prometheus` binary) runs on loopback with deploy/prometheus's own
scrape job pointed at the session server and the router job of deploy/prometheus/cluster.yml
pointed at the router's exporter, scraping every second, while requests (plain and
streaming chat, directly and through the router) keep flowing so every `rate()` window
holds at least two samples.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
import requests
import yaml

from dflash_sglang.cluster import Router
from tests.prompts import SHORT
from tests.server import Server, free_port
from tests.test_deploy import (
    CLUSTER_PROM_CONFIG,
    JOB,
    PROM_CONFIG,
    dashboard,
    dashboard_exprs,
    promql,
    scrape_job,
)

pytestmark = pytest.mark.server
READY_TIMEOUT_S = 30
DATA_TIMEOUT_S = 120


def live_config(target: str, router_exporter: str, path: Path) -> Path:
    """deploy/prometheus/prometheus.yml with its job aimed at `target` and cluster.yml's router
    job at `router_exporter`, scraping every 1 s."""
    config = yaml.safe_load(PROM_CONFIG.read_text())
    job = scrape_job(config)
    job |= {"scrape_interval": "1s", "static_configs": [{"targets": [target]}]}
    cluster = yaml.safe_load(CLUSTER_PROM_CONFIG.read_text())
    (router_job,) = [j for j in cluster["scrape_configs"] if j["job_name"] != JOB]
    del router_job["file_sd_configs"]
    router_job |= {"scrape_interval": "1s", "static_configs": [{"targets": [router_exporter]}]}
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"] = [job, router_job]
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def router(live_dflash: Server, tmp_path_factory) -> Iterator[Router]:
    """sglang-router (cache-aware, as the cluster runs it) in front of the session server."""
    log = tmp_path_factory.mktemp("router") / "router.log"
    front = Router([live_dflash.url], log, free_port(), "cache_aware", free_port())
    try:
        front.wait_ready(timeout_s=120)
        yield front
    finally:
        front.stop()


@pytest.fixture(scope="module")
def prometheus(live_dflash: Server, router: Router, tmp_path_factory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus missing: run `make system-deps`"
    tmp = tmp_path_factory.mktemp("prometheus")
    url = f"http://127.0.0.1:{free_port()}"
    config = live_config(
        urlparse(live_dflash.url).netloc, urlparse(router.metrics_url).netloc, tmp / "p.yml"
    )
    cmd = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address={urlparse(url).netloc}",
    ]
    with open(tmp / "prometheus.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: ready(url), READY_TIMEOUT_S, f"Prometheus not ready; see {tmp}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ready(url: str) -> bool:
    try:
        return requests.get(url + "/-/ready", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def wait_for(condition, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(1)


def query(url: str, expr: str) -> list[dict]:
    r = requests.get(url + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def has_data(result: list[dict]) -> bool:
    return bool(result) and all(math.isfinite(float(s["value"][1])) for s in result)


def chat_stream(url: str, text: str) -> None:
    """A streaming chat completion, read to the end: fills TTFT and inter-token latency."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        r.raise_for_status()
        for _ in r.iter_lines():
            pass


@pytest.fixture(scope="module")
def traffic(live_dflash: Server, router: Router) -> Iterator[None]:
    """Requests until the module ends, so every rate() window spans live counters; the
    streamed ones through the router."""
    stop = threading.Event()
    errors: list[Exception] = []

    def run() -> None:
        i = 0
        while not stop.is_set():
            try:
                live_dflash.generate(SHORT[i % len(SHORT)], max_new_tokens=24, ignore_eos=True)
                chat_stream(router.url, SHORT[(i + 5) % len(SHORT)])
            except Exception as e:  # noqa: BLE001 - reported by the test, not lost in a thread
                errors.append(e)
                return
            i += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(timeout=150)
    assert not errors, errors


def test_every_dashboard_query_returns_data(live_dflash, prometheus, traffic):
    def target_up() -> bool:
        targets = requests.get(prometheus + "/api/v1/targets", timeout=5).json()["data"]
        return any(
            t["labels"]["job"] == JOB and t["health"] == "up" for t in targets["activeTargets"]
        )

    wait_for(target_up, READY_TIMEOUT_S, "the live server's target never came up")
    exprs = [promql(e) for e in dashboard_exprs()]
    missing = exprs
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while missing and time.monotonic() < deadline:
        time.sleep(2)
        missing = [e for e in exprs if not has_data(query(prometheus, e))]
    assert not missing, {e: query(prometheus, e) for e in missing}

    (tau,) = query(prometheus, promql(expr_with("1 + sum(", "dflash_num_drafts_total")))
    assert 1.0 <= float(tau["value"][1]) <= 8.0  # block 8: up to 7 accepted drafts + the bonus
    # Per source: only the DFlash block proposes on this server (suffix lookup is off).
    by_source = expr_with("sum by (source)", "1 + ", "dflash_num_accepted_tokens_total")
    (got,) = query(prometheus, promql(by_source))
    assert got["metric"] == {"source": "dflash"}
    assert 1.0 <= float(got["value"][1]) <= 8.0
    # Beside it, the τ the planner expected of the same request-steps.
    (expected,) = query(prometheus, promql(expr_with("predicted_accepted_tokens_total")))
    assert expected["metric"] == {"source": "dflash"}
    assert 1.0 < float(expected["value"][1]) <= 8.0
    per_position = query(prometheus, promql(expr_with("per_pos")))
    assert {s["metric"]["position"] for s in per_position} == {str(k) for k in range(7)}
    # The scrape job's relabelling left no OpenMetrics-escaped `sglang_*` name behind.
    assert query(prometheus, '{__name__=~"sglang_.+"}') == []


def test_instance_variable_lists_the_server(live_dflash, prometheus, traffic):
    (variable,) = [v for v in dashboard()["templating"]["list"] if v["name"] == "instance"]
    metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", variable["definition"]).groups()

    def values() -> list[str]:
        url = f"{prometheus}/api/v1/label/{label}/values"
        return requests.get(url, params={"match[]": metric}, timeout=10).json()["data"]

    wait_for(values, DATA_TIMEOUT_S, f"no {label} values for {metric}")
    assert values() == [urlparse(live_dflash.url).netloc]


def expr_with(*parts: str) -> str:
    """The dashboard expression containing every one of `parts`."""
    (expr,) = [e for e in dashboard_exprs() if all(p in e for p in parts)]
    return expr
