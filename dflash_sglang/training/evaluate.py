"""τ and the acceptance histogram on held-out sets: reference loop, and optionally a server.

τ counts accepted drafts plus the bonus token per verify step (1..block), the paper's
"acceptance length". The server's numbers come from its DFlash counters over the same
prompts, so both columns use one definition.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import requests

from dflash_sglang.acceptance import accepted_prefix_len
from dflash_sglang.drafter import DFlashDrafter
from dflash_sglang.options import DEFAULT_PROMPT_VOCAB
from dflash_sglang.reference import ReferenceDecoder
from dflash_sglang.training.data import chat_ids, heldout_sets

MAX_PROMPT_TOKENS = 1024


def accept_at(histogram: list[int]) -> list[float]:
    """Acceptance per draft position: the share of steps that accepted draft k (k = 0..B-2),
    i.e. whose length (bonus included, `histogram[n - 1]` steps of length n) exceeds k + 1."""
    steps = max(1, sum(histogram))
    return [sum(histogram[k + 1 :]) / steps for k in range(len(histogram) - 1)]


def summarize(lengths: list[int], tokens: int, seconds: float, block_size: int) -> dict:
    hist = Counter(lengths)
    histogram = [hist.get(n, 0) for n in range(1, block_size + 1)]
    return {
        "tau": sum(lengths) / len(lengths) if lengths else None,
        "steps": len(lengths),
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "histogram": histogram,
        "accept_at": accept_at(histogram),
    }


def histogram_from_buckets(deltas: dict[str, float], block_size: int) -> list[int]:
    """Per-length counts from the cumulative `dflash_acceptance_length` buckets."""
    cumulative = [
        deltas.get(f'dflash_acceptance_length_bucket{{le="{float(n)}"}}', 0.0)
        for n in range(1, block_size + 1)
    ]
    return [int(c - p) for c, p in zip(cumulative, [0.0, *cumulative[:-1]], strict=True)]


def _timed_generate(
    url: str, ids: list[int], max_new_tokens: int, temperature: float = 0.0
) -> tuple[list[int], float]:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": temperature, "max_new_tokens": max_new_tokens},
    }
    started = time.monotonic()
    r = requests.post(url + "/generate", json=body, timeout=3600)
    r.raise_for_status()
    return r.json()["output_ids"], time.monotonic() - started


def through_server(
    url: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int,
    baseline_url: str | None = None,
    temperature: float = 0.0,
) -> dict:
    """τ from the server's counters; with `baseline_url` (plain decoding, same build) each
    prompt also runs there, alternating which goes first, so machine noise hits both alike.
    At `temperature` > 0 the server samples exactly (outputs then differ from the baseline's
    by chance, not by error)."""
    from dflash_sglang import metrics
    from dflash_sglang.loadtest import server_metrics

    before = server_metrics.scrape(url)
    seconds = {"dflash": 0.0, "baseline": 0.0}
    tokens, same = 0, 0
    for i, ids in enumerate(prompts):
        arms = [("dflash", url), ("baseline", baseline_url)] if baseline_url else [("dflash", url)]
        outputs = {}
        for arm, arm_url in arms if i % 2 == 0 else arms[::-1]:
            outputs[arm], took = _timed_generate(arm_url, ids, max_new_tokens, temperature)
            seconds[arm] += took
        tokens += len(outputs["dflash"])
        same += outputs.get("baseline") == outputs["dflash"]
    deltas = server_metrics.counter_deltas(before, server_metrics.scrape(url))
    entry = {
        "tau": server_metrics.tau(deltas),
        "steps": int(server_metrics.total(deltas, metrics.DRAFTS)),
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds["dflash"],
        "histogram": histogram_from_buckets(deltas, block_size),
    }
    entry["accept_at"] = accept_at(entry["histogram"])
    if baseline_url:
        entry["baseline_tokens_per_s"] = tokens / seconds["baseline"]
        entry["speedup"] = seconds["baseline"] / seconds["dflash"]
        entry["same_output_as_baseline"] = same
    return entry


def acceptance_at(drafter: DFlashDrafter, embed, head, example, anchors) -> list[int]:
    """Acceptance length of a greedy decode step anchored at each of `anchors`, from the
    cached features of the target's own greedy data (`head`: a `train.Head`, whose
    vocabulary the drafter proposes from: normally its own `draft_vocab_ids`).

    A step anchored at a sees what the reference loop's step there sees (context features
    before a, token a), so the leading draft slots equal to the data, plus the bonus
    token, are that step's acceptance length.
    """
    import torch

    from dflash_sglang.draft_vocab import head_argmax
    from dflash_sglang.training.blocks import IGNORE
    from dflash_sglang.training.train import draft_blocks

    with torch.no_grad():
        b, hidden = draft_blocks(drafter, embed, example, anchors, gamma=1.0)
        local = head_argmax(hidden, head.weight)
    ids = head.vocab_ids
    drafts = (local if ids is None else ids[local]).view(len(anchors), -1)[:, 1:]
    labels = b.labels.view(len(anchors), -1)[:, 1:]
    match = (drafts == labels) & (labels != IGNORE)
    return (accepted_prefix_len(match) + 1).tolist()


def acceptance_everywhere(
    drafter: DFlashDrafter, embed, head, example, chunk: int = 64
) -> list[int]:
    """`acceptance_at` every response position but the last (which has nothing after it to
    predict), in order, from batched drafter passes of `chunk` blocks: entry i is the step
    whose anchor is response token i."""
    import torch

    positions = torch.arange(example.prompt_len, len(example.input_ids) - 1)
    lengths: list[int] = []
    for i in range(0, len(positions), chunk):
        lengths += acceptance_at(drafter, embed, head, example, positions[i : i + chunk])
    return lengths


def decode_walk(drafter: DFlashDrafter, embed, head, example, chunk: int = 64) -> list[int]:
    """The acceptance lengths a greedy decode of `example`'s response would have, step by
    step, from its cached features alone: the first block starts on the first response
    token and each next one where the previous step's accepted drafts and bonus end. No
    target runs; on the target's own greedy data this is the reference loop's sequence of
    acceptance lengths, up to where the data stops."""
    return greedy_walk(acceptance_everywhere(drafter, embed, head, example, chunk))


def greedy_walk(lengths: list[int]) -> list[int]:
    """The acceptance lengths of the steps a decode takes, given the acceptance length
    (bonus included, >= 1) of a step anchored at every position: each step starts where the
    previous one's accepted drafts and bonus end."""
    steps, pos = [], 0
    while pos < len(lengths):
        steps.append(lengths[pos])
        pos += lengths[pos]
    return steps


