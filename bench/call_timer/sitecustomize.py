"""Times, inside a server's processes, every call of our paged attention kernel and of the
compiled target/draft forwards.

`profile_interleaved.py --time-calls` puts this directory first on the servers'
PYTHONPATH, so Python imports it at start-up in each of their processes. It wraps the two
when their modules are first imported (not before: importing SGLang early would run ahead
of the launcher's platform setup), through the attributes their callers look up. Each
process appends `label requests keys rows nanoseconds` lines to
`$DFLASH_CALL_TIMES/<pid>.txt` every 1,000 calls (label: `attention`, `CompiledBody`
(`CompiledBody.prefill` for a prompt's forward), `CompiledDraft`; keys: key positions the
attention call read, or the batch's total length for a forward).

It also times the scheduler's decode steps, which py-spy's samples blur at this grain:
`run_batch`, each `Scheduler.run_batch` call on a decode batch (the worker's whole step:
forward, acceptance or sampling, allocation inside it), and `step_period`, from one decode
`run_batch` to the next over the same number of requests (all of a step, the scheduler's
own work between them included). Their difference to the forward's is what a step adds.

And the phases of a DFLASH_X decode step (`worker.<method>`: lookups, plan, proposal,
verify, acceptance, injection, and the whole `decode_step`; inside a drafting step the
block's forward (`draft_block`), the held rows' catch-up write (`write_rows`), the
restricted draft head (`draft_head`) and the projection of the target's features for
injection (`project_target_hidden`)), each recorded once per step
with the step's verify width, which every decode record carries as `rows` = requests x
width (the forwards: tokens; attention: query rows), so a summary can split by width.
"""

import atexit
import importlib.abc
import importlib.machinery
import os
import sys
import time

DIRECTORY = os.environ.get("DFLASH_CALL_TIMES")
_lines: list[str] = []


def _flush() -> None:
    if _lines:
        with open(os.path.join(DIRECTORY, f"{os.getpid()}.txt"), "a") as f:
            f.writelines(_lines)
        _lines.clear()


def _record(label: str, requests: int, keys: int, rows: int, ns: int) -> None:
    _lines.append(f"{label} {requests} {keys} {rows} {ns}\n")
    if len(_lines) >= 1000:
        _flush()


def _time_kernel(module) -> None:
    kernel = module.paged_attention

    def timed(q, k_buffer, v_buffer, slot_table, kv_lens, *args, **kwargs):
        start = time.perf_counter_ns()
        out = kernel(q, k_buffer, v_buffer, slot_table, kv_lens, *args, **kwargs)
        ns = time.perf_counter_ns() - start
        _record("attention", kv_lens.numel(), int(kv_lens.sum()), q.shape[0], ns)
        return out

    module.paged_attention = timed


def _time_forwards(module) -> None:
    forward = module.CompiledForward.run_fast

    def timed(self, inputs, positions, forward_batch):
        start = time.perf_counter_ns()
        out = forward(self, inputs, positions, forward_batch)
        ns = time.perf_counter_ns() - start
        keys = int(forward_batch.seq_lens_sum or 0)
        label = type(self).__name__
        if forward_batch.forward_mode.is_extend_without_speculative():
            label += ".prefill"  # a prompt's tokens: not a verify width
        _record(label, forward_batch.batch_size, keys, inputs.shape[0], ns)
        return out

    module.CompiledForward.run_fast = timed


# Verify width of the decode step running now (1 for plain decoding), set by the worker.
_width = [1]
WORKER_PHASES = (
    "_suffix_proposals", "plan_step", "propose", "verify", "accept", "_accept_tree",
    "_inject_committed", "draft_block", "_write_rows",
)  # fmt: skip


def _time_steps(module) -> None:
    run_batch = module.Scheduler.run_batch
    last: list = [None]  # (requests, start ns, width) of the last decode run_batch

    def timed(self, batch, *args, **kwargs):
        _width[0] = 1
        start = time.perf_counter_ns()
        out = run_batch(self, batch, *args, **kwargs)
        ns = time.perf_counter_ns() - start
        if batch.forward_mode.is_decode():
            requests = batch.batch_size()
            keys = int(batch.seq_lens_sum or 0)
            _record("run_batch", requests, keys, requests * _width[0], ns)
            if last[0] is not None and last[0][0] == requests:
                _, before, width = last[0]
                _record("step_period", requests, keys, requests * width, start - before)
            last[0] = (requests, start, _width[0])
        else:
            last[0] = None  # a prefill in between is not a decode step's time
        return out

    module.Scheduler.run_batch = timed


def _time_worker(module) -> None:
    worker = module.DFlashXWorker
    phases: dict[str, int] = {}

    def phase(owner, name: str, label: str):
        function = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            out = function(*args, **kwargs)
            phases[label] = phases.get(label, 0) + time.perf_counter_ns() - start
            return out

        setattr(owner, name, timed)

    for name in WORKER_PHASES:
        phase(worker, name, name)
    # Inside a drafting step: the restricted draft head, and the drafter's projection of
    # the target's features (KV injection), which the draft forward's time leaves out.
    phase(module.draft_vocab, "select_extended", "draft_head")
    from sglang.srt.models.dflash import DFlashDraftModel

    phase(DFlashDraftModel, "project_target_hidden", "project_target_hidden")
    decode_step = worker.decode_step

    def timed_step(self, batch, *args, **kwargs):
        phases.clear()
        start = time.perf_counter_ns()
        out = decode_step(self, batch, *args, **kwargs)
        phases["decode_step"] = time.perf_counter_ns() - start
        _width[0] = width = int(out.speculative_num_draft_tokens)
        requests, keys = len(batch.reqs), int(batch.seq_lens_sum or 0)
        for name, ns in phases.items():
            _record(f"worker.{name.lstrip('_')}", requests, keys, requests * width, ns)
        return out

    worker.decode_step = timed_step


PATCHES = {
    "sglang.srt.managers.scheduler": _time_steps,
    "dflash_sglang.kernels.cpu_attention": _time_kernel,
    "dflash_sglang.cpu_platform.compiled": _time_forwards,
    "dflash_sglang.worker": _time_worker,
}


class _Patcher(importlib.abc.MetaPathFinder):
    """Finds the patched modules with the normal path finder, then patches them once
    their code has run."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                PATCHES[name](module)

            spec.loader.exec_module = exec_module
        return spec


if DIRECTORY:
    sys.meta_path.insert(0, _Patcher())
    atexit.register(_flush)
