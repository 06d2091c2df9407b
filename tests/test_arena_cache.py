"""The cache in front of CPython's arena allocator (`kernels/arena_cache.py`).

Each case runs in a fresh interpreter: installing replaces the allocator for the whole
process, and the page-fault counts must not see pytest's own allocations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dflash_sglang import cpu_platform
from dflash_sglang.kernels import arena_cache

# Recursion that crosses frame-stack chunk boundaries on the way down and back, many times:
# without the cache each crossing maps a fresh 16-KiB chunk and faults its pages in.
CROSSINGS = """
import resource
def deep(n):
    return 0 if n == 0 else deep(n - 1) + 1
deep(400)  # the first chunks mapped before counting
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2000):
    deep(400)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
"""


def run(code: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def built():
    if arena_cache.extension() is None:
        pytest.skip("the arena cache cannot be built here (no compiler)")


def test_chunk_crossings_stop_faulting_with_the_cache():
    plain = run(CROSSINGS + "import json; print(json.dumps({'faults': faults}))")
    cached = run(
        "from dflash_sglang.kernels import arena_cache\n"
        "assert arena_cache.install()\n"
        + CROSSINGS
        + "import json; print(json.dumps({'faults': faults, **arena_cache.stats()}))"
    )
    assert plain["faults"] >= 2000, plain  # the thrash the cache exists for
    assert cached["faults"] < plain["faults"] / 10, (plain, cached)
    assert cached["hits"] >= 2000 and cached["cached"] <= cached["capacity"] == 8, cached


def test_resize_bounds_and_bad_sizes():
    stats = run(
        """
        import json
        from dflash_sglang.kernels import arena_cache
        ext = arena_cache.extension()
        errors = []
        for bad in (0, 65, -1):
            try:
                ext.install(bad)
            except ValueError as e:
                errors.append(str(e))
        arena_cache.install(4)
        def deep(n):
            return 0 if n == 0 else deep(n - 1) + 1
        deep(900)  # frees many chunks at once: only 4 kept
        four = arena_cache.stats()["cached"]
        arena_cache.install(1)  # shrinking releases the surplus now
        print(json.dumps({"errors": errors, "four": four, **arena_cache.stats()}))
        """
    )
    assert len(stats["errors"]) == 3 and all("1..64" in e for e in stats["errors"])
    assert stats["four"] == 4 and stats["cached"] == 1 and stats["capacity"] == 1


def test_cpu_platform_installs_it_only_when_asked():
    code = """
        import json, os
        from dflash_sglang import cpu_platform
        from dflash_sglang.kernels import arena_cache
        cpu_platform.activate()
        print(json.dumps(arena_cache.stats()))
        """
    env = cpu_platform.child_environment(dict(os.environ))  # as the launcher's children
    env[cpu_platform.ARENA_CACHE_ENV] = "on"
    assert run(code, env)["installed"] is True
    env[cpu_platform.ARENA_CACHE_ENV] = "off"
    assert run(code, env)["installed"] is False
