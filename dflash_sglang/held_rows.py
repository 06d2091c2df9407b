"""Committed rows held back from the draft KV cache until something reads them (CPU).

On a CPU, injecting a committed token's target features into the draft KV cache costs
~17 µs a row (the `fc` and stacked K/V GEMMs) and ~0.5 ms a call. Under load the planner
runs the drafter on few steps, and a row only matters once something reads its slot:

- the drafter, over the requests of its batch: `take_running` before it runs;
- a prefill whose radix-cache prefix covers the slot (the next turn of a conversation
  reads the last turn's reply): `take_slots` before it runs.

Rows of requests that left the batch wait for the second case and are dropped when the
holder fills (`flush`): a missing draft KV row can only lower acceptance, never change
the output, which the target verifies token by token.

A slot that is freed and given to another request must never receive its old row after
its new one: every new row of a slot (a prefill's write, `discard`; a newer held row,
`add`) drops the held row at that slot first.

Only the features live in a tensor (a ring of `capacity` rows); the bookkeeping — each
row's slot and position, the slot -> row map, the rows each running request added — is
plain Python. `add` runs on every decode step, the drafter idle or not, for a handful of
rows: with the bookkeeping in tensors (~25 tiny ops) a width-1 step's holding took 44-49
µs, now 8-14 (`bench/held_rows_cost.py`); the reads (`take_*`, `discard`) run on drafting
steps and prefills, where a Python pass over the rows is small beside a forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_sglang.kv_injection import committed_rows

Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # features [n, D], positions, slots


class HeldRows:
    """Draft-KV rows not written yet: (target features, position, draft KV slot, owner)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._hidden: torch.Tensor | None = None  # [capacity, D], allocated on the first add
        self._positions: list[int] = []  # per row in use, valid or not: its position and slot
        self._slots: list[int] = []
        self._row_of_slot: dict[int, int] = {}  # valid rows only
        # Requests in the batch that added rows, by id (held so an id is not reused while
        # we look), with the rows each added since the drafter last read them.
        self._running: dict[int, tuple[object, list[int]]] = {}
        self.dropped = 0  # rows dropped unread by `flush`, ever (a metric)

    def __len__(self) -> int:
        return len(self._row_of_slot)

    @property
    def _head(self) -> int:  # rows [0, head) are in use; valid or not
        return len(self._slots)

    def room(self) -> int:
        return self.capacity - self._head

    def retire(self, reqs: Sequence) -> None:
        """`reqs` is the decode batch: rows of requests not in it (finished or retracted)
        are no longer the drafter's, only a later prefix match's."""
        present = {id(req) for req in reqs}
        for key in [key for key in self._running if key not in present]:
            del self._running[key]

    def add(
        self,
        target_hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        commit_lens: torch.Tensor,
        reqs: Sequence,
    ) -> None:
        """Hold the committed rows of a decode step over `reqs`: `[bs*w]` rows in bs blocks,
        the first `commit_lens[i]` of block i committed. The caller makes room first
        (`room`, `flush`)."""
        bs = commit_lens.numel()
        width = slots.numel() // max(bs, 1)
        owners = [self._rows_of(req) for req in reqs]
        if width > 1:  # a plain-decoding step commits its one row per request
            rows = committed_rows(commit_lens, width)
            target_hidden, positions, slots = target_hidden[rows], positions[rows], slots[rows]
            owners = [owners[r // width] for r in rows.tolist()]
        n = len(owners)
        if n > self.room():
            raise RuntimeError(f"{n} rows do not fit in {self.room()} (flush first)")
        if self._hidden is None:
            self._hidden = target_hidden.new_empty(self.capacity, target_hidden.shape[1])
        head = self._head
        self._hidden[head : head + n] = target_hidden[:n]
        slot_list = slots.tolist()
        self.discard(slot_list)
        self._positions += positions.tolist()
        self._slots += slot_list
        for row, (slot, added) in enumerate(zip(slot_list, owners, strict=True), start=head):
            added.append(row)
            self._row_of_slot[slot] = row

    def discard(self, slots: torch.Tensor | Sequence[int]) -> None:
        """`slots` get new rows elsewhere (a prefill's): their held rows are stale."""
        if self._row_of_slot:
            for slot in _ints(slots):
                self._row_of_slot.pop(slot, None)

    def take_slots(self, slots: torch.Tensor) -> Rows | None:
        """The held rows at `slots` (a prefill's radix-cached prefix), released."""
        found = (self._row_of_slot.get(slot) for slot in dict.fromkeys(_ints(slots)))
        return self._take([row for row in found if row is not None])

    def take_running(self) -> Rows | None:
        """Every held row of a request still in the batch, in the order added, released."""
        rows = sorted(row for _, added in self._running.values() for row in added)
        for _, added in self._running.values():
            added.clear()  # every valid one is taken now
        return self._take([row for row in rows if self._is_valid(row)])

    def flush(self) -> Rows | None:
        """The running rows, released; every other row dropped and the ring emptied."""
        rows = self.take_running()
        self.dropped += len(self._row_of_slot)
        self._row_of_slot.clear()
        self._reset()
        return rows

    def _rows_of(self, req) -> list[int]:
        """The rows a request added (its list, to append to), registered on its first."""
        entry = self._running.get(id(req))
        if entry is None:
            entry = self._running[id(req)] = (req, [])
        return entry[1]

    def _is_valid(self, row: int) -> bool:
        return self._row_of_slot.get(self._slots[row]) == row

    def _reset(self) -> None:
        """Nothing valid left: the ring starts over."""
        self._positions.clear()
        self._slots.clear()
        for _, added in self._running.values():
            added.clear()

    def _take(self, rows: list[int]) -> Rows | None:
        if not rows:
            return None
        index = torch.tensor(rows)
        taken = (
            self._hidden[index],
            torch.tensor([self._positions[r] for r in rows]),
            torch.tensor([self._slots[r] for r in rows]),
        )
        for row in rows:
            del self._row_of_slot[self._slots[row]]
        if not self._row_of_slot:
            self._reset()
        return taken


def _ints(slots: torch.Tensor | Sequence[int]) -> list[int]:
    return slots.view(-1).tolist() if isinstance(slots, torch.Tensor) else list(slots)
