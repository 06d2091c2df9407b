"""Which forward modes the compiled CPU stack serves (end to end against SGLang's own forward:
test_server_lossless)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from dflash_sglang.cpu_platform.compiled import compiled_modes


@pytest.mark.parametrize(
    ("mode", "compiled"),
    [
        (ForwardMode.DECODE, True),
        (ForwardMode.TARGET_VERIFY, True),
        (ForwardMode.EXTEND, True),  # plain prefill chunks: the same token-count graph
        (ForwardMode.MIXED, False),  # prefill mixed with decode: SGLang's own forward
        (ForwardMode.IDLE, False),
        (ForwardMode.SPLIT_PREFILL, False),
    ],
)
def test_compiled_modes(mode, compiled):
    assert compiled_modes(SimpleNamespace(forward_mode=mode)) is compiled
