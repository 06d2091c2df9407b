"""Prompts for server tests: varied lengths, shared prefixes, one longer than 1,000 tokens."""

from __future__ import annotations

WORDS = (
    "the quick brown fox jumps over a lazy dog while speculative decoding drafts blocks "
    "number seven follows the brown dog over quick lazy blocks"
).split()


def prompt(i: int, n_words: int = 12) -> str:
    return " ".join(WORDS[(i * 7 + k * (i % 5 + 1)) % len(WORDS)] for k in range(n_words))


SHORT = [prompt(i, 4 + i % 9) for i in range(16)]
SHARED_PREFIX = prompt(99, 40)
LONG = " ".join(prompt(i, 30) for i in range(30))  # > 1,000 tokens with the tiny tokenizer
