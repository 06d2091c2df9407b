"""Times every call of the CPU paged attention kernel in the process that imports it.

`profile_interleaved.py --time-attention` puts this directory first on the servers'
PYTHONPATH, so Python imports it at start-up in each of their processes; the calls are made
through the module attribute, which this wraps. Each process appends `requests keys
query_rows nanoseconds` lines to `$DFLASH_ATTENTION_TIMES/<pid>.txt`, every 1,000 calls.
"""

import atexit
import os
import time

DIRECTORY = os.environ.get("DFLASH_ATTENTION_TIMES")


def _install() -> None:
    from dflash_sglang.kernels import cpu_attention

    kernel, lines = cpu_attention.paged_attention, []
    path = os.path.join(DIRECTORY, f"{os.getpid()}.txt")

    def flush() -> None:
        with open(path, "a") as f:
            f.writelines(lines)
        lines.clear()

    def timed(q, k_buffer, v_buffer, slot_table, kv_lens, *args, **kwargs):
        start = time.perf_counter_ns()
        out = kernel(q, k_buffer, v_buffer, slot_table, kv_lens, *args, **kwargs)
        ns = time.perf_counter_ns() - start
        lines.append(f"{kv_lens.numel()} {int(kv_lens.sum())} {q.shape[0]} {ns}\n")
        if len(lines) >= 1000:
            flush()
        return out

    cpu_attention.paged_attention = timed
    atexit.register(flush)


if DIRECTORY:
    _install()