def at_block_size(drafter: DFlashDrafter, block_size: int) -> DFlashDrafter:
    """`drafter` drafting blocks of `block_size` (anchor + MASKs) instead of its trained
    size, as a server run with `--speculative-dflash-block-size` drafts them; the same
    weights, the caller's drafter untouched."""
    if block_size < 2:
        raise ValueError(f"block size must be at least 2, got {block_size}")
    if block_size == drafter.config.block_size:
        return drafter
    resized = copy.copy(drafter)
    resized.config = replace(drafter.config, block_size=block_size)
    return resized


def prompt_head(drafter: DFlashDrafter, lm_head_weight, example, prompt_vocab: int):
    """The `train.Head` a server step drafts from for `example`: the drafter's restricted
    vocabulary plus up to `prompt_vocab` of the prompt's own tokens (`draft_vocab`)."""
    import torch

    from dflash_sglang.draft_vocab import prompt_extra
    from dflash_sglang.training.train import Head

    weight, ids = lm_head_weight.detach().float(), drafter.draft_vocab_ids
    if ids is None or not prompt_vocab:
        return Head(weight, ids)
    extra = prompt_extra(example.input_ids[: example.prompt_len].tolist(), ids, prompt_vocab)
    return Head(weight, torch.cat([ids, extra]))


