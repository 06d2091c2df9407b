"""deploy/ checked statically: Prometheus config, Grafana dashboard, compose, Dockerfile, k8s.

No Docker engine or cluster runs here, so the files are checked against each other and the
repository: every path, port, image tag and metric name they reference must exist and agree.
`tests/test_prometheus_live.py` runs the dashboard's queries against a real Prometheus.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from dflash_sglang.metrics import PREFIX

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
CLUSTER_PROM_CONFIG = DEPLOY / "prometheus" / "cluster.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "dflash-sglang.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "dflash.yml"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
K8S = DEPLOY / "k8s"
JOB = "dflash-sglang"
SERVER = "dflash"  # the compose service our Prometheus job scrapes
SAMPLE_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool"}
PROMQL_KEYWORDS |= {"and", "or", "unless", "offset"}
# Grafana's built-in variables and ours, as the live test substitutes them.
GRAFANA_VARS = {"$__rate_interval": "1m", "$instance": ".*"}


# --- shared with tests/test_prometheus_live.py -------------------------------------------


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def promql(expr: str) -> str:
    """A dashboard expr as Grafana sends it, its variables replaced by test values."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr}"
    return expr


def scrape_job(config: dict) -> dict:
    return next(j for j in config["scrape_configs"] if j["job_name"] == JOB)


# --- metric names --------------------------------------------------------------------------


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions or keywords."""
    expr = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"', "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    tokens = re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", expr)
    return {name for name, call in tokens if not call and name not in PROMQL_KEYWORDS}


def sglang_metric_names() -> set[str]:
    """Every `sglang:*` name SGLang's observability code defines (read, not imported)."""
    spec = importlib.util.find_spec("sglang")
    source = Path(next(iter(spec.submodule_search_locations))) / "srt" / "observability"
    return {n for f in source.glob("*.py") for n in re.findall(r'"(sglang:[\w:]+)"', f.read_text())}


def dflash_metric_names() -> set[str]:
    """`PREFIX + "name"` metric definitions in dflash_sglang/metrics.py."""
    tree = ast.parse((ROOT / "dflash_sglang" / "metrics.py").read_text())
    return {
        PREFIX + node.right.value
        for node in ast.walk(tree)
        if isinstance(node, ast.BinOp)
        and isinstance(node.left, ast.Name)
        and node.left.id == "PREFIX"
        and isinstance(node.right, ast.Constant)
    }


def router_binary() -> bytes:
    """sglang-router's Rust extension, whose string table holds its `smg_*` metric names."""
    spec = importlib.util.find_spec("sglang_router")
    (lib,) = Path(next(iter(spec.submodule_search_locations))).glob("sglang_router_rs*.so")
    return lib.read_bytes()


def test_metric_name_parser():
    expr = (
        'sum by (position) (rate(a_total{x="y"}[$__rate_interval])) / ignoring(position) '
        "group_left sum(rate(sglang:b_total[1m])) + histogram_quantile(0.5, c_bucket)"
    )
    assert metric_names(expr) == {"a_total", "sglang:b_total", "c_bucket"}


def test_dashboard_uses_only_defined_metrics():
    defined = sglang_metric_names() | dflash_metric_names()
    assert "dflash_num_drafts" in defined and "sglang:generation_tokens_total" in defined
    used = set().union(*map(metric_names, dashboard_exprs()))
    router = router_binary()  # Rust string literals are not separated: test for substrings

    def known(name: str) -> bool:
        if name.startswith("smg_"):  # the router's exporter (make serve-cluster)
            return any(name.removesuffix(s).encode() in router for s in SAMPLE_SUFFIXES)
        return any(name.removesuffix(s) in defined for s in SAMPLE_SUFFIXES)

    assert any(n.startswith("smg_") for n in used), "no router panel"
    assert not known("smg_no_such_metric_total")
    unknown = {n for n in used if not known(n)}
    assert not unknown, f"dashboard queries metrics nobody defines: {unknown}"
    missing = {n for n in dflash_metric_names() if not {n + s for s in SAMPLE_SUFFIXES} & used}
    assert not missing, f"dflash metrics not on the dashboard: {missing}"


# --- Prometheus and Grafana ----------------------------------------------------------------


