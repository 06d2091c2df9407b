"""Headless Debian Chromium for page tests: a screenshot and the DOM after scripts ran."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

# The machine's network is closed: without these, Chromium stalls on background fetches.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1240,760",
    "--virtual-time-budget=8000",
]


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        raise RuntimeError("Debian chromium is not installed: run `make system-deps`")
    return path


def _run(url: str, *args: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", *args, url],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
    return done.stdout


def dump_dom(url: str) -> str:
    return _run(url, "--dump-dom")


def screenshot(url: str, out: Path) -> Path:
    _run(url, f"--screenshot={out}")
    return out
