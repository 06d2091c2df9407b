"""Real SGLang server processes for tests, started through our launcher."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash_sglang.managed_server import Server, free_port
from dflash_sglang.options import PURE_DFLASH_ARGS

__all__ = ["PURE_DFLASH", "Server", "ar_and_dflash", "free_port"]

# The DFlash block verified whole every step: what tests comparing exact acceptance
# against the reference loop (or a pair of known acceptance) serve.
PURE_DFLASH = list(PURE_DFLASH_ARGS)


@contextmanager
def ar_and_dflash(common: list[str], draft: Path, log_dir: Path) -> Iterator[tuple[Server, Server]]:
    """The same target served twice: without speculation, and with DFLASH_X and `draft`."""
    ar = Server([*common, "--speculative-algorithm", "NONE"], log_dir / "ar.log")
    try:
        dx = Server([*common, "--speculative-draft-model-path", str(draft)], log_dir / "dx.log")
    except Exception:
        ar.stop()
        raise
    try:
        yield ar, dx
    finally:
        ar.stop()
        dx.stop()