@pytest.mark.parametrize("config", [PROM_CONFIG, CLUSTER_PROM_CONFIG])
def test_promtool_validates_config(config):
    assert shutil.which("promtool"), "promtool missing: run `make system-deps`"
    command = ["promtool", "check", "config", str(config)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cluster_prometheus_reads_the_target_lists_the_cluster_writes():
    """`python -m dflash_sglang.cluster` writes `<log-dir>/{replicas,router}.targets.json`;
    deploy/prometheus/cluster.yml reads them from the default log dir at the repo root."""
    from dflash_sglang import cluster

    log_dir = ROOT / cluster.our_parser().get_default("log_dir")
    config = yaml.safe_load(CLUSTER_PROM_CONFIG.read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {JOB, "sglang-router"}
    for job, name in ((JOB, "replicas"), ("sglang-router", "router")):
        (sd,) = jobs[job]["file_sd_configs"]
        (path,) = sd["files"]
        assert (CLUSTER_PROM_CONFIG.parent / path).resolve() == log_dir / f"{name}.targets.json"
    assert (
        jobs[JOB]["metric_relabel_configs"]
        == scrape_job(yaml.safe_load(PROM_CONFIG.read_text()))["metric_relabel_configs"]
    )


def scrape_interval() -> str:
    return yaml.safe_load(PROM_CONFIG.read_text())["global"]["scrape_interval"]


def test_prometheus_scrapes_the_compose_server():
    config = yaml.safe_load(PROM_CONFIG.read_text())
    job = scrape_job(config)
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"{SERVER}:{server_port()}"]


def test_dashboard_panels_have_datasource_and_queries():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ds = {"type": "prometheus", "uid": "${datasource}"}
    assert len(panels()) >= 14
    for panel in panels():
        assert panel["datasource"] == ds, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == ds and target["expr"].strip(), panel["title"]
            promql(target["expr"])
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_grafana_provisioning_matches_compose():
    datasource = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]
    assert datasource["type"] == "prometheus"
    assert datasource["jsonData"]["timeInterval"] == scrape_interval()
    (variable,) = [v for v in dashboard()["templating"]["list"] if v["name"] == "datasource"]
    assert variable["current"]["value"] == datasource["uid"]
    services = compose()["services"]
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", datasource["url"]).groups()
    assert host in services and f"{port}:{port}" in services[host]["ports"]
    provider = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"][0]
    mounts = bind_mounts(services["grafana"])
    assert mounts[provider["options"]["path"]] == DASHBOARD.parent
    assert mounts["/etc/grafana/provisioning"] == DATASOURCES.parents[1]


# --- docker compose and the image ----------------------------------------------------------


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def bind_mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path, for short-syntax bind mounts of repository paths."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[target] = (DEPLOY / source).resolve()
    return mounts


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def server_port() -> int:
    return int(flag(compose()["services"][SERVER]["command"], "--port"))


def assert_pinned(image: str) -> None:
    assert re.fullmatch(r"[\w./-]+:[\w.-]+", image), f"{image} has no tag"
    assert not image.endswith(":latest"), image


def test_compose_paths_exist_and_images_are_pinned():
    config = compose()
    for name, service in config["services"].items():
        assert_pinned(service["image"])
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
            elif not source.startswith("$"):
                assert source in config["volumes"], f"{name}: undeclared volume {source}"
    build = config["services"][SERVER]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE


def test_compose_server_ports_and_gpu():
    service = compose()["services"][SERVER]
    port = server_port()
    assert flag(service["command"], "--host") == "0.0.0.0"
    assert f"{port}:{port}" in service["ports"]
    assert f"localhost:{port}/health" in " ".join(service["healthcheck"]["test"])
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    prometheus = compose()["services"]["prometheus"]
    config_path = flag([a for c in prometheus["command"] for a in c.split("=")], "--config.file")
    assert bind_mounts(prometheus)[config_path] == PROM_CONFIG


def dockerfile() -> list[list[str]]:
    lines = [ln.strip() for ln in DOCKERFILE.read_text().splitlines()]
    return [ln.split() for ln in lines if ln and not ln.startswith("#")]


