"""The prompts a sweep sends: real sets from `dflash_sglang.datasets`, shuffled by a seed."""

from __future__ import annotations

import random
from collections.abc import Callable
from itertools import chain, zip_longest

from dflash_sglang import datasets

SHAREGPT_POOL = 2000  # the first conversations only: enough variety, loads in ~0.2 s
SHARED_PREFIX_GROUPS = 8


def shared_prefix(groups: int = SHARED_PREFIX_GROUPS) -> list[str]:
    """Groups of requests sharing a long prefix (an article to summarise, ~500 tokens) and
    ending in different MT-Bench questions: where routing by prefix decides whether a
    replica's radix cache (and DFlash draft KV) serves the prefix or recomputes it."""
    articles = [p for p in datasets.summaries(max_chars=2000) if len(p) > 1500][:groups]
    return [f"{a}\n\nThen answer briefly: {q}" for q in datasets.mt_bench() for a in articles]


LOADERS: dict[str, Callable[[], list[str]]] = {
    "mt_bench": datasets.mt_bench,
    "humaneval": datasets.humaneval,
    "sharegpt": lambda: datasets.sharegpt(SHAREGPT_POOL),
    "math": datasets.math_problems,
    "summaries": datasets.summaries,
    "shared_prefix": shared_prefix,
}
MIXED = ("mt_bench", "humaneval", "sharegpt", "math", "summaries")  # `mixed` alternates these
CHOICES = (*LOADERS, "mixed")


def load_prompts(dataset: str, *, seed: int, max_chars: int) -> list[str]:
    """Prompts of at most `max_chars`, shuffled; `mixed` alternates all the sets."""
    if dataset not in CHOICES:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(CHOICES)}")
    names = list(MIXED) if dataset == "mixed" else [dataset]
    rng = random.Random(seed)
    pools = []
    for name in names:
        pool = [p for p in LOADERS[name]() if len(p) <= max_chars]
        rng.shuffle(pool)
        pools.append(pool)
    prompts = [p for p in chain.from_iterable(zip_longest(*pools)) if p is not None]
    if not prompts:
        raise ValueError(f"no {dataset} prompt has at most {max_chars} characters")
    return prompts


def level_prompts(prompts: list[str], offset: int, count: int) -> list[str]:
    """`count` prompts from `offset` on, wrapping: each level gets fresh prompts while the
    pool lasts, and both servers of a level get the same ones in the same order."""
    return [prompts[(offset + i) % len(prompts)] for i in range(count)]
