"""Held draft-KV rows (`held_rows.HeldRows`, CPU): which rows come back when something reads
their slots, which are dropped, and that what several steps held and wrote in one call
leaves the draft KV pool as injecting every step would have.

The draft and pool are upstream's (`tests.draft_kv`, via the injection-kernel tests'
shapes); the worker's use of it (before drafting, before a prefill with a radix-cached
prefix) is checked end to end against injection every step in `test_training_e2e.py`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import use_context

from dflash_sglang import kv_injection
from dflash_sglang.held_rows import HeldRows
from dflash_sglang.worker import DFlashXWorker
from tests.draft_kv import runtime
from tests.test_kernels_kv_inject import buffers, make_draft, make_pool, make_rows


class Req:
    """A stand-in for SGLang's `Req`: only its identity matters here."""


def _step(held: HeldRows, first: float, slots: list[int], reqs, lens=None) -> None:
    """One step of one row per request (width 1), or `lens` committed of width 4."""
    n = len(slots)
    hidden = (torch.arange(float(n)) + first).view(n, 1)
    positions = torch.tensor(slots) + 1000
    commit = torch.ones(len(reqs), dtype=torch.int64) if lens is None else torch.tensor(lens)
    held.add(hidden, positions, torch.tensor(slots), commit, reqs)


def _values(rows) -> list[float]:
    return [] if rows is None else rows[0].view(-1).tolist()


def test_running_rows_come_back_in_order_committed_only_as_copies():
    held = HeldRows(capacity=100)
    assert held.take_running() is None and len(held) == 0
    a, b = Req(), Req()
    _step(held, 0.0, list(range(10, 18)), [a, b], lens=[1, 3])  # width 4: rows 0 and 4-6
    hidden = torch.tensor([[100.0], [101.0]])
    held.add(hidden, torch.tensor([30, 31]), torch.tensor([40, 41]), torch.ones(2), [a, b])
    hidden.zero_()
    assert len(held) == 6 and held.room() == 94
    rows = held.take_running()
    assert _values(rows) == [0.0, 4.0, 5.0, 6.0, 100.0, 101.0]
    assert rows[1].tolist() == [1010, 1014, 1015, 1016, 30, 31]
    assert rows[2].tolist() == [10, 14, 15, 16, 40, 41]
    assert len(held) == 0 and held.take_running() is None
    assert held.room() == 100  # nothing valid left: the ring starts over


def test_each_read_returns_what_was_held_since_the_last():
    """The drafter reads its batch's rows on every drafting step: a second read returns only
    the rows held since the first, while rows a prefix read took or a newer row replaced
    never come back."""
    held = HeldRows(capacity=100)
    a, b, c = Req(), Req(), Req()
    _step(held, 0.0, [10, 20, 30], [a, b, c])
    held.retire([a, b])  # c left: its row waits for a prefix read
    assert _values(held.take_running()) == [0.0, 1.0]
    _step(held, 3.0, [11, 21], [a, b])
    _step(held, 5.0, [12, 11], [a, b])  # slot 11 again: b's newer row replaces a's
    assert _values(held.take_slots(torch.tensor([12]))) == [5.0]
    assert _values(held.take_running()) == [4.0, 6.0]
    assert held.take_running() is None
    assert len(held) == 1 and held.room() == 93  # c's row keeps the ring from starting over
    assert _values(held.take_slots(torch.tensor([30, 30]))) == [2.0]
    assert len(held) == 0 and held.room() == 100


def test_rows_of_a_request_that_left_wait_for_a_prefix_read():
    held = HeldRows(capacity=100)
    a, b = Req(), Req()
    _step(held, 0.0, [10, 20], [a, b])
    _step(held, 2.0, [11, 21], [a, b])
    held.retire([b])  # a finished
    _step(held, 4.0, [22], [b])
    assert _values(held.take_running()) == [1.0, 3.0, 4.0]  # b's rows only
    assert len(held) == 2  # a's, for a later prefill whose prefix covers them
    assert _values(held.take_slots(torch.tensor([5, 11, 10, 99_999]))) == [2.0, 0.0]
    assert len(held) == 0 and held.room() == 100


