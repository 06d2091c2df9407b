"""Deferred KV injection (`kv_injection.DeferredRows`, CPU): what several steps held and
wrote in one call must leave the draft KV pool as injecting every step would have.

The draft and pool are upstream's (`tests.draft_kv`, via the injection-kernel tests'
shapes); the worker's use of it (written before drafting, prefills, and after a request
leaves) is checked end to end against the reference loop in `test_training_e2e.py`.
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.runtime_context import use_context

from dflash_sglang import kv_injection
from tests.draft_kv import runtime
from tests.test_kernels_kv_inject import buffers, make_draft, make_pool, make_rows


class Req:
    """A stand-in for SGLang's `Req`: only its identity matters here."""


def test_rows_come_back_in_order_committed_only():
    deferred = kv_injection.DeferredRows(max_rows=100)
    assert deferred.take() is None
    a, b = Req(), Req()
    hidden = torch.arange(8.0).view(8, 1)  # 2 requests x width 4
    full = deferred.add(hidden, torch.arange(8), torch.arange(8) + 10, torch.tensor([1, 3]), [a, b])
    assert not full and len(deferred) == 4
    deferred.add(hidden[:2], torch.arange(2), torch.arange(2) + 20, torch.tensor([0, 1]), [a, b])
    # width 1 with every row committed (the shortcut); the rows are copies, not views
    step = (hidden[:2] + 100, torch.arange(2) + 30, torch.arange(2) + 40)
    deferred.add(*step, torch.tensor([1, 1]), [a, b])
    step[0].zero_()
    rows = deferred.take()
    assert rows[0].view(-1).tolist() == [0.0, 4.0, 5.0, 6.0, 1.0, 100.0, 101.0]
    assert rows[1].tolist() == [0, 4, 5, 6, 1, 30, 31]
    assert rows[2].tolist() == [10, 14, 15, 16, 21, 40, 41]
    assert len(deferred) == 0 and deferred.take() is None


def test_full_when_max_rows_are_held():
    deferred = kv_injection.DeferredRows(max_rows=3)
    one = (torch.zeros(2, 1), torch.arange(2), torch.arange(2), torch.tensor([1, 1]), [Req()])
    assert not deferred.add(*one)
    assert deferred.add(*one)
    with pytest.raises(ValueError, match="max_rows"):
        kv_injection.DeferredRows(max_rows=0)


def test_a_request_that_left_the_batch_is_noticed():
    deferred = kv_injection.DeferredRows(max_rows=100)
    a, b, c = Req(), Req(), Req()
    assert not deferred.left_batch([])  # nothing held: nothing to write
    deferred.add(torch.zeros(2, 1), torch.arange(2), torch.arange(2), torch.tensor([1, 1]), [a, b])
    assert not deferred.left_batch([a, b])
    assert not deferred.left_batch([b, a, c])  # a request joining is harmless
    assert deferred.left_batch([a, c])
    deferred.take()
    assert not deferred.left_batch([c])


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_one_deferred_write_equals_a_write_per_step(dtype_name):
    """Three steps' committed rows (some requests commit nothing) written once, against
    `inject_stacked` after every step: the same slots written, the same values."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model = make_draft("qwen3", dtype, torch.device("cpu"))
    every_step, deferred_pool = make_pool(dtype, 0, "cpu"), make_pool(dtype, 0, "cpu")
    before = [b.clone() for b in buffers(deferred_pool)]
    deferred = kv_injection.DeferredRows(max_rows=1000)
    hidden, positions, cache_loc, commit_lens = make_rows(bs=6, block=8, seed=1)
    hidden = hidden.to(dtype)
    reqs = [Req() for _ in range(2)]
    with use_context(runtime()), torch.inference_mode():
        stacked = kv_injection.stack_kv_weights(model)
        for step in range(3):  # 2 requests x 8 rows per step, distinct slots throughout
            rows = slice(16 * step, 16 * (step + 1))
            lens = commit_lens[2 * step : 2 * step + 2]
            args = (hidden[rows], positions[rows], cache_loc[rows])
            kv_injection.inject_stacked(model, stacked, every_step, *args, lens)
            assert not deferred.add(*args, lens, reqs)
        held = deferred.take()
        assert held[0].shape[0] == int(commit_lens.sum()) > 0
        kv_injection.inject_stacked(model, stacked, deferred_pool, *held)
    tolerance = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=0, rtol=0)}
    for got, want, old in zip(buffers(deferred_pool), buffers(every_step), before, strict=True):
        torch.testing.assert_close(got, want, **tolerance[dtype])
        written = (got != old).flatten(1).any(1).nonzero().view(-1)
        assert set(written.tolist()) <= set(held[2].tolist())
