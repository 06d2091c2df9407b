"""Verification in Triton: fused greedy and exact sampled acceptance, each beside a torch twin.

Conventions are `dflash_sglang.acceptance`'s: `candidates` is `[bs, B]` (anchor, then B-1
drafts); target logits are `[bs*B, V]`, row `r*B + j` scoring the token after
`candidates[r, j]`; results come back as an `acceptance.Acceptance`.

Greedy: one program per request walks its rows, taking each row's argmax (first maximal
index, NaN counting as maximal, as `torch.argmax` does) and stopping at the first mismatch,
so rows past it are never read.

Sampling: one program per row finds the row's filtered distribution without sorting, then
one program per request runs the speculative chain and draws the bonus by inverse CDF from
the given uniforms, so results are a deterministic function of the draws.

Filter semantics (`acceptance.sampling_probs`, with a defined order among ties): tokens are
ordered by scaled logit, descending, ties broken by lower token id (a stable sort). A token
is kept iff its rank is < top_k, the mass of the tokens before it is < top_p and its
probability is >= min_p times the top probability; the first token is always kept. Top-k
therefore keeps exactly k tokens, and top_k=1 keeps exactly `argmax`, so greedy rows inside
a sampled batch accept exactly as `greedy_accept` does. The cut is found by bisection over
the float bit patterns of the threshold (exact), then over token ids inside a tied group.
Exact up to fp32 rounding: masses are summed in another order than torch's cumsum, so a
coin or draw within ~1e-6 of a probability or CDF boundary may resolve differently, as may
a token whose mass before it is within rounding of top_p (top_p=1 beside top-k or min-p:
torch's cumsum reaches 1.0 before a long tail ends and drops tokens of p < 1e-6 that the
kernel keeps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dflash_sglang import acceptance
from dflash_sglang.acceptance import Acceptance

_MAX_BLOCK_V = 4096
_KEY_NEG_INF = -2139095041  # the order key of -inf (see `_key`)


def _block_v(vocab: int) -> int:
    return min(triton.next_power_of_2(vocab), _MAX_BLOCK_V)


def _check_inputs(logits: torch.Tensor, candidates: torch.Tensor) -> None:
    bs, block = candidates.shape
    if logits.ndim != 2 or logits.shape[0] != bs * block or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be [bs*B, V] = [{bs * block}, V] with unit column stride, "
            f"got shape {tuple(logits.shape)} strides {logits.stride()}"
        )
    if not candidates.is_contiguous():
        raise ValueError("candidates must be contiguous [bs, B]")


def _outputs(candidates: torch.Tensor, out: Acceptance | None) -> Acceptance:
    bs, block = candidates.shape
    if out is None:
        dev = candidates.device
        return Acceptance(
            accept_lens=torch.empty(bs, dtype=torch.int32, device=dev),
            bonus=torch.empty(bs, dtype=torch.int64, device=dev),
            commit_lens=torch.empty(bs, dtype=torch.int32, device=dev),
            out_tokens=torch.empty(bs, block, dtype=torch.int64, device=dev),
        )
    for name, dtype, shape in (
        ("accept_lens", torch.int32, (bs,)),
        ("bonus", torch.int64, (bs,)),
        ("commit_lens", torch.int32, (bs,)),
        ("out_tokens", torch.int64, (bs, block)),
    ):
        t = getattr(out, name)
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"out.{name} must be contiguous {dtype} {shape}")
    return out


@triton.jit
def _store_result(
    cand_row, n, bonus, req, accept_ptr, bonus_ptr, commit_ptr, out_ptr,
    BLOCK: tl.constexpr, BLOCK_POW2: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_POW2)
    drafts = tl.load(cand_row + 1 + cols, mask=cols < n, other=0)
    tokens = tl.where(cols < n, drafts, bonus.to(tl.int64))
    tl.store(out_ptr + req * BLOCK + cols, tokens, mask=cols < BLOCK)
    tl.store(accept_ptr + req, n)
    tl.store(commit_ptr + req, n + 1)
    tl.store(bonus_ptr + req, bonus.to(tl.int64))


# ---------------------------------------------------------------------------- greedy


@triton.jit
def _row_argmax(row_ptr, vocab, BLOCK_V: tl.constexpr):
    best_v = tl.full((), float("-inf"), tl.float32)
    best_i = tl.zeros((), tl.int32)
    seen_nan = tl.zeros((), tl.int1)
    for start in range(0, vocab, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        valid = idx < vocab
        v = tl.load(row_ptr + idx, mask=valid, other=float("-inf")).to(tl.float32)
        is_nan = v != v
        first_nan = tl.min(tl.where(is_nan, idx, vocab))
        chunk_max = tl.max(tl.where(is_nan, float("-inf"), v))
        chunk_i = tl.min(tl.where(valid & (v == chunk_max), idx, vocab))
        has_nan = first_nan < vocab
        # Earlier chunks hold lower indices, so a tie keeps the running best.
        take_max = ~seen_nan & ~has_nan & (chunk_max > best_v)
        best_i = tl.where(~seen_nan & has_nan, first_nan, tl.where(take_max, chunk_i, best_i))
        best_v = tl.where(take_max, chunk_max, best_v)
        seen_nan = seen_nan | has_nan
    return best_i


@triton.jit
def _draft_matches(cand_row, n, top, BLOCK: tl.constexpr):
    has_draft = n < BLOCK - 1
    draft = tl.load(cand_row + 1 + n, mask=has_draft, other=-1)
    return has_draft & (draft == top)


@triton.jit
def _greedy_accept_kernel(
    logits_ptr, logits_stride, cand_ptr, accept_ptr, bonus_ptr, commit_ptr, out_ptr, vocab,
    BLOCK: tl.constexpr, BLOCK_POW2: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0).to(tl.int64)
    rows = logits_ptr + req * BLOCK * logits_stride
    cand_row = cand_ptr + req * BLOCK
    n = tl.zeros((), tl.int32)
    top = _row_argmax(rows, vocab, BLOCK_V)
    live = _draft_matches(cand_row, n, top, BLOCK)
    while live:
        n += 1
        top = _row_argmax(rows + n * logits_stride, vocab, BLOCK_V)
        live = _draft_matches(cand_row, n, top, BLOCK)
    _store_result(
        cand_row, n, top, req, accept_ptr, bonus_ptr, commit_ptr, out_ptr, BLOCK, BLOCK_POW2
    )


def greedy_accept(
    logits: torch.Tensor, candidates: torch.Tensor, out: Acceptance | None = None
) -> Acceptance:
    """Argmax, prefix match and bonus in one launch; `out` lets a caller reuse buffers."""
    _check_inputs(logits, candidates)
    out = _outputs(candidates, out)
    bs, block = candidates.shape
    if bs == 0:
        return out
    _greedy_accept_kernel[(bs,)](
        logits, logits.stride(0), candidates, out.accept_lens, out.bonus, out.commit_lens,
        out.out_tokens, logits.shape[1],
        BLOCK=block, BLOCK_POW2=triton.next_power_of_2(block), BLOCK_V=_block_v(logits.shape[1]),
    )  # fmt: skip
    return out


def greedy_accept_reference(logits: torch.Tensor, candidates: torch.Tensor) -> Acceptance:
    """The torch twin of `greedy_accept`."""
    bs, block = candidates.shape
    return acceptance.greedy_accept(candidates, logits.argmax(dim=-1).view(bs, block))


# -------------------------------------------------------------------------- sampling


@triton.jit
def _key(x):
    """fp32 -> int32 with the same order (-0.0 just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _from_key(key):
    key = key.to(tl.int32)
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _scaled(row_ptr, idx, mask, temp):
    logit = tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32)
    return tl.div_rn(logit, temp)