def test_dockerfile_base_matches_pinned_sglang_and_copies_the_package():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (sglang_pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("sglang==")]
    (base,) = [ins[1] for ins in dockerfile() if ins[0] == "FROM"]
    assert_pinned(base)
    assert base.startswith("lmsysorg/sglang:v" + sglang_pin.removeprefix("sglang=="))
    copied = {src for ins in dockerfile() if ins[0] == "COPY" for src in ins[1:-1]}
    for source in copied:
        assert (ROOT / source).exists(), source
    setuptools = pyproject["tool"]["setuptools"]
    dirs = {setuptools["package-dir"].get(p, p.replace(".", "/")) for p in setuptools["packages"]}
    needed = {d.split("/")[0] for d in dirs} | {"pyproject.toml", pyproject["project"]["readme"]}
    assert needed <= copied, f"Dockerfile does not copy {needed - copied}"
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert {f"!{s}" for s in copied} <= set(ignore), "dockerignore excludes a copied path"
    image = compose()["services"][SERVER]["image"]
    assert image == f"dflash-sglang:{pyproject['project']['version']}"
    expose = [ins[1] for ins in dockerfile() if ins[0] == "EXPOSE"]
    assert expose == [str(server_port())]
    assert "dflash_sglang.launch_server" in DOCKERFILE.read_text()
    (router_pin,) = [d for d in pyproject["project"]["dependencies"] if "sglang-router" in d]
    assert router_pin.split()[0] in DOCKERFILE.read_text(), "the image's router is not the pin"


