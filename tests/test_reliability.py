"""What an operator trips over first: requests that never answer, a pool that eats the host,
a launcher that outlives its scheduler, auth, and shutdown under traffic.

Server tests share `live_dflash` (no key) and one module server started with a key from
$DFLASH_API_KEY; the SIGTERM test ends that server, so it comes last.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import requests

from dflash_sglang.cpu_platform import kv_pool
from dflash_sglang.launch_server import (
    LaunchError,
    flag_value,
    redacted,
    with_api_key_from,
    with_cpu_kv_pool,
)
from dflash_sglang.server import validation
from tests.server import PURE_DFLASH, Server, free_port

KEY = "test-key-4f1c"
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


# --- pure parts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {**CHAT, "n": 0}, "`n`"),
        ("/v1/chat/completions", {**CHAT, "n": -3}, "`n`"),
        ("/v1/chat/completions", {**CHAT, "n": 1.5}, "`n`"),
        ("/v1/completions", {"prompt": "a", "n": 0}, "`n`"),
        ("/v1/completions", {"prompt": "a", "temperature": float("nan")}, "`temperature`"),
        ("/generate", {"text": "a", "sampling_params": {"n": 0}}, "`sampling_params.n`"),
        ("/generate", {"text": ["a"], "sampling_params": [{"top_p": float("inf")}]},
         "`sampling_params[0].top_p`"),
    ],
)  # fmt: skip
def test_bad_fields_are_named(path, body, field):
    assert field in validation.check(path, json.dumps(body).encode())


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/chat/completions", json.dumps({**CHAT, "n": 2}).encode()),
        ("/generate", json.dumps({"text": "a", "sampling_params": {"temperature": 0.5}}).encode()),
        ("/generate", b"{not json"),  # SGLang's parser answers it
        ("/dflash/stats", b'{"n": 0}'),  # not a checked route
    ],
)
def test_good_or_foreign_bodies_pass(path, raw):
    assert validation.check(path, raw) is None


def test_cpu_pool_fits_contexts_within_a_ram_share():
    target = {
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_size": 576,
    }  # fmt: skip  (SmolLM2-135M)
    draft = {**target, "num_hidden_layers": 5}
    assert kv_pool.kv_bytes_per_token(target, 2) == 2 * 30 * 3 * 64 * 2
    assert kv_pool.default_max_total_tokens(target, draft, 8192, 2, 24 << 30) == 8 * 8192
    small_host = kv_pool.default_max_total_tokens(target, draft, 8192, 2, 1 << 30)
    assert small_host * (23040 + 3840) <= 0.25 * (1 << 30)
    assert kv_pool.dtype_bytes("float32", target) == 4
    assert kv_pool.dtype_bytes(None, {"torch_dtype": "bfloat16"}) == 2


def test_launcher_sizes_the_cpu_pool_unless_given(models):
    args = ["--model-path", str(models["target"]), "--speculative-algorithm", "DFLASH_X",
            "--speculative-draft-model-path", str(models["draft"])]  # fmt: skip
    sized = with_cpu_kv_pool(args)
    assert int(flag_value(sized, "--max-total-tokens")) == 8 * 4096  # tiny target: 4096 context
    assert with_cpu_kv_pool([*args, "--max-total-tokens", "100"]) == [
        *args,
        "--max-total-tokens",
        "100",
    ]
    assert with_cpu_kv_pool([*args, "--mem-fraction-static=0.5"])[-1] == "--mem-fraction-static=0.5"


def test_api_key_comes_from_the_environment_and_stays_out_of_logs():
    assert with_api_key_from({"DFLASH_API_KEY": KEY}, ["--port", "1"]) == [
        "--port",
        "1",
        "--api-key",
        KEY,
    ]
    assert with_api_key_from({"DFLASH_API_KEY": KEY}, ["--api-key=x"]) == ["--api-key=x"]
    assert with_api_key_from({}, []) == []
    with pytest.raises(LaunchError):
        with_api_key_from({"DFLASH_API_KEY": " "}, [])


def test_api_key_from_a_mounted_secret_file(tmp_path, capsys):
    (tmp_path / "key").write_text(KEY + "\n")
    env = {"DFLASH_API_KEY_FILE": str(tmp_path / "key")}
    assert with_api_key_from(env, []) == ["--api-key", KEY]
    with pytest.raises(LaunchError):
        with_api_key_from({"DFLASH_API_KEY_FILE": str(tmp_path / "missing")}, [])
    assert "$DFLASH_API_KEY_FILE" in capsys.readouterr().err
    assert KEY not in " ".join(
        redacted(["--api-key", KEY, "--admin-api-key=" + KEY, "--port", "1"])
    )


def test_a_failed_start_ends_the_launcher_and_its_children(tmp_path):
    """`serve` after a start-up failure: exit 1, no child left (before: waited forever on it)."""
    script = textwrap.dedent(
        """
        import multiprocessing, sys, time
        from dflash_sglang.launch_server import serve

        def run():
            child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
            child.start()
            print(child.pid, flush=True)
            raise RuntimeError("Rank 0 scheduler died during initialization (exit code: -9)")

        if __name__ == "__main__":
            serve(run)
        """
    )
    (tmp_path / "start.py").write_text(script)
    proc = subprocess.run([sys.executable, str(tmp_path / "start.py")], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "scheduler died" in proc.stderr
    assert not _alive([int(proc.stdout.split()[0])])


# --- a real launcher whose scheduler is killed while it loads ----------------------------


@pytest.mark.server
def test_scheduler_killed_at_start_up_ends_the_launcher(models, tmp_path):
    """The OOM killer's SIGKILL, while the model loads: the launcher must exit non-zero."""
    cmd = [sys.executable, "-m", "dflash_sglang.launch_server", "--port", str(free_port()),
           "--model-path", str(models["target"]), "--dtype", "float32",
           "--speculative-draft-model-path", str(models["draft"])]  # fmt: skip
    log = open(tmp_path / "launcher.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        launcher = psutil.Process(proc.pid)
        deadline = time.monotonic() + 120
        scheduler = None
        while scheduler is None and time.monotonic() < deadline and proc.poll() is None:
            for child in launcher.children(recursive=True):
                try:
                    if " ".join(child.cmdline()).startswith("sglang::scheduler"):
                        scheduler = child
                except psutil.Error:
                    pass
            time.sleep(0.05)
        assert scheduler is not None, (tmp_path / "launcher.log").read_text()[-3000:]
        scheduler.kill()
        assert proc.wait(timeout=90) != 0
        time.sleep(1)
        assert not _alive(_session(proc.pid))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _alive(pids: list[int]) -> list[int]:
    """The pids still running (a zombie has exited; its parent just has not reaped it)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _session(sid: int) -> list[int]:
    pids = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                pids.append(p.pid)
        except OSError:
            pass
    return pids


# --- request checks on a live server -------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "n": 0}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 1_000_000_000}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 1_000_000_000}),
        ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 1_000_000_000}}),
        ("/v1/chat/completions", {**CHAT, "temperature": -1}),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}),
        ("/v1/chat/completions", {**CHAT, "messages": []}),
        ("/generate", {"text": "Hello", "sampling_params": {"temperature": float("nan")}}),
    ],
)
def test_bad_requests_get_a_prompt_4xx(live_dflash, path, body):
    r = requests.post(live_dflash.url + path, data=json.dumps(body),
                      headers={"Content-Type": "application/json"}, timeout=20)  # fmt: skip
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert live_dflash.generate("Hello", max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


# --- auth and shutdown on a server with a key ----------------------------------------------


@pytest.fixture(scope="module")
def keyed(models, tmp_path_factory):
    os.environ["DFLASH_API_KEY"] = KEY
    try:
        server = Server(
            ["--model-path", str(models["target"]), "--dtype", "float32",
             "--speculative-draft-model-path", str(models["draft"]), *PURE_DFLASH],
            tmp_path_factory.mktemp("keyed") / "keyed.log",
        )  # fmt: skip
    finally:
        del os.environ["DFLASH_API_KEY"]
    yield server
    server.stop()


AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.server
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("post", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}),
        ("post", "/v1/chat/completions", CHAT),
        ("post", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("get", "/v1/models", None),
        ("get", "/dflash/stats", None),
        ("get", "/dflash/stats/series", None),
        ("get", "/dflash/", None),
    ],
)
def test_key_is_required_where_it_should_be(keyed, method, path, body):
    call = getattr(requests, method)
    assert call(keyed.url + path, json=body, timeout=60).status_code == 401
    assert (
        call(
            keyed.url + path, json=body, timeout=60, headers={"Authorization": "Bearer no"}
        ).status_code
        == 401
    )
    assert call(keyed.url + path, json=body, timeout=60, headers=AUTH).status_code == 200


@pytest.mark.server
def test_probes_and_scrapers_stay_open(keyed):
    assert requests.get(keyed.url + "/health", timeout=30).status_code == 200
    metrics = requests.get(keyed.url + "/metrics", timeout=30)
    assert metrics.status_code == 200 and "dflash_" in metrics.text
    assert KEY not in keyed.log_path.read_text()


@pytest.mark.server
def test_sigterm_during_streaming_ends_cleanly(keyed):
    """Runs last: in-flight streams end (finished or closed), the tree exits in bounded time."""
    tree = [keyed.proc.pid, *(c.pid for c in psutil.Process(keyed.proc.pid).children(True))]
    chunks: list[list[str]] = [[] for _ in range(3)]

    def stream(out: list[str]) -> None:
        body = {**CHAT, "max_tokens": 3000, "stream": True, "ignore_eos": True}
        try:
            with requests.post(keyed.url + "/v1/chat/completions", json=body, headers=AUTH,
                               stream=True, timeout=120) as r:  # fmt: skip
                for line in r.iter_lines():
                    out.append(line.decode())
        except requests.RequestException as e:
            out.append(f"closed: {type(e).__name__}")

    threads = [threading.Thread(target=stream, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(len(c) > 5 for c in chunks) and time.monotonic() < deadline:
        time.sleep(0.1)
    start = time.monotonic()
    keyed.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a stream hung after SIGTERM"
    keyed.proc.wait(timeout=60)
    took = time.monotonic() - start
    time.sleep(1)
    assert not _alive(tree)
    assert took < 60
    for c in chunks:  # each stream either finished or ended; never a half-written line
        assert c[-1] in ("data: [DONE]", "") or c[-1].startswith(("closed:", "data: {")), c[-3:]
