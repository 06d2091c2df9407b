"""`bench/bench_proposers.py` refuses bad arm/base combinations and sampling settings before
starting any server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_proposers.py"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--arms", "ar@base"], "--base: needed by"),
        (["--arms", "ar", "--base", "HEAD"], "--base: needed by"),
        (["--arms", "ar@base", "--base", "no-such-rev"], "--base: 'no-such-rev' is not a commit"),
        (["--arms", "nope@base", "--base", "HEAD"], "--arms: unknown nope"),
        (["--arms", "dx", "--base-draft", "d"], "--base-draft: only with --base"),
        (["--arms", "dx", "--draft", "/no/such/dir"], "--draft: '/no/such/dir' is not a drafter"),
        (
            ["--arms", "dx@base", "--base", "HEAD", "--base-draft", "/no/such/dir"],
            "--base-draft: '/no/such/dir' is not a drafter",
        ),
        (["--arms", "ar", "--temperature", "-1"], "--temperature: must be >= 0"),
        (["--arms", "ar", "--top-p", "0"], "--top-p: must be in (0, 1]"),
    ],
)
def test_bad_arm_and_base_combinations_name_the_flag(args, message):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
    assert done.returncode == 2
    assert message in done.stderr


def test_steady_window_counts_what_each_stream_delivered_by_then():
    sys.path.insert(0, str(SCRIPT.parent))
    from bench_proposers import tokens_by

    timelines = [[(1.0, 8), (2.0, 16), (3.0, 20)], [(2.5, 8), (4.0, 9)], []]
    assert tokens_by(timelines, 0.5) == 0
    assert tokens_by(timelines, 2.0) == 16
    assert tokens_by(timelines, 2.7) == 16 + 8
    assert tokens_by(timelines, 9.0) == 20 + 9


def test_reports_tell_drafters_of_the_same_name_apart(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    from bench_proposers import identity

    a, b = tmp_path / "a" / "drafter", tmp_path / "b" / "drafter"
    for path, content in ((a, b"v19"), (b, b"v20")):
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(content)
    assert identity(str(a)).startswith("drafter sha256:")
    assert identity(str(a)) != identity(str(b))
    assert str(tmp_path) not in identity(str(a))
    assert identity("random") == "random"
