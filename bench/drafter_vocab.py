"""How much the restricted draft vocabulary costs: teacher-forced held-out τ of one drafter
proposing from (a) its own draft vocabulary, (b) that vocabulary plus the request's own
prompt tokens (`--dflash-prompt-vocab`'s default), (c) the target's full vocabulary — and
the share of the target's greedy response tokens each vocabulary holds (a draft slot
outside it can never be accepted, nor anything after it in the block).

    .venv/bin/python bench/drafter_vocab.py \
        --drafter dflash_sglang/drafters/smollm2-135m-instruct-dflash \
        --heldout mt_bench=run/heldout/f_zlab_mt_bench humaneval=run/heldout/f_zlab_humaneval \
        math=run/heldout/f_zlab_math --out bench/drafter/vocab.json
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from dflash_sglang.draft_vocab import prompt_extra
from dflash_sglang.drafter import DFlashDrafter
from dflash_sglang.options import DEFAULT_PROMPT_VOCAB
from dflash_sglang.training import features
from dflash_sglang.training.__main__ import _load_target, _target_path
from dflash_sglang.training.evaluate import teacher_forced

VARIANTS = ("draft", "draft+prompt", "full")


def score(drafter, embed, weight, examples, variant: str) -> dict:
    """Teacher-forced τ with `variant`'s vocabulary, and the share of response tokens in it."""
    ids = drafter.draft_vocab_ids
    cap = DEFAULT_PROMPT_VOCAB if variant == "draft+prompt" else 0
    if variant == "full":  # the same weights without their vocabulary (a shallow copy would
        drafter = copy.deepcopy(drafter)  # share its buffers with the original)
        drafter.draft_vocab_ids = None
    result = teacher_forced(drafter, embed, weight, examples, prompt_vocab=cap)
    inside = total = 0
    for ex in examples:
        response = ex.input_ids[ex.prompt_len :]
        vocab = torch.cat([ids, prompt_extra(ex.input_ids[: ex.prompt_len].tolist(), ids, cap)])
        inside += len(response) if variant == "full" else int(torch.isin(response, vocab).sum())
        total += len(response)
    return {
        "tau": result["tau"],
        "steps": result["steps"],
        "accept_at": result["accept_at"][:4],
        "response_tokens_in_vocabulary": inside / total,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True)
    p.add_argument("--heldout", nargs="+", required=True, help="name=cached-features-dir")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out")
    a = p.parse_args()
    variants = a.variants.split(",")
    if bad := set(variants) - set(VARIANTS):
        p.error(f"--variants: unknown {sorted(bad)}, choose from {VARIANTS}")
    torch.set_num_threads(a.threads)
    drafter = DFlashDrafter.load(a.drafter).eval()
    if drafter.draft_vocab_ids is None:
        p.error("--drafter has no restricted vocabulary: nothing to compare")
    target, _ = _load_target(_target_path(None), "float32")
    embed, weight = target.get_input_embeddings(), target.lm_head.weight.detach().float()
    report: dict = {"drafter": a.drafter}
    for item in a.heldout:
        name, _, path = item.partition("=")
        examples = features.load(Path(path))
        report[name] = {v: score(drafter, embed, weight, examples, v) for v in variants}
        print(name, json.dumps(report[name]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
