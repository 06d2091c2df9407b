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
        (["--arms", "ar", "--temperature", "-1"], "--temperature: must be >= 0"),
        (["--arms", "ar", "--top-p", "0"], "--top-p: must be in (0, 1]"),
    ],
)
def test_bad_arm_and_base_combinations_name_the_flag(args, message):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
    assert done.returncode == 2
    assert message in done.stderr
