"""Offline τ of two-branch trees against one proposal per step, on cached held-out features.

Replays the target's own greedy outputs (`evaluate --features-dir` data): at every response
position the DFlash block's acceptance comes from batched drafter passes (teacher-forced, as
`training.evaluate.decode_walk`) and the suffix lookup's from the request's own text so far;
each policy then walks the output, a step emitting its accepted tokens plus the bonus. No
target runs: minutes, not a server. Policies (a = DFlash tokens verified, s = suffix tokens):

  dflash         the DFlash block alone (a = 15)
  suffix         the suffix proposal alone (s = 15; just the bonus where there is none)
  either         the suffix proposal where one exists, else DFlash (a = 3)
  tree_a{a}_s{s} both as two branches: the longer accepted one counts

    python bench/tree_offline.py --heldout mt_bench=heldout/f_zlab_mt_bench \
        --drafter dflash_sglang/drafters/smollm2-135m-instruct-dflash --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dflash_sglang.draft_vocab import prompt_extra
from dflash_sglang.drafter import DFlashDrafter
from dflash_sglang.options import DEFAULT_PROMPT_VOCAB
from dflash_sglang.suffix import SuffixIndex, accepted_len
from dflash_sglang.training import evaluate, features
from dflash_sglang.training.train import Head


def lengths_at(drafter, embed, weight, example, end: int) -> tuple[dict, dict]:
    """Acceptance length (bonus included) of a step at every position in [prompt, end): the
    DFlash block's, and the own-text suffix lookup's (0 where it proposes nothing)."""
    ids = drafter.draft_vocab_ids
    prompt = example.input_ids[: example.prompt_len].tolist()
    head = Head(weight, torch.cat([ids, prompt_extra(prompt, ids, DEFAULT_PROMPT_VOCAB)]))
    positions = torch.arange(example.prompt_len, end)
    dflash = {}
    for i in range(0, len(positions), 64):
        anchors = positions[i : i + 64]
        got = evaluate.acceptance_at(drafter, embed, head, example, anchors)
        dflash.update(zip(anchors.tolist(), got, strict=True))
    tokens = example.input_ids.tolist()
    index, suffix = SuffixIndex(), {}
    index.extend(prompt)
    for p in range(example.prompt_len, end):
        proposal = index.propose()
        suffix[p] = 1 + accepted_len(proposal.tokens, tokens[p : p + 15]) if proposal else 0
        index.extend([tokens[p]])
    return dflash, suffix


def load_pair(drafter_dir: Path):
    """(embedding, fp32 LM head weight) of the embedded target, and the drafter, for
    `lengths_at`."""
    from transformers import AutoModelForCausalLM

    from dflash_sglang.default_model import ensure_default_target

    target = AutoModelForCausalLM.from_pretrained(ensure_default_target(), dtype=torch.float32)
    weight = target.get_output_embeddings().weight.detach().float()
    return target.get_input_embeddings(), weight, DFlashDrafter.load(drafter_dir).eval()


def policies() -> dict:
    def tree(a: int, s: int):
        return lambda d, q: max(min(d, a + 1), min(q, s + 1))

    out = {
        "dflash": lambda d, q: d,
        "suffix": lambda d, q: max(q, 1),
        "either": lambda d, q: q if q else min(d, 4),
    }
    out |= {f"tree_a{a}_s{s}": tree(a, s) for a, s in ((3, 3), (3, 7), (3, 12), (7, 7))}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heldout", nargs="+", required=True, help="NAME=FEATURES_DIR ...")
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    embed, weight, drafter = load_pair(args.drafter)
    report = {}
    for spec in args.heldout:
        name, path = spec.split("=", 1)
        sums = {k: [0, 0] for k in policies()}
        for example in features.load(Path(path)):
            end = min(len(example.input_ids) - 1, example.prompt_len + args.max_new_tokens)
            with torch.no_grad():
                dflash, suffix = lengths_at(drafter, embed, weight, example, end)
            for key, step in policies().items():
                p = example.prompt_len
                while p < end:
                    n = min(step(dflash[p], suffix[p]), end - p)
                    sums[key][0] += n
                    sums[key][1] += 1
                    p += n
        report[name] = {k: round(t / n, 3) for k, (t, n) in sums.items()}
        print(name, report[name], flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