def teacher_forced(
    drafter: DFlashDrafter,
    embed,
    lm_head_weight,
    examples,
    prompt_vocab: int = DEFAULT_PROMPT_VOCAB,
    block_size: int | None = None,
) -> dict:
    """τ and histogram of greedy decoding over cached features of the target's own greedy
    output (`decode_walk`): the reference loop's numbers without running the target, for
    comparing training runs on held-out prompts. `prompt_vocab` as the reference loop's
    (a restricted vocabulary plus each prompt's own tokens); `block_size` as
    `at_block_size`."""
    if block_size is not None:
        drafter = at_block_size(drafter, block_size)

    weight = lm_head_weight.detach().float()  # once: `prompt_head` keeps a float32 as is
    lengths: list[int] = []
    for ex in examples:
        lengths += decode_walk(drafter, embed, prompt_head(drafter, weight, ex, prompt_vocab), ex)
    summary = summarize(lengths, sum(lengths), 0.0, drafter.config.block_size)
    return {k: summary[k] for k in ("tau", "steps", "histogram", "accept_at")}


def plain_greedy(target, ids: list[int], max_new_tokens: int, stop_ids) -> list[int]:
    """The target decoding alone (HF, KV cache): what a lossless loop must reproduce."""
    import torch

    out = target.generate(
        torch.tensor([ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=list(stop_ids) or None,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def pick(texts: list[str], limit: int, spread: bool = False) -> list[str]:
    """The first `limit` prompts, or with `spread` `limit` spaced evenly over the set.

    MT-Bench lists its 8 categories 10 questions at a time, so its first 10 are all
    writing; spread (indices ⌊i·n/limit⌋), 8 take one of each category and 10 reach all 8.
    """
    if not spread or limit >= len(texts):
        return texts[:limit]
    return [texts[i * len(texts) // limit] for i in range(limit)]


def run(
    target_dir: Path,
    drafter_dir: Path,
    sets: list[str],
    *,
    limit: int,
    max_new_tokens: int,
    block_size: int | None,
    dtype: str,
    server_url: str | None,
    baseline_url: str | None = None,
    check_greedy: bool = False,
    prompt_vocab: int = DEFAULT_PROMPT_VOCAB,
    spread: bool = False,
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    drafter = DFlashDrafter.load(drafter_dir, getattr(torch, dtype)).eval()
    decoder = ReferenceDecoder(target, drafter, prompt_vocab)
    bs = block_size or drafter.config.block_size
    stop = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
    available = heldout_sets()
    report: dict = {"drafter": str(drafter_dir), "block_size": bs, "max_new_tokens": max_new_tokens}
    report["spread"] = spread
    for name in sets:
        texts = pick(available[name], limit, spread)
        prompts = [chat_ids(tokenizer, t, MAX_PROMPT_TOKENS) for t in texts]
        lengths: list[int] = []
        tokens, seconds, same = 0, 0.0, 0
        for ids in prompts:
            started = time.monotonic()
            gen = decoder.generate(ids, max_new_tokens, stop_ids=stop, block_size=bs)
            seconds += time.monotonic() - started
            lengths += gen.acceptance_lengths
            tokens += len(gen.tokens)
            if check_greedy:
                same += gen.tokens == plain_greedy(target, ids, max_new_tokens, stop)
        entry = {
            "prompts": len(prompts),
            "reference": summarize(lengths, tokens, seconds, bs),
        }
        if check_greedy:
            entry["reference"]["same_as_plain_greedy"] = same
        if server_url:
            base = baseline_url.rstrip("/") if baseline_url else None
            entry["server"] = through_server(
                server_url.rstrip("/"), prompts, max_new_tokens, bs, base
            )
        report[name] = entry
    return report