@triton.jit
def _above(row_ptr, vocab, temp, top, t, BLOCK_V: tl.constexpr):
    """Counts of tokens scoring > `t` and >= `t`, and the unnormalised mass of the former."""
    count = tl.zeros((), tl.int32)
    count_ge = tl.zeros((), tl.int32)
    mass = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        z = _scaled(row_ptr, idx, idx < vocab, temp)
        above = z > t
        count += tl.sum(above.to(tl.int32))
        count_ge += tl.sum((z >= t).to(tl.int32))
        mass += tl.sum(tl.where(above, tl.exp(z - top), 0.0))
    return count, count_ge, mass


@triton.jit
def _filter_row_kernel(
    logits_ptr, logits_stride, temps_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr,
    stats_ptr, last_ids_ptr, vocab, block,
    HAS_MIN_P: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Per row: max scaled logit, cut value, last kept id at the cut value, kept mass.

    A token with scaled logit z is kept iff z > cut, or z == cut and id <= last id.
    """
    row = tl.program_id(0).to(tl.int64)
    req = row // block
    row_ptr = logits_ptr + row * logits_stride
    temp = tl.maximum(tl.load(temps_ptr + req).to(tl.float32), 1e-6)
    top_k = tl.maximum(tl.minimum(tl.load(top_ks_ptr + req), vocab).to(tl.int32), 1)
    top_p = tl.load(top_ps_ptr + req).to(tl.float32)
    min_p = 0.0
    if HAS_MIN_P:
        min_p = tl.load(min_ps_ptr + req).to(tl.float32)

    top = tl.full((), float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        top = tl.maximum(top, tl.max(_scaled(row_ptr, idx, idx < vocab, temp)))
    total = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        total += tl.sum(tl.exp(_scaled(row_ptr, idx, idx < vocab, temp) - top))

    cut = tl.full((), float("-inf"), tl.float32)
    last_id = tl.zeros((), tl.int32) + vocab
    kept_mass = total
    if (top_k < vocab) | (top_p < 1.0) | (min_p > 0.0):
        # Smallest threshold t at which a token scoring t would still be kept: the
        # predicate is monotone in t, so bisect over the ordered fp32 bit patterns.
        # Stops once no score lies strictly between lo and hi: the cut is then the lowest
        # score >= hi, whatever the exact threshold in (lo, hi].
        p_budget = top_p * total
        lo = tl.full((), _KEY_NEG_INF - 1, tl.int64)  # virtual "not kept" below -inf
        hi = _key(top).to(tl.int64)  # the top token is always kept
        count_above_lo = tl.zeros((), tl.int32) + vocab
        count_at_hi = tl.full((), 1, tl.int32)  # at least the top; a low guess costs a step
        while (hi - lo > 1) & (count_above_lo > count_at_hi):
            mid = lo + (hi - lo) // 2
            t = _from_key(mid)
            count, count_ge, mass = _above(row_ptr, vocab, temp, top, t, BLOCK_V)
            kept = (count < top_k) & (mass < p_budget) & (tl.exp(t - top) >= min_p)
            hi = tl.where(kept, mid, hi)
            count_at_hi = tl.where(kept, count_ge, count_at_hi)
            lo = tl.where(kept, lo, mid)
            count_above_lo = tl.where(kept, count_above_lo, count)
        # The cut is the lowest score >= hi; its tied group is kept in token-id order while
        # rank and mass before each member allow.
        threshold = _from_key(hi)
        cut = top
        for start in range(0, vocab, BLOCK_V):
            idx = start + tl.arange(0, BLOCK_V)
            z = _scaled(row_ptr, idx, idx < vocab, temp)
            cut = tl.minimum(cut, tl.min(tl.where(z >= threshold, z, float("inf"))))
        count, count_ge, mass = _above(row_ptr, vocab, temp, top, cut, BLOCK_V)
        tied = count_ge - count
        weight = tl.exp(cut - top)
        by_mass = tl.ceil((p_budget - mass) / tl.maximum(weight, 1e-30))
        by_mass = tl.minimum(tl.maximum(by_mass, 1.0), tied.to(tl.float32)).to(tl.int32)
        n_keep = tl.maximum(tl.minimum(top_k - count, by_mass), 1)
        n_keep = tl.where(weight > 0.0, n_keep, tied)
        kept_mass = mass + n_keep.to(tl.float32) * weight
        if n_keep < tied:
            # The n_keep-th lowest id in the tied group.
            id_lo = tl.full((), -1, tl.int32)
            id_hi = tl.zeros((), tl.int32) + vocab - 1
            while id_hi - id_lo > 1:
                id_mid = id_lo + (id_hi - id_lo) // 2
                upto = tl.zeros((), tl.int32)
                for start in range(0, vocab, BLOCK_V):
                    idx = start + tl.arange(0, BLOCK_V)
                    z = _scaled(row_ptr, idx, idx < vocab, temp)
                    upto += tl.sum(((z == cut) & (idx <= id_mid)).to(tl.int32))
                enough = upto >= n_keep
                id_hi = tl.where(enough, id_mid, id_hi)
                id_lo = tl.where(enough, id_lo, id_mid)
            last_id = id_hi
    tl.store(stats_ptr + row * 3, top)
    tl.store(stats_ptr + row * 3 + 1, cut)
    tl.store(stats_ptr + row * 3 + 2, kept_mass)
    tl.store(last_ids_ptr + row, last_id)


@triton.jit
def _kept_weight(z, idx, top, cut, last_id):
    kept = (z > cut) | ((z == cut) & (idx <= last_id))
    return tl.where(kept, tl.exp(z - top), 0.0)


@triton.jit
def _row_weight(logits_ptr, logits_stride, stats_ptr, last_ids_ptr, row, token, valid, temp):
    """Unnormalised filtered weight of `token` in `row`, and the row's kept mass."""
    z = _scaled(logits_ptr + row * logits_stride, token, valid, temp)
    top = tl.load(stats_ptr + row * 3)
    cut = tl.load(stats_ptr + row * 3 + 1)
    weight = _kept_weight(z, token, top, cut, tl.load(last_ids_ptr + row))
    return tl.where(valid, weight, 0.0), tl.load(stats_ptr + row * 3 + 2)


@triton.jit
def _draft_accepted(
    logits_ptr, logits_stride, stats_ptr, last_ids_ptr, row, cand_row, coins_row, n, temp,
    BLOCK: tl.constexpr,
):  # fmt: skip
    has_draft = n < BLOCK - 1
    draft = tl.load(cand_row + 1 + n, mask=has_draft, other=0)
    weight, kept_mass = _row_weight(
        logits_ptr, logits_stride, stats_ptr, last_ids_ptr, row, draft, has_draft, temp
    )
    coin = tl.load(coins_row + n, mask=has_draft, other=1.0)
    return has_draft & (coin < weight / kept_mass)


@triton.jit
def _sample_chain_kernel(
    logits_ptr, logits_stride, cand_ptr, temps_ptr, coins_ptr, draws_ptr, stats_ptr,
    last_ids_ptr, accept_ptr, bonus_ptr, commit_ptr, out_ptr, vocab,
    BLOCK: tl.constexpr, BLOCK_POW2: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Accept draft x with probability p(x); on rejection draw from p without x."""
    req = tl.program_id(0).to(tl.int64)
    cand_row = cand_ptr + req * BLOCK
    coins_row = coins_ptr + req * (BLOCK - 1)
    temp = tl.maximum(tl.load(temps_ptr + req).to(tl.float32), 1e-6)
    n = tl.zeros((), tl.int32)
    live = _draft_accepted(
        logits_ptr, logits_stride, stats_ptr, last_ids_ptr, req * BLOCK, cand_row, coins_row,
        n, temp, BLOCK,
    )  # fmt: skip
    while live:
        n += 1
        live = _draft_accepted(
            logits_ptr, logits_stride, stats_ptr, last_ids_ptr, req * BLOCK + n, cand_row,
            coins_row, n, temp, BLOCK,
        )  # fmt: skip

    row = req * BLOCK + n
    rejected = tl.load(cand_row + 1 + n, mask=n < BLOCK - 1, other=-1)
    rejected_weight, kept_mass = _row_weight(
        logits_ptr, logits_stride, stats_ptr, last_ids_ptr, row, rejected, rejected >= 0, temp
    )
    # Inverse CDF: the first id whose running weight exceeds u * residual mass, clamped to
    # the last positive weight in case rounding leaves the running sum short of it.
    target = tl.load(draws_ptr + req) * (kept_mass - rejected_weight)
    row_ptr = logits_ptr + row * logits_stride
    top = tl.load(stats_ptr + row * 3)
    cut = tl.load(stats_ptr + row * 3 + 1)
    last_id = tl.load(last_ids_ptr + row)
    carry = tl.zeros((), tl.float32)
    below = tl.zeros((), tl.int32)
    last_positive = tl.zeros((), tl.int32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        w = _kept_weight(_scaled(row_ptr, idx, idx < vocab, temp), idx, top, cut, last_id)
        w = tl.where(idx == rejected, 0.0, w)
        cum = carry + tl.cumsum(w, 0)
        below += tl.sum((cum <= target).to(tl.int32))
        last_positive = tl.maximum(last_positive, tl.max(tl.where(w > 0.0, idx, 0)))
        carry += tl.sum(w)
    bonus = tl.minimum(below, last_positive)
    _store_result(
        cand_row, n, bonus, req, accept_ptr, bonus_ptr, commit_ptr, out_ptr, BLOCK, BLOCK_POW2
    )


@dataclass(frozen=True)
class RowFilter:
    """Every row's filtered distribution, summarised for the chain kernel.

    With scaled logits z, token t of a row is kept iff z[t] > cut, or z[t] == cut and
    t <= last_id; its probability is exp(z[t] - top) / kept_mass.
    """

    stats: torch.Tensor  # [rows, 3] float32: top (max z), cut, kept_mass
    last_ids: torch.Tensor  # [rows] int32


def _check_per_request(bs: int, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and (tuple(t.shape) != (bs,) or not t.is_contiguous()):
            raise ValueError(f"{name} must be contiguous [bs] = [{bs}], got {tuple(t.shape)}")


def filter_rows(
    logits: torch.Tensor,
    block_size: int,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor | None,
) -> RowFilter:
    """Temperature, top-k, top-p and min-p of every row `[bs*B, V]`, one program per row.

    Rows run in parallel rather than inside the chain: at small batch the filter's passes
    over the vocabulary dominate, and the chain then reads only a few scalars per row.
    """
    rows, vocab = logits.shape
    if rows % block_size or logits.stride(1) != 1:
        raise ValueError(f"logits must be [bs*B, V] with B={block_size} and unit column stride")
    _check_per_request(
        rows // block_size, temperatures=temperatures, top_ks=top_ks, top_ps=top_ps, min_ps=min_ps
    )
    out = RowFilter(
        stats=torch.empty(rows, 3, dtype=torch.float32, device=logits.device),
        last_ids=torch.empty(rows, dtype=torch.int32, device=logits.device),
    )
    if rows:
        _filter_row_kernel[(rows,)](
            logits, logits.stride(0), temperatures, top_ks, top_ps,
            top_ps if min_ps is None else min_ps, out.stats, out.last_ids, vocab, block_size,
            HAS_MIN_P=min_ps is not None, BLOCK_V=_block_v(vocab),
        )  # fmt: skip
    return out


def sample_chain(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    temperatures: torch.Tensor,
    row_filter: RowFilter,
    coins: torch.Tensor,
    draws: torch.Tensor,
    out: Acceptance | None = None,
) -> Acceptance:
    """The speculative chain over filtered rows, one program per request.

    `coins` `[bs, B-1]` and `draws` `[bs]` are uniforms in [0, 1): the acceptance tests
    and the bonus (or residual) draw.
    """
    _check_inputs(logits, candidates)
    out = _outputs(candidates, out)
    bs, block = candidates.shape
    _check_per_request(bs, temperatures=temperatures, draws=draws)
    if tuple(coins.shape) != (bs, block - 1) or not coins.is_contiguous():
        raise ValueError(f"coins must be contiguous [bs, B-1] = [{bs}, {block - 1}]")
    if bs:
        _sample_chain_kernel[(bs,)](
            logits, logits.stride(0), candidates, temperatures, coins, draws,
            row_filter.stats, row_filter.last_ids, out.accept_lens, out.bonus,
            out.commit_lens, out.out_tokens, logits.shape[1],
            BLOCK=block, BLOCK_POW2=triton.next_power_of_2(block),
            BLOCK_V=_block_v(logits.shape[1]),
        )  # fmt: skip
    return out


def sampled_accept(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor | None,
    coins: torch.Tensor,
    draws: torch.Tensor,
    out: Acceptance | None = None,
) -> Acceptance:
    """Exact speculative sampling from raw logits: `filter_rows`, then `sample_chain`.

    Sampling parameters are per request `[bs]`; `min_ps=None` skips min-p.
    """
    block = candidates.shape[1]
    row_filter = filter_rows(logits, block, temperatures, top_ks, top_ps, min_ps)
    return sample_chain(logits, candidates, temperatures, row_filter, coins, draws, out)


def inverse_cdf(weights: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Row-wise draw from unnormalised `weights` `[n, V]` with uniforms `draws` `[n]`."""
    cum = weights.cumsum(dim=-1)
    target = draws.view(-1, 1) * weights.sum(dim=-1, keepdim=True)
    below = (cum <= target).sum(dim=-1)
    ids = torch.arange(weights.shape[-1], device=weights.device)
    last_positive = torch.where(weights > 0, ids, 0).amax(dim=-1)
    return torch.minimum(below, last_positive)


def sampled_accept_reference(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor | None,
    coins: torch.Tensor,
    draws: torch.Tensor,
) -> Acceptance:
    """The torch twin of `sampled_accept`: `acceptance.sampled_accept`'s rule on
    `acceptance.sampling_probs`, drawing by inverse CDF instead of `torch.multinomial`."""
    bs, block = candidates.shape

    def per_row(p: torch.Tensor) -> torch.Tensor:
        return p.repeat_interleave(block)

    probs = acceptance.sampling_probs(
        logits,
        per_row(temperatures),
        per_row(top_ks),
        per_row(top_ps),
        None if min_ps is None else per_row(min_ps),
    ).view(bs, block, -1)
    drafts = candidates[:, 1:].to(torch.int64)
    p_draft = probs[:, :-1].gather(2, drafts.unsqueeze(2)).squeeze(2)
    accept_lens = acceptance.accepted_prefix_len(coins < p_draft)
    row = accept_lens.to(torch.int64)
    final = probs[torch.arange(bs, device=probs.device), row].clone()
    rejected = row < block - 1
    if block > 1:
        rejected_token = drafts.gather(1, row.clamp(max=block - 2).unsqueeze(1)).squeeze(1)
        final[rejected, rejected_token[rejected]] = 0.0
    return acceptance.commit(candidates, accept_lens, inverse_cdf(final, draws))
