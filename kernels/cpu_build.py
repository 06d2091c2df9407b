"""Building the C++ sources under `cpu/` on the machine that runs them.

torch's C++ extension loader compiles a source once per machine (cached under
`TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`) and loads the cached build
afterwards; a changed source or flag rebuilds. `-march=native` is safe because the cache is
per machine.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("cpu")
FLAGS = ["-O3", "-march=native", "-fopenmp"]


def build(source: Path, name: str) -> ModuleType:
    """Compile (or load the cached build of) one revision of a source as module `name`
    (its `PyInit_<name>`); a bench builds an older revision under another name to time
    both in one process."""
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=name, sources=[str(source)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"]
    )


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU as /proc/cpuinfo lists them (empty where there
    is no such file)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(
        next((line.split(":")[1].split() for line in lines if line.startswith("flags")), [])
    )


def try_build(
    source: Path, name: str, without: str, needs: frozenset[str] = frozenset()
) -> ModuleType | None:
    """`build`, or None with the reason logged when no compiler, headers or ninja can build
    it here, or when the CPU lacks an instruction set in `needs` (checked first: the
    compiler takes ~40 s to reach the source's own `#error`); `without` says what the
    caller does instead."""
    missing = needs - cpu_flags()
    if missing:
        logger.warning(
            "%s not built (this CPU lacks %s); %s", name, ", ".join(sorted(missing)), without
        )
        return None
    try:
        return build(source, name)
    except (RuntimeError, OSError, ImportError) as e:
        logger.warning("%s not built (%s); %s", name, e, without)
        return None
