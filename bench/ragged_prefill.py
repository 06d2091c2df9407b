"""One attention layer of a prefill of real prompts through `dflash_cpu`: as one padded grid
(every request padded to the longest, the backend before length groups) and in groups of
similar length (`attention.length_groups`, now). The embedded SmolLM2's heads (9 query / 3
KV of 64), bf16, K/V at scattered slots of a real SGLang pool, metadata included.

    python bench/ragged_prefill.py [--threads 2] [--batch 16] [--waves 5] [--set mt_bench]

Each wave is the next `--batch` prompts of the set, chat-templated, all prefilled together,
as a server prefills a wave of users' new prompts.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import torch
from packed_gemm import ms_per_call

from dflash_sglang.cpu_platform import install_sgl_kernel_shim

os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
install_sgl_kernel_shim()

from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

from dflash_sglang import datasets  # noqa: E402
from dflash_sglang.cpu_platform import attention  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64
SETS = {"mt_bench": datasets.mt_bench, "humaneval": datasets.humaneval}


def prompt_lengths(name: str) -> list[int]:
    from transformers import AutoTokenizer

    from dflash_sglang.default_model import ensure_default_target

    tok = AutoTokenizer.from_pretrained(str(ensure_default_target()))
    chats = ([{"role": "user", "content": text}] for text in SETS[name]())
    texts = (tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats)
    return [len(tok(text).input_ids) for text in texts]


def prefill(lens: list[int]) -> tuple[attention.DFlashCPUAttnBackend, ForwardBatch, torch.Tensor]:
    total = sum(lens)
    pool = MHATokenToKVPool(
        size=total + 1, page_size=1, dtype=torch.bfloat16, head_num=KV_HEADS, head_dim=DIM,
        layer_num=1, device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    reqs = ReqToTokenPool(
        size=len(lens), max_context_len=max(lens), device="cpu", enable_memory_saver=False
    )
    slots = (torch.randperm(total) + 1).split(lens)
    for row, s in enumerate(slots):
        reqs.req_to_token[row, : len(s)] = s.int()
    for buffer in (pool.get_key_buffer(0), pool.get_value_buffer(0)):
        buffer[1 : total + 1] = torch.randn(total, KV_HEADS, DIM, dtype=torch.bfloat16)
    lens_t = torch.tensor(lens)
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=len(lens),
        input_ids=torch.zeros(total, dtype=torch.long), req_pool_indices=torch.arange(len(lens)),
        seq_lens=lens_t, out_cache_loc=torch.cat(slots), seq_lens_sum=total, seq_lens_cpu=lens_t,
        extend_prefix_lens=torch.zeros_like(lens_t), extend_seq_lens=lens_t,
        extend_prefix_lens_cpu=[0] * len(lens), extend_seq_lens_cpu=lens,
    )  # fmt: skip
    backend = attention.DFlashCPUAttnBackend(
        SimpleNamespace(req_to_token_pool=reqs, token_to_kv_pool=pool)
    )
    q = torch.randn(total, HEADS * DIM, dtype=torch.bfloat16)
    return backend, batch, q


def layer_ms(lens: list[int], min_keys: int, reps: int) -> tuple[float, int]:
    """ms per layer (metadata built once per forward, counted 1/30 as a 30-layer model does),
    and the number of groups attended."""
    attention.RAGGED_MIN_KEYS = min_keys
    backend, batch, q = prefill(lens)
    layer = RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=0)

    def forward():
        return backend.forward(q, None, None, layer, batch, save_kv_cache=False)

    backend.init_forward_metadata(batch)
    groups = max(len(backend.forward_metadata.parts), 1)
    metadata = ms_per_call(lambda: backend.init_forward_metadata(batch), reps)
    return ms_per_call(forward, reps) + metadata / 30, groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--waves", type=int, default=5)
    ap.add_argument("--set", choices=SETS, default="mt_bench")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lens = prompt_lengths(args.set)
    floor = attention.RAGGED_MIN_KEYS
    print("| wave | tokens | longest | one grid (ms/layer) | groups | in groups (ms/layer) | × |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for w in range(args.waves):
            wave = lens[w * args.batch : (w + 1) * args.batch]
            if len(wave) < args.batch:
                break
            one, _ = layer_ms(wave, 1 << 30, args.reps)
            ragged, groups = layer_ms(wave, floor, args.reps)
            print(
                f"| {w} | {sum(wave)} | {max(wave)} | {one:.2f} | {groups} | {ragged:.2f} "
                f"| {one / ragged:.2f} |"
            )


if __name__ == "__main__":
    main()