# --- Kubernetes ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict]:
    """The kustomization's resources by (kind, name)."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    docs = [d for f in sorted(files) for d in yaml.safe_load_all((K8S / f).read_text()) if d]
    by_key = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(by_key) == len(docs)
    return by_key


REPLICAS = ("StatefulSet", "dflash-sglang")
ROUTER = ("Deployment", "dflash-router")


def container_port(container: dict, port: int | str) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def only_container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def test_k8s_resources(k8s):
    assert set(k8s) == {
        ("Namespace", "dflash"),
        REPLICAS,
        ("Service", "dflash-sglang"),
        ROUTER,
        ("Service", "dflash-router"),
        ("ServiceAccount", "dflash-router"),
        ("Role", "dflash-router"),
        ("RoleBinding", "dflash-router"),
        ("ServiceMonitor", "dflash-sglang"),
        ("ServiceMonitor", "dflash-router"),
    }
    monitors = [d for (kind, _), d in k8s.items() if kind == "ServiceMonitor"]
    assert all(m["apiVersion"] == "monitoring.coreos.com/v1" for m in monitors)


def test_kustomize_renders_everything_in_one_namespace(k8s):
    assert shutil.which("kubectl"), "kubectl missing: run `make system-deps`"
    result = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert {(d["kind"], d["metadata"]["name"]) for d in rendered} == set(k8s)
    namespaced = [d for d in rendered if d["kind"] != "Namespace"]
    assert {d["metadata"]["namespace"] for d in namespaced} == {"dflash"}


def test_k8s_replicas_serve_on_b200s_and_scale_with_one_field(k8s):
    workload = k8s[REPLICAS]
    assert workload["spec"]["replicas"] >= 2
    assert workload["spec"]["podManagementPolicy"] == "Parallel"
    assert workload["spec"]["serviceName"] == k8s[("Service", "dflash-sglang")]["metadata"]["name"]
    pod = workload["spec"]["template"]
    spec = pod["spec"]
    container = only_container(workload)
    assert container["image"] == compose()["services"][SERVER]["image"]
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["nvidia.com/gpu"] >= 1
    assert "B200" in spec["nodeSelector"]["nvidia.com/gpu.product"]
    port = int(flag(container["args"], "--port"))
    assert flag(container["args"], "--host") == "0.0.0.0"
    assert port == server_port()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and container_port(container, get["port"]) == port
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    (claim,) = workload["spec"]["volumeClaimTemplates"]  # a model cache per replica
    assert claim["metadata"]["name"] == mounts["/models"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_HOME"]["value"].startswith("/models/")
    for ref in re.findall(r"\$\((\w+)\)", " ".join(container["args"])):
        assert ref in env, f"args reference undefined env {ref}"
    labels = pod["metadata"]["labels"]
    assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_k8s_router_discovers_the_replicas(k8s):
    replica_pod = k8s[REPLICAS]["spec"]["template"]
    router = k8s[ROUTER]["spec"]["template"]
    container = only_container(k8s[ROUTER])
    assert container["image"] == only_container(k8s[REPLICAS])["image"]
    assert container["command"] == ["python3", "-m", "sglang_router.launch_router"]
    args = container["args"]
    assert "--service-discovery" in args and flag(args, "--policy") == "cache_aware"
    key, value = flag(args, "--selector").split("=")
    assert replica_pod["metadata"]["labels"][key] == value
    assert int(flag(args, "--service-discovery-port")) == server_port()
    env = {e["name"]: e for e in container["env"]}
    for ref in re.findall(r"\$\((\w+)\)", " ".join(args)):
        assert ref in env, f"router args reference undefined env {ref}"
    replica_env = {e["name"]: e for e in only_container(k8s[REPLICAS])["env"]}
    assert env["DFLASH_API_KEY"]["valueFrom"] == replica_env["DFLASH_API_KEY"]["valueFrom"]
    # It may read pods in its namespace, as its ServiceAccount.
    account = router["spec"]["serviceAccountName"]
    binding = k8s[("RoleBinding", "dflash-router")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = k8s[("Role", binding["roleRef"]["name"])]
    (rule,) = role["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    for probe, path in (("readinessProbe", "/readiness"), ("livenessProbe", "/liveness")):
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert container_port(container, get["port"]) == int(flag(args, "--port"))


def test_k8s_services_and_servicemonitors_reach_the_pods(k8s):
    relabel = scrape_job(yaml.safe_load(PROM_CONFIG.read_text()))["metric_relabel_configs"]
    (rule,) = relabel
    expected_relabel = [
        {
            "sourceLabels": rule["source_labels"],
            "regex": rule["regex"],
            "targetLabel": rule["target_label"],
            "replacement": rule["replacement"],
        }
    ]
    for workload, name, port_name in (
        (REPLICAS, "dflash-sglang", "http"),
        (ROUTER, "dflash-router", "metrics"),
    ):
        pod = k8s[workload]["spec"]["template"]
        container = only_container(k8s[workload])
        service = k8s[("Service", name)]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        monitor = k8s[("ServiceMonitor", name)]["spec"]
        assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        (endpoint,) = monitor["endpoints"]
        assert endpoint["port"] == port_name and endpoint["path"] == "/metrics"
        assert endpoint["interval"] == scrape_interval()
        target = container_port(container, ports[port_name]["targetPort"])
        assert str(target) == pod["metadata"]["annotations"]["prometheus.io/port"]
        if workload == REPLICAS:
            assert target == server_port()
            assert service["spec"]["clusterIP"] == "None"  # one DNS name per replica
            assert endpoint["metricRelabelings"] == expected_relabel
        else:
            assert target == int(flag(container["args"], "--prometheus-port"))


def test_api_key_comes_from_a_secret_never_inline(k8s):
    """The launcher reads $DFLASH_API_KEY / $DFLASH_API_KEY_FILE; no file carries a key."""
    from dflash_sglang.launch_server import API_KEY_ENV, API_KEY_FILE_ENV, SECRET_FLAGS

    container = only_container(k8s[REPLICAS])
    env = {e["name"]: e for e in container["env"]}
    assert set(env[API_KEY_ENV]) == {"name", "valueFrom"}
    assert env[API_KEY_ENV]["valueFrom"]["secretKeyRef"]["name"]
    assert not env[API_KEY_ENV]["valueFrom"]["secretKeyRef"].get("optional", False)
    service = compose()["services"][SERVER]
    (secret,) = service["secrets"]
    assert service["environment"][API_KEY_FILE_ENV] == f"/run/secrets/{secret}"
    assert compose()["secrets"][secret] == {"environment": API_KEY_ENV}
    for args in (container["args"], service["command"]):
        assert not set(SECRET_FLAGS) & {a.split("=")[0] for a in args}


def test_k8s_gives_in_flight_requests_time_to_finish(k8s):
    """SGLang drains running requests on SIGTERM; the pod must not be killed first."""
    spec = k8s[REPLICAS]["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] >= 120


def test_compose_cache_volume_is_hf_home():
    """The model cache volume is where HF_HOME points, as in the k8s Deployment."""
    service = compose()["services"][SERVER]
    targets = [re.sub(r"\$\{[^}]*\}", "var", v).split(":")[1] for v in service["volumes"]]
    assert service["environment"]["HF_HOME"] in targets
