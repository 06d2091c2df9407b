"""Run one level: a headless locust process with exactly `concurrency` users.

Locust runs as a subprocess so its gevent monkeypatching never touches the sweep process.
Bounded twice: the users stop after `num_requests`, locust's `-t` stops the run at
`max_seconds`, and the subprocess is killed if it outlives that by `GRACE_S`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
GRACE_S = 60.0
SPAWN_RATE = 100  # users per second: every level's users start within a third of a second


@dataclass(frozen=True)
class LevelPlan:
    url: str
    model: str
    concurrency: int
    num_requests: int
    max_tokens: int
    ignore_eos: bool
    extra_body: dict[str, Any]
    max_seconds: float


def locust_command(plan: LevelPlan, prompts_file: Path, results_file: Path) -> list[str]:
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE),
        "--headless", "--only-summary", "--exit-code-on-error", "0",
        "-u", str(plan.concurrency), "-r", str(SPAWN_RATE), "-t", f"{plan.max_seconds:g}s",
        "-H", plan.url,
        "--csv", str(results_file.with_suffix("")) + "_locust",
        "--prompts-file", str(prompts_file),
        "--results-file", str(results_file),
        "--num-requests", str(plan.num_requests),
        "--max-tokens", str(plan.max_tokens),
        "--model", plan.model,
        "--extra-body", json.dumps(plan.extra_body),
        "--request-timeout", f"{plan.max_seconds:g}",
    ]  # fmt: skip
    return [*cmd, "--ignore-eos"] if plan.ignore_eos else cmd


def run_level(plan: LevelPlan, prompts_file: Path, results_file: Path) -> list[dict[str, Any]]:
    """The level's per-request records (one JSON line each, written by the locust users)."""
    # Locust runs in another directory: hand it absolute paths.
    prompts_file, results_file = prompts_file.resolve(), results_file.resolve()
    results_file.unlink(missing_ok=True)
    log_file = results_file.with_suffix(".log")
    with log_file.open("w") as log:
        try:
            proc = subprocess.run(
                locust_command(plan, prompts_file, results_file),
                cwd=results_file.parent,  # locust puts its cwd on sys.path: keep it a data dir
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=plan.max_seconds + GRACE_S,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"locust did not stop in {e.timeout:g} s; see {log_file}") from e
    if proc.returncode != 0 or not results_file.exists():
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"locust failed (exit {proc.returncode}); {log_file}:\n{tail}")
    with results_file.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