def test_a_slot_written_again_loses_its_held_row():
    held = HeldRows(capacity=100)
    a, b, c = Req(), Req(), Req()
    _step(held, 0.0, [10, 20, 30], [a, b, c])
    held.retire([b, c])
    held.discard(torch.tensor([10, 500]))  # a's slot now a new prompt's
    _step(held, 3.0, [20, 31], [b, c])  # slot 20 again: the newer row wins
    assert len(held) == 3
    assert _values(held.take_slots(torch.tensor([10, 20]))) == [3.0]
    assert _values(held.take_running()) == [2.0, 4.0]


def test_flush_writes_running_rows_and_drops_the_rest():
    held = HeldRows(capacity=4)
    a, b = Req(), Req()
    _step(held, 0.0, [10, 20], [a, b])
    held.retire([b])
    _step(held, 2.0, [21], [b])
    assert held.room() == 1
    with pytest.raises(RuntimeError, match="flush first"):
        _step(held, 3.0, [22, 23], [b, Req()])
    assert held.dropped == 0
    assert _values(held.flush()) == [1.0, 2.0]
    assert held.room() == 4 and len(held) == 0
    assert held.dropped == 1  # a's row, unread (the metric `dflash_dropped_draft_kv_rows`)
    assert held.take_slots(torch.tensor([10])) is None  # a's row was dropped
    with pytest.raises(ValueError, match="capacity"):
        HeldRows(capacity=0)


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_one_held_write_equals_a_write_per_step(dtype_name):
    """Three steps' committed rows (some requests commit nothing) written once, against
    `inject_stacked` after every step: the same slots written, the same values."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model = make_draft("qwen3", dtype, torch.device("cpu"))
    every_step, held_pool = make_pool(dtype, 0, "cpu"), make_pool(dtype, 0, "cpu")
    before = [b.clone() for b in buffers(held_pool)]
    held = HeldRows(capacity=1000)
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
            held.add(*args, lens, reqs)
        rows = held.take_running()
        assert rows[0].shape[0] == int(commit_lens.sum()) > 0
        kv_injection.inject_stacked(model, stacked, held_pool, *rows)
    tolerance = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=0, rtol=0)}
    for got, want, old in zip(buffers(held_pool), buffers(every_step), before, strict=True):
        torch.testing.assert_close(got, want, **tolerance[dtype])
        written = (got != old).flatten(1).any(1).nonzero().view(-1)
        assert set(written.tolist()) <= set(rows[2].tolist())


def test_a_prefill_writes_the_held_rows_of_its_cached_prefix_and_drops_its_new_slots():
    """The worker's seam: request 0 of the prefill matched slots 10-12 in the radix cache
    (the last turn's reply), request 1 nothing; the prefill's own tokens go to 20-21."""
    worker = object.__new__(DFlashXWorker)
    worker._held = HeldRows(capacity=100)
    written = []
    worker._write_rows = written.append
    req_to_token = torch.zeros(4, 8, dtype=torch.int64)
    req_to_token[2, :3] = torch.tensor([10, 11, 12])
    worker.model_runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token)
    )
    finished, running = Req(), Req()
    _step(worker._held, 0.0, [11, 20, 30], [finished, running, Req()])
    worker._held.retire([running])
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        prefix_lens=[3, 0],
        req_pool_indices=torch.tensor([2, 3]),
        out_cache_loc=torch.tensor([20, 21]),
    )
    worker._before_prefill(batch)
    assert [_values(rows) for rows in written] == [[0.0]]
    assert len(worker._held) == 1  # slot 30's; slot 20's row was stale
    assert worker._held.take_running() is None  # its request left too
