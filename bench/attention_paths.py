"""One attention layer of the embedded SmolLM2 (bf16, 9 query / 3 KV heads of 64) through
torch's SDPA CPU kernel and through `grouped_attention`, the two paths `dflash_cpu` picks
between by batch shape (`build_padded_batch`): which is faster at which requests x query
rows x keys. Causal mask as in decode/verify (none for a request alone at one row).

    python bench/attention_paths.py [--threads 2] [--batch 1,4,16] [--rows 1,4,8,16]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F

from dflash_sglang.cpu_platform.attention import attention_mask, grouped_attention

HEADS, KV_HEADS, DIM = 9, 3, 64


def _ms(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def _inputs(bs: int, rows: int, keys: int):
    query = torch.randn(bs, HEADS, rows, DIM, dtype=torch.bfloat16)
    key = torch.randn(bs, KV_HEADS, keys, DIM, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    q_lens = torch.full((bs,), rows)
    mask = attention_mask(q_lens, torch.full((bs,), keys), rows, keys, causal=True)
    return query, key, value, None if bool(mask.all()) else mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--keys", default="128,512,1024")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| requests | query rows | keys | SDPA (ms) | grouped (ms) | SDPA / grouped |")
    print("|---|---|---|---|---|---|")
    scale = DIM**-0.5
    with torch.inference_mode():
        for bs in map(int, args.batch.split(",")):
            for rows in map(int, args.rows.split(",")):
                for keys in map(int, args.keys.split(",")):
                    q, k, v, mask = _inputs(bs, rows, keys)
                    sdpa = functools.partial(
                        F.scaled_dot_product_attention,
                        q, k, v, attn_mask=mask, scale=scale, enable_gqa=True,
                    )  # fmt: skip
                    grouped = functools.partial(grouped_attention, q, k, v, mask, scale)
                    torch.testing.assert_close(sdpa(), grouped(), atol=2e-2, rtol=2e-2)
                    a, b = _ms(sdpa, args.reps), _ms(grouped, args.reps)
                    print(f"| {bs} | {rows} | {keys} | {a:.3f} | {b:.3f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
