"""Verification of a drafted chain against the target: greedy and exact sampling.

Conventions (shared by every caller and metric):
- `candidates[:, 0]` is the anchor (previous bonus token), `candidates[:, 1:]` the B-1 drafts.
- Target row j (0-based) is the target's distribution for the token after `candidates[:, j]`.
- `accept_lens` counts accepted drafts only (0..B-1); `commit_lens = accept_lens + 1` counts
  the tokens a step commits to KV (anchor + accepted drafts); the step emits the accepted
  drafts plus one bonus token from the target, so tokens emitted per step = `commit_lens` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Acceptance:
    accept_lens: torch.Tensor  # [bs] int32, accepted drafts per request
    bonus: torch.Tensor  # [bs] int64, the target's own token after the accepted prefix
    commit_lens: torch.Tensor  # [bs] int32, accept_lens + 1
    out_tokens: torch.Tensor  # [bs, B] int64, accepted drafts then bonus, rest padding


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`argmax(logits, -1)` through `max`: the same index (the first maximal one, as torch
    documents for both), but torch's CPU argmax kernel is 2-4x slower (16 x 49,152 fp32
    logits: 0.59 vs 0.19 ms; bf16: 1.29 vs 0.31 ms, 2 threads)."""
    return logits.max(dim=-1).indices


