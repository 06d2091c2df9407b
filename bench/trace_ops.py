"""ATen calls per model forward in a trace from SGLang's own profiler, and where their time goes.

    SGLANG_TORCH_PROFILER_DIR=$PROF python -m dflash_sglang.launch_server \
        --speculative-algorithm NONE &                         # then, during a long request:
    curl -X POST localhost:30000/start_profile -d '{"num_steps": 20, "activities": ["CPU"]}'
    python bench/trace_ops.py $PROF/*.trace.json.gz

Counts the top-level `cpu_op` events (an op inside another op is the outer op's cost) on
the thread that runs `ModelRunner.forward`, inside those forwards, per forward.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json

FORWARD = "model_runner.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("trace", help="a *.trace.json.gz SGLang's profiler wrote")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    events = [e for e in json.load(gzip.open(args.trace))["traceEvents"] if e.get("ph") == "X"]
    forwards = [e for e in events if FORWARD in e["name"] and e["name"].endswith(": forward")]
    if not forwards:
        ap.error(f"{args.trace}: no ModelRunner.forward spans (profile with the Python stack on)")
    thread = forwards[0]["tid"]
    spans = [(f["ts"], f["ts"] + f["dur"]) for f in forwards]
    ops = sorted(
        (e for e in events if e.get("cat") == "cpu_op" and e["tid"] == thread),
        key=lambda e: e["ts"],
    )
    top, end = [], -1.0
    for op in ops:
        if op["ts"] >= end:
            end = op["ts"] + op["dur"]
            if any(a <= op["ts"] < b for a, b in spans):
                top.append(op)
    n = len(forwards)
    wall = sum(f["dur"] for f in forwards) / n / 1000
    op_ms = sum(e["dur"] for e in top) / n / 1000
    print(f"{n} forwards, {wall:.1f} ms each; {len(top) / n:.0f} top-level ATen calls taking")
    print(f"{op_ms:.1f} ms of it (the rest is Python between the calls)")
    time, count = collections.Counter(), collections.Counter()
    for op in top:
        time[op["name"]] += op["dur"]
        count[op["name"]] += 1
    for name, us in time.most_common(args.top):
        print(f"  {name:40s} {count[name] / n:7.1f} per forward {us / n / 1000:7.2f} ms")


if __name__ == "__main__":
    main()
