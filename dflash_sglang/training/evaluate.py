"""τ and the acceptance histogram on held-out sets: reference loop, and optionally a server.

τ counts accepted drafts plus the bonus token per verify step (1..block), the paper's
"acceptance length". The server's numbers come from its DFlash counters over the same
prompts, so both columns use one definition.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import requests

from dflash_sglang.reference import ReferenceDecoder
from dflash_sglang.training.data import chat_ids, heldout_sets
from dflash_sglang.training.model import DFlashDrafter

MAX_PROMPT_TOKENS = 1024


def summarize(lengths: list[int], tokens: int, seconds: float, block_size: int) -> dict:
    hist = Counter(lengths)
    return {
        "tau": sum(lengths) / len(lengths) if lengths else None,
        "steps": len(lengths),
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "histogram": [hist.get(n, 0) for n in range(1, block_size + 1)],
    }


def histogram_from_buckets(deltas: dict[str, float], block_size: int) -> list[int]:
    """Per-length counts from the cumulative `dflash_acceptance_length` buckets."""
    cumulative = [
        deltas.get(f'dflash_acceptance_length_bucket{{le="{float(n)}"}}', 0.0)
        for n in range(1, block_size + 1)
    ]
    return [int(c - p) for c, p in zip(cumulative, [0.0, *cumulative[:-1]], strict=True)]


def _timed_generate(url: str, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
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
) -> dict:
    """τ from the server's counters; with `baseline_url` (plain decoding, same build) each
    prompt also runs there, alternating which goes first, so machine noise hits both alike."""
    from dflash_sglang.loadtest import server_metrics

    before = server_metrics.scrape(url)
    seconds = {"dflash": 0.0, "baseline": 0.0}
    tokens, same = 0, 0
    for i, ids in enumerate(prompts):
        arms = [("dflash", url), ("baseline", baseline_url)] if baseline_url else [("dflash", url)]
        outputs = {}
        for arm, arm_url in arms if i % 2 == 0 else arms[::-1]:
            outputs[arm], took = _timed_generate(arm_url, ids, max_new_tokens)
            seconds[arm] += took
        tokens += len(outputs["dflash"])
        same += outputs.get("baseline") == outputs["dflash"]
    deltas = server_metrics.counter_deltas(before, server_metrics.scrape(url))
    entry = {
        "tau": server_metrics.tau(deltas),
        "steps": int(server_metrics.total(deltas, server_metrics.DRAFTS)),
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds["dflash"],
        "histogram": histogram_from_buckets(deltas, block_size),
    }
    if baseline_url:
        entry["baseline_tokens_per_s"] = tokens / seconds["baseline"]
        entry["speedup"] = seconds["baseline"] / seconds["dflash"]
        entry["same_output_as_baseline"] = same
    return entry


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
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    drafter = DFlashDrafter.load(drafter_dir, getattr(torch, dtype)).eval()
    decoder = ReferenceDecoder(target, drafter)
    bs = block_size or drafter.config.block_size
    stop = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
    available = heldout_sets()
    report: dict = {"drafter": str(drafter_dir), "block_size": bs, "max_new_tokens": max_new_tokens}
    for name in sets:
        prompts = [chat_ids(tokenizer, t, MAX_PROMPT_TOKENS) for t in available[name][:limit]]
        lengths: list[int] = []
        tokens = 0
        started = time.monotonic()
        for ids in prompts:
            gen = decoder.generate(ids, max_new_tokens, stop_ids=stop, block_size=bs)
            lengths += gen.acceptance_lengths
            tokens += len(gen.tokens)
        entry = {
            "prompts": len(prompts),
            "reference": summarize(lengths, tokens, time.monotonic() - started, bs),
        }
        if server_url:
            base = baseline_url.rstrip("/") if baseline_url else None
            entry["server"] = through_server(
                server_url.rstrip("/"), prompts, max_new_tokens, bs, base
            )
        report[name] = entry
    return report
