"""Which held-out prompts a `--limit` evaluation reads: the first N, or N spread over the set."""

from __future__ import annotations

from dflash_sglang import datasets
from dflash_sglang.training.evaluate import pick


def test_spread_reaches_every_mt_bench_category():
    questions = datasets.mt_bench()  # 8 categories of 10, in order
    assert pick(questions, 10) == questions[:10]  # all ten from the first one (writing)
    assert pick(questions, 8, spread=True) == questions[::10]  # one per category
    spread = pick(questions, 10, spread=True)
    assert {questions.index(q) // 10 for q in spread} == set(range(8)) and len(set(spread)) == 10
    assert pick(questions, 200, spread=True) == questions  # more than the set: all of it
