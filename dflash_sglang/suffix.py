"""Training-free suffix-lookup proposals: reuse what followed an earlier copy of the present.

Small models repeat themselves (and quote their prompts), so the tokens that followed the most
recent earlier occurrence of the longest current suffix are a free draft for speculative decoding
(prompt-lookup / n-gram speculation). Pure Python so it runs on the scheduler's CPU path.

Keys: n-gram tuples (extend 1.9 us/token vs 1.7 for packed-int keys; timeit, 20k tokens, m=4).

A second, shared index (`SharedSuffixIndex`, SuffixDecoding's global tree made flat) holds the
outputs of recently finished requests, bounded in tokens: a model answering similar
questions reuses its phrasings across requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SEPARATOR = -1  # ends a document in a shared index: no real token id matches it


@dataclass(frozen=True)
class SuffixProposal:
    tokens: tuple[int, ...]  # proposed continuation, 1..max_proposal tokens
    match_len: int  # length n of the matched suffix (1..max_match)
    count: int  # earlier occurrences of that n-gram (>= 1)
    shared: bool = False  # from other requests' outputs (`SharedSuffixIndex`), not its own text


class SuffixIndex:
    """Per-request n-gram table over the prompt and committed output.

    `_tables[n - 1]` maps an n-gram to (continuation start of its most recent occurrence,
    occurrence count). An n-gram is registered only once a token has followed it, so the
    current suffix never matches itself.
    """

    def __init__(self, max_match: int = 4, max_proposal: int = 15) -> None:
        if max_match < 1:
            raise ValueError(f"max_match must be >= 1, got {max_match}")
        if max_proposal < 1:
            raise ValueError(f"max_proposal must be >= 1, got {max_proposal}")
        self.max_match = max_match
        self.max_proposal = max_proposal
        self._tokens: list[int] = []
        self._tables: list[dict[tuple[int, ...], tuple[int, int]]] = [{} for _ in range(max_match)]

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def num_entries(self) -> int:
        """At most max_match per token indexed: memory grows linearly, never quadratically."""
        return sum(len(table) for table in self._tables)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append committed tokens; each one completes at most max_match n-grams."""
        seq = self._tokens
        for token in tokens:
            i = len(seq)
            for n in range(1, min(self.max_match, i) + 1):
                key = tuple(seq[i - n : i])
                table = self._tables[n - 1]
                prev = table.get(key)
                table[key] = (i, prev[1] + 1 if prev else 1)
            seq.append(token)

    def end_document(self) -> None:
        """Close a document: nothing continues its last n-grams, and n-grams spanning the
        separator can never match a real text."""
        self._tokens.append(SEPARATOR)

    def tail(self, n: int) -> list[int]:
        return self._tokens[-n:] if n > 0 else []

    def find(self, text: Sequence[int]) -> tuple[int, int, int] | None:
        """(continuation start, match length, count) of the longest suffix of `text` indexed;
        longer matches predict better."""
        end = len(text)
        for n in range(min(self.max_match, end), 0, -1):
            hit = self._tables[n - 1].get(tuple(text[end - n :]))
            if hit is not None:
                return hit[0], n, hit[1]
        return None

    def propose(self) -> SuffixProposal | None:
        """Continuation of the longest current suffix seen before in this text."""
        hit = self.find(self._tokens)
        if hit is None:
            return None
        start, n, count = hit
        head = self._tokens[start : start + self.max_proposal]
        repeats = -(-self.max_proposal // len(head))  # past the present, seq[start:] repeats
        return SuffixProposal(tuple((head * repeats)[: self.max_proposal]), n, count)

    def continuation(self, start: int) -> tuple[int, ...]:
        """Tokens from `start` up to the end of their document, at most max_proposal."""
        head = self._tokens[start : start + self.max_proposal]
        return tuple(head[: head.index(SEPARATOR)] if SEPARATOR in head else head)


class SharedSuffixIndex:
    """N-gram table over the outputs of the most recent finished requests, at most
    `capacity` tokens.

    Each document is the request's last `max_match` prompt tokens (so its opening words are
    found from the chat template's assistant header) and its output. Two generations, each
    up to half the capacity: documents go into the young one; when it is full the old one
    is dropped whole and the young one ages. Eviction is O(1) (no rebuild stalls the
    scheduler) and the index always holds the last capacity/2 to capacity tokens.
    """

    def __init__(self, capacity: int, max_match: int = 4, max_proposal: int = 15) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2 tokens, got {capacity}")
        self.capacity = capacity
        self.max_match = max_match
        self.max_proposal = max_proposal
        self._young = SuffixIndex(max_match, max_proposal)
        self._old = SuffixIndex(max_match, max_proposal)
        self.num_documents = 0  # documents added so far

    def __len__(self) -> int:
        """Tokens held, separators included."""
        return len(self._young) + len(self._old)

    def _document(self, context: Sequence[int], output: Sequence[int]) -> list[int]:
        doc = [*context[max(len(context) - self.max_match, 0) :], *output]
        return doc[-(self.capacity // 2 - 1) :]

    def _append(self, index: SuffixIndex, doc: list[int]) -> None:
        index.extend(doc)
        index.end_document()
        self.num_documents += 1

    def add(self, context: Sequence[int], output: Sequence[int]) -> None:
        doc = self._document(context, output)
        if len(self._young) + len(doc) + 1 > self.capacity // 2:
            self._old = self._young
            self._young = SuffixIndex(self.max_match, self.max_proposal)
        self._append(self._young, doc)

    def warm(self, documents: Sequence[tuple[Sequence[int], Sequence[int]]]) -> int:
        """Start from past (context, output) pairs, oldest first, as if they had just
        finished: the newest fill the young generation, the next newest the old one, so the
        index starts as full as `add` could leave it. Only for an empty index; returns how
        many it holds."""
        if len(self):
            raise ValueError("warm() fills an empty index")
        half = self.capacity // 2
        young: list[list[int]] = []  # newest first
        old: list[list[int]] = []
        filling, used = young, 0
        for context, output in reversed(documents):
            doc = self._document(context, output)
            if used + len(doc) + 1 > half:
                if filling is old:
                    break
                filling, used = old, 0
            filling.append(doc)
            used += len(doc) + 1
        for index, docs in ((self._old, old), (self._young, young)):
            for doc in reversed(docs):
                self._append(index, doc)
        return len(young) + len(old)

    def propose(self, text: Sequence[int]) -> SuffixProposal | None:
        """What followed the longest suffix of `text` in another request's output; the
        younger generation on ties (the more recent occurrence)."""
        best = None
        for index in (self._young, self._old):
            hit = index.find(text)
            if hit is not None and (best is None or hit[1] > best[1][1]):
                best = index, hit
        if best is None:
            return None
        index, (start, n, count) = best
        return SuffixProposal(index.continuation(start), n, count, shared=True)


def better(own: SuffixProposal | None, shared: SuffixProposal | None) -> SuffixProposal | None:
    """The offline replay's choice, without acceptance statistics: the longer match wins, the
    request's own text on ties. (The server's planner chooses by learned acceptance.)"""
    if shared is None or (own is not None and own.match_len >= shared.match_len):
        return own
    return shared


def accepted_len(drafts: Sequence[int], target: Sequence[int]) -> int:
    """Drafts greedy verification accepts (the rule of `acceptance.accepted_prefix_len`)."""
    import torch

    from dflash_sglang.acceptance import accepted_prefix_len

    n = min(len(drafts), len(target))
    if n == 0:
        return 0
    matches = torch.tensor([drafts[:n]]) == torch.tensor([target[:n]])
    return int(accepted_prefix_len(matches)[0])


def replay_tau(
    prompt: Sequence[int],
    output: Sequence[int],
    max_match: int = 4,
    max_proposal: int = 15,
    shared: SharedSuffixIndex | None = None,
) -> tuple[float, float]:
    """Offline (tau, fraction of steps with a proposal) of greedy suffix speculation.

    Replays the target's own greedy `output` so proposal quality is measured without a model:
    each step emits the accepted drafts plus one bonus token (just the bonus with no proposal).
    With `shared`, proposals from it compete as in the server (`better`); the caller adds
    the output to it afterwards, as a finished request's.
    """
    if not output:
        raise ValueError("output must be non-empty")
    index = SuffixIndex(max_match, max_proposal)
    index.extend(prompt)
    pos = steps = proposed = 0
    while pos < len(output):
        proposal = index.propose()
        if shared is not None:
            proposal = better(proposal, shared.propose(index.tail(max_match)))
        accepted = 0
        if proposal is not None:
            proposed += 1
            accepted = accepted_len(proposal.tokens, output[pos : pos + max_proposal])
        emitted = min(accepted + 1, len(output) - pos)
        index.extend(output[pos : pos + emitted])
        pos += emitted
        steps += 1
    return pos / steps, proposed / steps
