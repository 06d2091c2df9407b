"""One attention layer of the embedded SmolLM2 (bf16, 9 query / 3 KV heads of 64) over a
paged pool with scattered slots: the torch path `dflash_cpu` took before (gather K/V into a
padded copy, then `grouped_attention`) against the C++ kernel reading the pool in place.
The gather is timed, as the server pays it every layer. `--baseline-source` also times
another revision of the kernel's source, built under another name (before / after a change):

    python bench/paged_attention_kernel.py [--threads 2] [--shapes 1x1x512,4x1x512,...]
    mkdir -p build && git show HEAD~1:kernels/cpu/paged_attention.cpp > build/old_kernel.cpp
    python bench/paged_attention_kernel.py --baseline-source build/old_kernel.cpp

`--writes 1,4,16` instead times one layer's KV write of that many tokens: SGLang's
`MHATokenToKVPool.set_kv_buffer` (what the backend called before) against `store_kv`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from packed_gemm import ms_per_call

from dflash_sglang.cpu_platform.attention import attention_mask, grouped_attention
from dflash_sglang.kernels import cpu_attention, cpu_build

HEADS, KV_HEADS, DIM = 9, 3, 64
POOL_SLOTS = 200_000
SHAPES = "1x1x512,4x1x512,16x1x512,1x4x512,4x4x512,4x8x512"


def gather_then_grouped(q, k_pool, v_pool, slots, mask):
    bs, keys = slots.shape
    rows = q.shape[0] // bs

    def gathered(pool):
        flat = pool.index_select(0, slots.view(-1)).view(bs, keys, KV_HEADS, DIM)
        return flat.transpose(1, 2).contiguous()

    query = q.view(bs, rows, HEADS, DIM).transpose(1, 2)
    return grouped_attention(query, gathered(k_pool), gathered(v_pool), mask, DIM**-0.5)


def time_shape(bs: int, rows: int, keys: int, k_pool, v_pool, baseline=None) -> list[float]:
    """ms per layer: gather + grouped, the kernel, and the baseline kernel if given."""
    slots = torch.randperm(POOL_SLOTS)[: bs * keys].view(bs, keys)
    kv_lens, q_lens = torch.full((bs,), keys), torch.full((bs,), rows)
    q = torch.randn(bs * rows, HEADS, DIM, dtype=torch.bfloat16)
    mask = attention_mask(q_lens, kv_lens, rows, keys, causal=True)
    mask = None if bool(mask.all()) else mask
    before = ms_per_call(lambda: gather_then_grouped(q, k_pool, v_pool, slots, mask))
    starts = torch.arange(bs) * rows
    args = (q, k_pool, v_pool, slots, kv_lens, q_lens, starts, True, DIM**-0.5)
    times = [before, ms_per_call(lambda: cpu_attention.paged_attention(*args))]
    if baseline is not None:
        times.append(ms_per_call(lambda: baseline.paged_attention(*args)))
    return times


def time_write(tokens: int) -> tuple[float, float]:
    """µs per layer: SGLang's pool write door vs the kernel's `store_kv`, same rows."""
    import os
    from types import SimpleNamespace

    from dflash_sglang.cpu_platform import install_sgl_kernel_shim

    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    install_sgl_kernel_shim()
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool

    pool = MHATokenToKVPool(
        size=POOL_SLOTS, page_size=1, dtype=torch.bfloat16, head_num=KV_HEADS, head_dim=DIM,
        layer_num=1, device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, dtype=torch.bfloat16)
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(tokens, KV_HEADS, DIM)
    v = qkv[:, (HEADS + KV_HEADS) * DIM :].view(tokens, KV_HEADS, DIM)
    loc = torch.randperm(POOL_SLOTS)[:tokens]
    batch = SimpleNamespace(out_cache_loc=loc, out_cache_loc_is_physical=False)
    layer = SimpleNamespace(layer_id=0)
    sglang = ms_per_call(
        lambda: pool.set_kv_buffer(layer, KVWriteLoc.for_batch(batch), k, v), reps=2000
    )
    buffers = pool.get_key_buffer(0), pool.get_value_buffer(0)
    ours = ms_per_call(lambda: cpu_attention.store_kv(k, v, *buffers, loc), reps=2000)
    return 1000 * sglang, 1000 * ours


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--shapes", default=SHAPES, help="requests x query rows x keys, comma-separated"
    )
    ap.add_argument("--baseline-source", type=Path, help="another revision of paged_attention.cpp")
    ap.add_argument("--writes", help="token counts: time the KV write instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_attention.available():
        raise SystemExit("the kernel is not built here (see the log)")
    if args.writes:
        print("| tokens | SGLang set_kv_buffer (µs) | store_kv (µs) | × |\n|---|---|---|---|")
        for tokens in map(int, args.writes.split(",")):
            sglang, ours = time_write(tokens)
            print(f"| {tokens} | {sglang:.1f} | {ours:.1f} | {sglang / ours:.1f} |")
        return
    if args.baseline_source is not None and not args.baseline_source.is_file():
        raise SystemExit(f"--baseline-source {args.baseline_source}: no such file")
    baseline = args.baseline_source and cpu_build.build(
        args.baseline_source, "dflash_cpu_paged_attention_baseline"
    )
    k_pool = torch.randn(POOL_SLOTS, KV_HEADS, DIM, dtype=torch.bfloat16)
    v_pool = torch.randn(POOL_SLOTS, KV_HEADS, DIM, dtype=torch.bfloat16)
    extra = " | baseline kernel (ms) | baseline / kernel" if baseline else ""
    print(
        f"| requests × query rows × keys | gather + grouped matmuls (ms) | kernel (ms) | ×{extra} |"
    )
    print("|---|---|---|---|" + ("---|---|" if baseline else ""))
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            bs, rows, keys = map(int, shape.split("x"))
            before, after, *base = time_shape(bs, rows, keys, k_pool, v_pool, baseline)
            row = f"| {bs} × {rows} × {keys} | {before:.3f} | {after:.3f} | {before / after:.1f}"
            if base:
                row += f" | {base[0]:.3f} | {base[0] / after:.2f}"
            print(row + " |")


if __name__ == "__main__":
    main()
