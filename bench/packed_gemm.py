"""bf16 GEMMs at decode sizes: `mm` on the weight's transposed view (what the compiled
layers ran before `--dflash-cpu-freeze`) against oneDNN on a weight reordered once
(`mkldnn._linear_pointwise`, what inductor emits under freezing and what the LM head and
the drafter's `fc` use).

    python bench/packed_gemm.py [--threads 2] [--rows 1,4,16]

The shapes are the embedded SmolLM2's: gate/up (3072x576), down (576x1536), q/k/v
(960x576), the drafter's fc (576x2880), its restricted head (8192x576) and the LM head
(49152x576). Each is timed in a
tight loop, so the small weights sit partly in cache; the LM head's (56 MB) does not.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

SHAPES = {
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "qkv": (960, 576),
    "draft_fc": (576, 2880),
    "draft_head": (8192, 576),  # the bundled drafter's restricted vocabulary
    "lm_head": (49152, 576),
}


def ms_per_call(fn, reps: int = 200) -> float:
    """Mean wall time of `fn()` in ms after a warm-up (also `bench/attention_paths.py`'s)."""
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mkldnn = torch.ops.mkldnn
    print("| weight | rows | mm (ms) | prepacked (ms) | × |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for name, (out, inp) in SHAPES.items():
            weight = torch.randn(out, inp, dtype=torch.bfloat16)
            packed = mkldnn._reorder_linear_weight(weight, 1)
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, inp, dtype=torch.bfloat16)
                plain = ms_per_call(functools.partial(torch.mm, x, weight.t()))
                fast = ms_per_call(
                    functools.partial(mkldnn._linear_pointwise, x, packed, None, "none", [], "")
                )
                cells = [f"{name} {out}x{inp}", rows, f"{plain:.3f}", f"{fast:.3f}"]
                print("| " + " | ".join(map(str, cells)) + f" | {plain / fast:.2f} |")


if __name__ == "__main__":
    main()
