"""SGLang plugin entry point (`sglang.srt.plugins`): registers DFLASH_X in every process.

SGLang spawns its scheduler and detokenizer fresh, and calls this in each of them, so
everything a process needs (the algorithm, the CPU attention backend, CPU patches) is
registered here rather than in the launcher.
"""

from __future__ import annotations

import logging

from dflash_sglang import ALGORITHM

logger = logging.getLogger(__name__)
_registered = False


def _worker_factory(server_args) -> type:
    from dflash_sglang.worker import DFlashXWorker

    return DFlashXWorker


def register() -> None:
    """Idempotent: SGLang may call plugins more than once per process."""
    global _registered
    if _registered:
        return
    _registered = True

    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.utils import is_cpu

    from dflash_sglang import backends
    from dflash_sglang.cpu_platform import activate
    from dflash_sglang.spec import DFlashXSpec, validate_server_args

    backends.register()
    if is_cpu():
        activate()
    SpeculativeAlgorithm.register(
        ALGORITHM,
        supports_overlap=True,
        validate_server_args=validate_server_args,
        spec_class=DFlashXSpec,
    )(_worker_factory)
    logger.debug("%s registered", ALGORITHM)
