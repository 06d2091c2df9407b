"""z-lab's reference DFlash loop (`dflash` 0.1.0 on PyPI) over a prompt file, batch 1, on CPU.

Runs in the peers' own environment (`make peers`: build/peers/zlab), not ours, so it
imports nothing of dflash_sglang. Writes one JSON line per request in the loadtest record
format (t_start, t_end, ttft_s, tpot_s, output_tokens, error) plus the output ids and
z-lab's own per-step acceptance lengths, for `bench/peers.py`.

    build/peers/zlab/bin/python bench/peers_zlab.py --target T --draft D \
        --prompts-file p.json --max-new-tokens 64 --out records.jsonl [--block-size 1]

`--block-size 1` is the same loop without drafting: plain greedy decoding by the target.
z-lab's CLI and loader assume CUDA (`torch.cuda.synchronize` in its timer, `cuda:0`); the
models are loaded here the way its loader loads them, on the CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from dflash import model as zlab
from transformers import AutoModelForCausalLM, AutoTokenizer

zlab._cuda_time = time.perf_counter  # its timer synchronises CUDA; the CPU needs nothing


def load(target: str, draft: str, dtype: torch.dtype):
    kwargs = {"attn_implementation": "sdpa", "dtype": dtype}
    target_model = AutoModelForCausalLM.from_pretrained(target, **kwargs).eval()
    draft_model = zlab.DFlashDraftModel.from_pretrained(draft, **kwargs).eval()
    return target_model, draft_model, AutoTokenizer.from_pretrained(target)


def run_one(target, draft, tokenizer, prompt: str, args: argparse.Namespace) -> dict:
    chat = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    t_start = time.perf_counter()
    stats = zlab.dflash_generate(
        draft, target, input_ids, args.max_new_tokens, None,  # no stop token: fixed length
        block_size=args.block_size, return_stats=True,
    )  # fmt: skip
    t_end = time.perf_counter()
    n = stats.num_output_tokens
    ttft = stats.time_to_first_token
    return {
        "t_start": t_start,
        "t_end": t_end,
        "latency_s": t_end - t_start,
        "ttft_s": ttft,
        "tpot_s": (t_end - t_start - ttft) / (n - 1) if n > 1 else None,
        "output_tokens": n,
        "prompt_tokens": stats.num_input_tokens,
        "error": None,
        "output_ids": stats.output_ids[0, stats.num_input_tokens :].tolist(),
        "acceptance_lengths": stats.acceptance_lengths,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts-file", type=Path, required=True, help="JSON list of prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, help="default: the drafter's; 1 = plain decoding")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured requests first")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load(args.target, args.draft, getattr(torch, args.dtype))
    prompts = json.loads(args.prompts_file.read_text())
    for _ in range(args.warmup):
        run_one(target, draft, tokenizer, "Say hello.", args)
    with args.out.open("w") as out:
        for i, prompt in enumerate(prompts):
            record = {"index": i, "prompt_index": i} | run_one(
                target, draft, tokenizer, prompt, args
            )
            out.write(json.dumps(record) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
