"""What holding committed draft-KV rows costs a decode step (`held_rows.HeldRows`, CPU).

    python bench/held_rows_cost.py [--batch 1,4,16] [--steps 3000] [--out F.json]

Replays the worker's per-step calls on a holder: `retire` and `add` of one row per request
(a width-1 step; every `--draft-every` steps a width-4 step committing 1-4 rows per
request, followed by the drafter's `take_running`), and `len` (the held-rows gauge), with
the embedded pair's feature width (2,880: five taps of 576). Requests finish and are
replaced every `--reply` steps, so rows of finished requests pile up and the ring fills
and flushes as in a server. Prints microseconds per step, split into the width-1 steps'
bookkeeping and the drafting steps' read. One thread: the holder's work is single-threaded
small tensor ops and Python.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dflash_sglang.cpu_platform import install_sgl_kernel_shim

install_sgl_kernel_shim()  # with SGLang's CPU engine, its KV pool imports sgl_kernel

from dflash_sglang.held_rows import HeldRows  # noqa: E402
from dflash_sglang.options import DEFAULT_DEFER_ROWS, at_least  # noqa: E402

FEATURES = 2880


class Req:
    """Stands in for SGLang's `Req`: the holder keys requests by identity."""


def run(bs: int, steps: int, draft_every: int, reply: int) -> dict[str, float]:
    held = HeldRows(DEFAULT_DEFER_ROWS)
    gen = torch.Generator().manual_seed(bs)
    reqs = [Req() for _ in range(bs)]
    next_slot, plain_ns, draft_ns, plain_steps, draft_steps, peak = 0, 0, 0, 0, 0, 0
    for step in range(steps):
        if step and step % reply == 0:  # one request finishes, a new one takes its place
            reqs[step // reply % bs] = Req()
        drafting = draft_every and step % draft_every == draft_every - 1
        width = 4 if drafting else 1
        slots = torch.arange(next_slot, next_slot + bs * width)
        next_slot += bs * width
        hidden = torch.randn(bs * width, FEATURES, generator=gen).to(torch.bfloat16)
        positions = slots.clone()
        commit = torch.randint(1, width + 1, (bs,), generator=gen)
        start = time.perf_counter_ns()
        held.retire(reqs)
        if drafting:
            held.take_running()
        if held.room() < slots.numel():
            held.flush()
        held.add(hidden, positions, slots, commit, reqs)
        peak = max(peak, len(held))  # the held-rows gauge reads it every step
        ns = time.perf_counter_ns() - start
        if drafting:
            draft_ns, draft_steps = draft_ns + ns, draft_steps + 1
        else:
            plain_ns, plain_steps = plain_ns + ns, plain_steps + 1
    return {
        "batch": bs,
        "width1_step_us": plain_ns / max(plain_steps, 1) / 1e3,
        "drafting_step_us": draft_ns / max(draft_steps, 1) / 1e3,
        "peak_held_rows": peak,
        "dropped_rows": held.dropped,
    }


def _batches(text: str) -> list[int]:
    parse = at_least("--batch", 1)
    return [parse(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=_batches, default="1,4,16", help="requests a step, comma list")
    ap.add_argument("--steps", type=at_least("--steps", 1), default=3000)
    ap.add_argument("--draft-every", type=at_least("--draft-every", 0), default=10)
    ap.add_argument("--reply", type=at_least("--reply", 1), default=40)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [run(bs, args.steps, args.draft_every, args.reply) for bs in args.batch]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