def accepted_prefix_len(matches: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True per row of `[bs, n]`."""
    return matches.to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32)


def commit(candidates: torch.Tensor, accept_lens: torch.Tensor, bonus: torch.Tensor) -> Acceptance:
    """Emitted tokens: the accepted drafts followed by the bonus, padded with the bonus."""
    bs, block = candidates.shape
    cols = torch.arange(block, device=candidates.device).unsqueeze(0)
    lens = accept_lens.to(torch.int64).unsqueeze(1)
    shifted = torch.cat([candidates[:, 1:], candidates[:, -1:]], dim=1).to(torch.int64)
    out = torch.where(cols < lens, shifted, bonus.view(-1, 1).to(torch.int64))
    return Acceptance(
        accept_lens=accept_lens.to(torch.int32),
        bonus=bonus.to(torch.int64),
        commit_lens=(accept_lens + 1).to(torch.int32),
        out_tokens=out,
    )


def plain_step(bonus: torch.Tensor) -> Acceptance:
    """A step that drafted nothing (width 1): the target's token is the bonus. Four tensors
    instead of `commit`'s dozen ops, on the step the planner takes most under load."""
    bs = bonus.numel()
    bonus = bonus.view(bs).to(torch.int64)
    return Acceptance(
        accept_lens=torch.zeros(bs, dtype=torch.int32, device=bonus.device),
        bonus=bonus,
        commit_lens=torch.ones(bs, dtype=torch.int32, device=bonus.device),
        out_tokens=bonus.view(bs, 1),
    )


def greedy_accept(candidates: torch.Tensor, target_predict: torch.Tensor) -> Acceptance:
    """Accept drafts while they equal the target's argmax; the bonus is the first mismatch.

    `target_predict` is `[bs, B]`: the target argmax at every block row.
    """
    if candidates.shape[1] == 1:
        return plain_step(target_predict[:, 0])
    matches = candidates[:, 1:] == target_predict[:, :-1]
    accept_lens = accepted_prefix_len(matches)
    bonus = target_predict.gather(1, accept_lens.to(torch.int64).unsqueeze(1)).squeeze(1)
    return commit(candidates, accept_lens, bonus)


def sampled_accept(
    candidates: torch.Tensor,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Exact speculative sampling for a chain of one-hot (argmax) drafts.

    With a point-mass draft q, the standard rule accepts draft x with probability
    min(1, p(x)/q(x)) = p(x) and, on rejection, samples from the residual max(p - q, 0),
    i.e. p with x removed and renormalised. Every emitted token is therefore distributed
    exactly as the target's own sample given the emitted prefix.

    `target_probs` is `[bs, B, V]` (temperature/top-k/top-p already applied), `coins`
    `[bs, B-1]` uniform draws in [0, 1).
    """
    bs, block = candidates.shape
    if block == 1:  # nothing drafted (plain decoding): the bonus is the target's own sample
        return plain_step(torch.multinomial(target_probs[:, 0], 1, generator=generator))
    drafts = candidates[:, 1:].to(torch.int64)
    p_draft = target_probs[:, :-1, :].gather(2, drafts.unsqueeze(2)).squeeze(2)
    accept_lens = accepted_prefix_len(coins < p_draft)

    row = accept_lens.to(torch.int64)
    probs = target_probs[torch.arange(bs, device=candidates.device), row].clone()
    rejected = row < block - 1
    rejected_token = drafts.gather(1, row.clamp(max=block - 2).unsqueeze(1)).squeeze(1)
    probs[rejected, rejected_token[rejected]] = 0.0
    probs = probs / probs.sum(dim=1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
    bonus = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return commit(candidates, accept_lens, bonus)


# Tokens sorted first when a row is filtered: a 49k-token sort of every verify row cost ~39 ms
# a step at one request (16 rows) on a 2-core CPU, more than the step; top-k, top-p and
# min-p cuts nearly always fall inside the head (the full sort stays the fallback).
FILTER_HEAD = 256


def sampling_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row target distribution with SGLang's sampler semantics (top-k, then top-p, min-p).

    `logits` is `[rows, V]`; the per-row parameters are `[rows]` (temperatures may be
    `[rows, 1]`). Computed in float32. Tokens are ranked by probability, ties by lower id;
    a token is kept iff its rank < top_k, the mass before it < top_p and its probability
    >= min_p x the top one (the first is always kept). Rows with none of the three set
    (top_k >= V, top_p >= 1, min_p = 0) are the softmax itself, as in SGLang's sampler.
    """
    probs = torch.softmax(logits.float() / temperatures.view(-1, 1).float().clamp_min(1e-6), -1)
    vocab = probs.shape[-1]
    top_ks = top_ks.view(-1).to(torch.int64)
    top_ps = top_ps.view(-1).float()
    min_ps = None if min_ps is None else min_ps.view(-1).float()
    filtered = (top_ks < vocab) | (top_ps < 1.0)
    if min_ps is not None:
        filtered |= min_ps > 0
    if not filtered.any():
        return probs
    if filtered.all():  # the common case: one sampling setting for every row
        return _filtered(probs, top_ks, top_ps, min_ps)
    rows = filtered.nonzero().squeeze(1)
    probs[rows] = _filtered(probs[rows], *_of_rows(rows, top_ks, top_ps, min_ps))
    return probs


def _of_rows(rows: torch.Tensor, top_ks, top_ps, min_ps) -> tuple:
    """The filter parameters of `rows` only (min_ps may be None)."""
    return top_ks[rows], top_ps[rows], None if min_ps is None else min_ps[rows]


def _keep(ranked: torch.Tensor, top_ks, top_ps, min_ps) -> torch.Tensor:
    """Which of each row's ranked probabilities `[rows, L]` are kept (a prefix of them)."""
    keep = torch.arange(ranked.shape[-1], device=ranked.device) < top_ks.clamp_min(1)[:, None]
    keep &= ranked.cumsum(dim=-1) - ranked < top_ps[:, None]
    if min_ps is not None:
        keep &= ranked >= min_ps[:, None] * ranked[:, :1]
    keep[:, 0] = True
    return keep


def _filtered(probs: torch.Tensor, top_ks, top_ps, min_ps) -> torch.Tensor:
    """`probs` `[rows, V]` filtered and renormalised. The top FILTER_HEAD + 1 tokens are
    ranked first; a row whose cut falls inside them, strictly above every token outside
    (no tie across the cut), needs nothing else; the others take a full stable sort."""
    out = torch.zeros_like(probs)
    pending = torch.ones(len(probs), dtype=torch.bool, device=probs.device)
    if FILTER_HEAD + 1 < probs.shape[-1]:
        # sorted by id first, so the stable sort by probability breaks ties by lower id
        ids = probs.topk(FILTER_HEAD + 1, dim=-1).indices.sort(dim=-1).values
        ranked, pos = probs.gather(1, ids).sort(dim=-1, descending=True, stable=True)
        keep = _keep(ranked, top_ks, top_ps, min_ps)
        # Done when the last ranked token is dropped and every kept one is above it (so above
        # every token outside the head, which topk may have chosen among ties arbitrarily).
        lowest_kept = ranked.masked_fill(~keep, float("inf")).amin(dim=-1)
        pending = lowest_kept <= ranked[:, -1]
        out.scatter_(1, ids.gather(1, pos), _normalised(ranked, keep & ~pending[:, None]))
    if pending.any():
        rows = pending.nonzero().squeeze(1)
        ranked, order = probs[rows].sort(dim=-1, descending=True, stable=True)
        keep = _keep(ranked, *_of_rows(rows, top_ks, top_ps, min_ps))
        out[rows] = torch.zeros_like(ranked).scatter_(1, order, _normalised(ranked, keep))
    return out


def _normalised(ranked: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, ranked, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).tiny)
