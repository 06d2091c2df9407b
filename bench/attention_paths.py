"""One attention layer of the embedded SmolLM2 (bf16, 9 query / 3 KV heads of 64) through
torch's SDPA CPU kernel and through `grouped_attention`, the two paths `dflash_cpu` picks
between by batch shape (`build_padded_batch`): which is faster at which requests x query
rows x keys. Causal mask as in decode/verify (none for a request alone at one row). K/V are
gathered from a paged pool as the backend gathers them (`[bs, kv_heads, keys, dim]` views of
the gathered rows); the grouped path is timed on that view and on a contiguous copy (the
copy's time included), which is what it takes now.

    python bench/attention_paths.py [--threads 2] [--batch 1,4,16] [--rows 1,4,8,16]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from packed_gemm import ms_per_call

from dflash_sglang.cpu_platform.attention import attention_mask, grouped_attention

HEADS, KV_HEADS, DIM = 9, 3, 64


def _gathered(pool: torch.Tensor, bs: int, keys: int) -> torch.Tensor:
    slots = torch.randperm(pool.shape[0])[: bs * keys]
    return pool.index_select(0, slots).view(bs, keys, KV_HEADS, DIM).transpose(1, 2)


def _inputs(pool: torch.Tensor, bs: int, rows: int, keys: int):
    query = torch.randn(bs, HEADS, rows, DIM, dtype=torch.bfloat16)
    key, value = _gathered(pool, bs, keys), _gathered(pool, bs, keys)
    q_lens = torch.full((bs,), rows)
    mask = attention_mask(q_lens, torch.full((bs,), keys), rows, keys, causal=True)
    return query, key, value, None if bool(mask.all()) else mask


def _grouped_contiguous(q, k, v, mask, scale):
    return grouped_attention(q, k.contiguous(), v.contiguous(), mask, scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--keys", default="128,512,1024")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| requests | query rows | keys | SDPA (ms) | grouped, gathered view | grouped, copy |")
    print("|---|---|---|---|---|---|")
    scale = DIM**-0.5
    pool = torch.randn(65536, KV_HEADS, DIM, dtype=torch.bfloat16)
    with torch.inference_mode():
        for bs in map(int, args.batch.split(",")):
            for rows in map(int, args.rows.split(",")):
                for keys in map(int, args.keys.split(",")):
                    inputs = _inputs(pool, bs, rows, keys)
                    sdpa = functools.partial(
                        F.scaled_dot_product_attention,
                        *inputs[:3], attn_mask=inputs[3], scale=scale, enable_gqa=True,
                    )  # fmt: skip
                    view = functools.partial(grouped_attention, *inputs, scale)
                    copy = functools.partial(_grouped_contiguous, *inputs, scale)
                    torch.testing.assert_close(sdpa(), copy(), atol=2e-2, rtol=2e-2)
                    cells = [ms_per_call(f, args.reps) for f in (sdpa, view, copy)]
                    print(
                        f"| {bs} | {rows} | {keys} | "
                        + " | ".join(f"{t:.3f}" for t in cells)
                        + " |"
                    )


if __name__ == "__main__":
    main()
