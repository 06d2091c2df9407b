"""`bench/process_counters.py`: arms with extra launcher flags, and the counters it reads."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _module():
    sys.path.insert(0, str(BENCH))
    import process_counters

    return process_counters


def test_an_arm_takes_extra_flags_as_flag_value_pairs():
    arms = {"width1": ["--dflash-widths", "1"]}
    parse = _module().parse_arm
    assert parse("width1", arms) == ["--dflash-widths", "1"]
    assert parse("width1:--dflash-cpu-arena-cache=off:--x=a=b", arms) == [
        "--dflash-widths", "1", "--dflash-cpu-arena-cache", "off", "--x", "a=b",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="unknown arm 'plain'"):
        parse("plain", arms)
    with pytest.raises(ValueError, match=":--flag=value"):
        parse("width1:--dflash-cpu-arena-cache", arms)


def test_counters_of_this_process_grow_with_touched_pages():
    counters = _module().process_counters
    pages = 2000
    fresh = mmap.mmap(-1, pages * mmap.PAGESIZE)  # anonymous: no page there until touched
    fresh.madvise(mmap.MADV_NOHUGEPAGE)  # one fault a page, not one per 2 MiB
    before = counters(os.getpid())
    for page in range(pages):
        fresh[page * mmap.PAGESIZE] = 1
    after = counters(os.getpid())
    fresh.close()
    assert after["minor_faults"] - before["minor_faults"] >= pages // 2
    assert any(k.startswith("cpu_s thread") for k in after)
