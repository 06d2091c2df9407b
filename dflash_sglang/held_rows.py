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
`add`) drops the held row at that slot first. Rows are kept in a ring of `capacity` rows
with a slot -> row map, so each of these is a few tensor ops whatever is held.
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
        self._positions = torch.zeros(capacity, dtype=torch.int64)
        self._slots = torch.zeros(capacity, dtype=torch.int64)
        self._owner = torch.full((capacity,), -1, dtype=torch.int64)  # serial; -1: left
        self._valid = torch.zeros(capacity, dtype=torch.bool)
        self._row_of_slot = torch.full((0,), -1, dtype=torch.int64)  # grows with the slots
        self._head = 0  # rows [0, head) are in use; valid or not
        # Requests that added rows, by id, held so an id is not reused while we look.
        self._running: dict[int, tuple[object, int]] = {}
        self._serials = 0
        self.dropped = 0  # rows dropped unread by `flush`, ever (a metric)

    def __len__(self) -> int:
        return int(self._valid[: self._head].sum())

    def room(self) -> int:
        return self.capacity - self._head

    def retire(self, reqs: Sequence) -> None:
        """`reqs` is the decode batch: rows of requests not in it (finished or retracted)
        are no longer the drafter's, only a later prefix match's."""
        present = {id(req) for req in reqs}
        gone = [key for key in self._running if key not in present]
        if not gone:
            return
        serials = torch.tensor([self._running.pop(key)[1] for key in gone])
        owner = self._owner[: self._head]
        owner[torch.isin(owner, serials)] = -1

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
        owners = torch.tensor([self._serial_of(req) for req in reqs], dtype=torch.int64)
        if width > 1:  # a plain-decoding step commits its one row per request
            rows = committed_rows(commit_lens, width)
            target_hidden, positions, slots = target_hidden[rows], positions[rows], slots[rows]
            owners = owners[rows // width]
        n = slots.numel()
        if n > self.room():
            raise RuntimeError(f"{n} rows do not fit in {self.room()} (flush first)")
        if self._hidden is None:
            self._hidden = target_hidden.new_empty(self.capacity, target_hidden.shape[1])
        slots = slots.to(torch.int64)
        self.discard(slots)
        self._grow_map(slots)
        at = slice(self._head, self._head + n)
        self._hidden[at] = target_hidden[:n]
        self._positions[at] = positions
        self._slots[at] = slots
        self._owner[at] = owners
        self._valid[at] = True
        self._row_of_slot[slots] = torch.arange(self._head, self._head + n)
        self._head += n

    def discard(self, slots: torch.Tensor) -> None:
        """`slots` get new rows elsewhere (a prefill's): their held rows are stale."""
        rows = self._rows_at(slots)
        self._drop(rows[rows >= 0])

    def take_slots(self, slots: torch.Tensor) -> Rows | None:
        """The held rows at `slots` (a prefill's radix-cached prefix), released."""
        rows = self._rows_at(slots)
        return self._take(rows[rows >= 0])

    def take_running(self) -> Rows | None:
        """Every held row of a request still in the batch, in the order added, released."""
        live = self._valid[: self._head] & (self._owner[: self._head] >= 0)
        return self._take(live.nonzero().view(-1))

    def flush(self) -> Rows | None:
        """The running rows, released; every other row dropped and the ring emptied."""
        rows = self.take_running()
        unread = self._valid[: self._head].nonzero().view(-1)
        self.dropped += unread.numel()
        self._drop(unread)
        self._head = 0
        return rows

    def _serial_of(self, req) -> int:
        entry = self._running.get(id(req))
        if entry is None:
            entry = self._running[id(req)] = (req, self._serials)
            self._serials += 1
        return entry[1]

    def _grow_map(self, slots: torch.Tensor) -> None:
        need = int(slots.max()) + 1 if slots.numel() else 0
        size = self._row_of_slot.numel()
        if need > size:
            grown = torch.full((max(need, 2 * size),), -1, dtype=torch.int64)
            grown[:size] = self._row_of_slot
            self._row_of_slot = grown

    def _rows_at(self, slots: torch.Tensor) -> torch.Tensor:
        slots = slots.to(torch.int64).view(-1)
        known = slots < self._row_of_slot.numel()
        rows = torch.full_like(slots, -1)
        rows[known] = self._row_of_slot[slots[known]]
        return rows

    def _drop(self, rows: torch.Tensor) -> None:
        self._row_of_slot[self._slots[rows]] = -1
        self._valid[rows] = False

    def _take(self, rows: torch.Tensor) -> Rows | None:
        if rows.numel() == 0:
            return None
        taken = (self._hidden[rows], self._positions[rows], self._slots[rows])
        self._drop(rows)
        if not self._valid[: self._head].any():
            self._head = 0
        return taken
