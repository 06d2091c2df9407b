"""Building the C++ sources under `cpu/` on the machine that runs them.

torch's C++ extension loader compiles a source once per machine (cached under
`TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`) and loads the cached build
afterwards; a changed source or flag rebuilds. `-march=native` is safe because the cache is
per machine.
"""

from __future__ import annotations

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


def try_build(source: Path, name: str, without: str) -> ModuleType | None:
    """`build`, or None with the reason logged when no compiler, headers or ninja can build
    it here; `without` says what the caller does instead."""
    try:
        return build(source, name)
    except (RuntimeError, OSError, ImportError) as e:
        logger.warning("%s not built (%s); %s", name, e, without)
        return None
