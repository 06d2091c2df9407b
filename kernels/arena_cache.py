"""A cache in front of CPython's arena allocator (`cpu/arena_cache.cpp`), built on first use.

CPython takes the chunks of its frame stack (16 KiB) and obmalloc's arenas (1 MiB) from an
arena allocator that maps and unmaps memory on every call. A hot call that straddles a
frame-stack chunk boundary then maps, faults in and unmaps four pages each time; DFLASH_X's
attention op did that 30 times a target forward (README, "Python's frame stack").
`install()` keeps a few freed blocks for reuse instead.
"""

from __future__ import annotations

import functools
from types import ModuleType

from dflash_sglang.kernels.cpu_build import SOURCES, try_build

SOURCE = SOURCES / "arena_cache.cpp"
# Freed blocks kept for reuse: a few frame-stack chunks and arenas (≤ 8 MiB held).
DEFAULT_BLOCKS = 8


@functools.cache
def extension() -> ModuleType | None:
    """The compiled module, or None (logged) when it cannot be built here."""
    return try_build(SOURCE, "dflash_arena_cache", "CPython maps its frame stack as usual")


def install(blocks: int = DEFAULT_BLOCKS) -> bool:
    """Cache up to `blocks` freed arena blocks in this process (again: resize). False when
    the cache cannot be built here."""
    ext = extension()
    if ext is None:
        return False
    ext.install(blocks)
    return True


def stats() -> dict[str, int | bool]:
    """hits, misses (calls that reached the mapping allocator), cached, capacity, installed."""
    ext = extension()
    return ext.stats() if ext is not None else {"installed": False}
