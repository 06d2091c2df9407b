"""Soak: the default launch under steady load through the locust users, then what is left.

    python bench/soak.py --out bench/reliability/soak          # ~25-30 min

Starts `python -m dflash_sglang.launch_server` (embedded SmolLM2 + bundled drafter, default
launch, metrics on), runs one sweep level of `--concurrency` locust users on mixed real
prompts until `--requests` requests are done (sized for >= 20 minutes on a 2-core CPU), and
reports: failed/unfinished requests (from the sweep), KV rows still held by requests
afterwards (`/v1/loads`, after SGLang's idle leak check has run), the scheduler's RSS before
the load, once a minute during it and at the end, and τ and output tok/s per minute from
`/dflash/stats/series` (plotted). Exit status 1 when a request failed, the pool did not
drain, or a leak was logged.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_sglang.loadtest import server_metrics  # noqa: E402
from dflash_sglang.managed_server import Server, scheduler_processes  # noqa: E402


def scheduler_rss_mb(server: Server) -> float:
    """Resident memory of the server's scheduler process(es)."""
    total = 0
    for process in scheduler_processes(server.proc.pid):
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass
    return round(total / 2**20, 1)


class RssSampler(threading.Thread):
    """The scheduler's RSS once a minute while the load runs: growth that levels off is the
    KV pool's pages being touched; growth that keeps climbing is a leak."""

    def __init__(self, server: Server, every_s: float = 60.0) -> None:
        super().__init__(daemon=True)
        self.server, self.every_s = server, every_s
        self.samples: list[tuple[float, float]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        start = time.time()
        while not self.stopped.wait(0 if not self.samples else self.every_s):
            self.samples.append(
                (round((time.time() - start) / 60, 1), scheduler_rss_mb(self.server))
            )


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = points[0]["time"]
    minutes = [(p["time"] - t0) / 60 for p in points]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    top.plot(minutes, [p["output_tokens_per_s"] for p in points], marker=".")
    top.set_ylabel("output tok/s")
    bottom.plot(minutes, [p["tau"] or float("nan") for p in points], marker=".")
    bottom.set_ylabel("τ")
    bottom.set_xlabel("minutes")
    for ax in (top, bottom):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle("Soak: default launch, per minute")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--out", required=True, help="directory for soak.json, soak.png, the sweep")
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Path(tempfile.mkdtemp(prefix="dflash_soak_")) / "server.log"
    server = Server([], log, threads=args.threads)
    try:
        rss_start = scheduler_rss_mb(server)
        rss = RssSampler(server)
        rss.start()
        start = time.time()
        sweep = subprocess.run(
            [sys.executable, "-m", "loadtest.sweep", "--url", server.url,
             "--concurrency", str(args.concurrency), "--requests-per-level", str(args.requests),
             "--max-tokens", str(args.max_tokens), "--ignore-eos", "--dataset", "mixed",
             "--max-seconds-per-level", "3600", "--out", str(out / "sweep")],
            cwd=REPO, capture_output=True, text=True,
        )  # fmt: skip
        minutes = (time.time() - start) / 60
        rss.stopped.set()
        time.sleep(5)  # idle: SGLang's scheduler runs its leak check
        drained = server_metrics.held_kv_rows(server.url)
        rss_end = scheduler_rss_mb(server)
        series = requests.get(
            server.url + "/dflash/stats/series",
            params={"seconds": min(3600, 60 * minutes + 60), "step_s": 60},
            timeout=30,
        ).json()["points"]
    finally:
        server.stop()
    level = json.loads((out / "sweep" / "sweep.json").read_text())["levels"][0]
    leak = "memory leak" in log.read_text(errors="replace")
    report = {
        "command": "python bench/soak.py " + " ".join(sys.argv[1:]),
        "minutes": round(minutes, 1),
        "concurrency": args.concurrency,
        "requests": level["requests"],
        "failed": level["errors"],
        "unfinished": level["unfinished"],
        "output_tok_s": level["output_tok_s"],
        "tau": level["tau"],
        "kv_rows_held_after": drained,
        "leak_logged": leak,
        "scheduler_rss_mb": {"start": rss_start, "end": rss_end},
        "scheduler_rss_mb_per_minute": rss.samples,
        "per_minute": series,
        "sweep_exit": sweep.returncode,
    }
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    if series:
        plot(series, out / "soak.png")
    print(json.dumps({k: v for k, v in report.items() if k != "per_minute"}, indent=1))
    ok = sweep.returncode == 0 and not drained and not leak and not level["errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
