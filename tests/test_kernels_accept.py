"""`kernels.accept` against `acceptance`'s torch rules: exact equality, ties, distribution.

Test functions only pick cases. The `check_*` bodies take the device first and run where
the `kernel_runner` fixture sends them: interpreted on CPU in a separate process (the
`interpret` fixture says why), or compiled on CUDA with DFLASH_KERNEL_DEVICE=cuda. Cases are
drawn on CPU from seeded generators, then moved, so both modes see the same inputs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_sglang import acceptance
from dflash_sglang.acceptance import Acceptance
from dflash_sglang.kernels import accept

FIELDS = ("accept_lens", "bonus", "commit_lens", "out_tokens")
TOP_K_OFF = 1 << 30  # SGLang's "no top-k"


def assert_same(got: Acceptance, want: Acceptance, where: str = "") -> None:
    for field in FIELDS:
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}{field}: {a.tolist()} != {b}"


def distinct_logits(rows: int, vocab: int, scale: float, gen: torch.Generator) -> torch.Tensor:
    """Gaussian-shaped logits without ties: normal quantiles of a random permutation."""
    ranks = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)])
    return scale * torch.special.ndtri((ranks.double() + 0.5) / vocab).float()


def chain_candidates(
    predict: torch.Tensor, accept_lens: torch.Tensor, vocab: int, gen: torch.Generator
) -> torch.Tensor:
    """Drafts equal to `predict` up to each request's length, then a mismatch, then noise."""
    bs, block = predict.shape
    candidates = torch.randint(0, vocab, (bs, block), generator=gen)
    for i, n in enumerate(accept_lens.tolist()):
        candidates[i, 1 : n + 1] = predict[i, :n]
        if n < block - 1:
            candidates[i, n + 1] = (predict[i, n] + 1) % vocab
    return candidates


# ----------------------------------------------------------------------------- greedy


def check_greedy(
    device: torch.device, bs: int, block: int, vocab: int, dtype_name: str, ties: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs * block, vocab, generator=gen)
    if ties:  # a few levels only: many rows have their maximum at several ids
        logits = logits.mul(2).round()
    logits = logits.to(getattr(torch, dtype_name))
    predict = logits.argmax(dim=-1).view(bs, block)
    lens = torch.randint(0, block, (bs,), generator=gen)
    candidates = chain_candidates(predict, lens, vocab, gen).to(device)
    logits = logits.to(device)
    got = accept.greedy_accept(logits, candidates)
    assert_same(got, accept.greedy_accept_reference(logits, candidates))
    assert torch.equal(got.accept_lens.cpu(), lens.int()), (got.accept_lens, lens)


@pytest.mark.parametrize(
    "bs, block, vocab, dtype, ties, seed",
    [
        (1, 1, 50, "float32", False, 0),
        (1, 2, 3000, "float32", False, 1),
        (3, 4, 1000, "bfloat16", False, 2),
        (8, 8, 700, "float32", True, 3),
        (5, 16, 2048, "bfloat16", True, 4),
        (2, 16, 9000, "float32", True, 5),  # several vocabulary chunks
    ],
)
def test_greedy_matches_torch(kernel_runner, bs, block, vocab, dtype, ties, seed):
    kernel_runner(check_greedy, bs, block, vocab, dtype, ties, seed)


def check_greedy_every_accept_length(device: torch.device, block: int) -> None:
    gen = torch.Generator().manual_seed(block)
    logits = torch.randn(block * block, 300, generator=gen)
    lens = torch.arange(block)
    candidates = chain_candidates(logits.argmax(-1).view(block, block), lens, 300, gen)
    logits, candidates = logits.to(device), candidates.to(device)
    got = accept.greedy_accept(logits, candidates)
    assert torch.equal(got.accept_lens.cpu(), lens.int()), got.accept_lens
    assert_same(got, accept.greedy_accept_reference(logits, candidates))


@pytest.mark.parametrize("block", [2, 4, 8, 16])
def test_greedy_every_accept_length(kernel_runner, block):
    kernel_runner(check_greedy_every_accept_length, block)


def check_greedy_argmax_rule(device: torch.device) -> None:
    """First maximal id wins, across vocabulary chunks too; NaN counts as the maximum."""
    vocab = 9000
    logits = torch.zeros(4, vocab, device=device)
    logits[0, [5000, 6000, 8999]] = 7.0  # tie across chunks: the first
    logits[1, [3, 4100]] = float("inf")
    logits[2, :] = float("-inf")  # all -inf: id 0, as torch
    logits[3, [10, 8000]] = 9.0
    logits[3, 4500] = float("nan")
    candidates = torch.tensor([[0, 5000, 3, 0]], device=device)
    got = accept.greedy_accept(logits, candidates)
    want = torch.tensor([[5000, 3, 0, 4500]])
    assert torch.equal(got.out_tokens.cpu(), want), got.out_tokens
    assert_same(got, accept.greedy_accept_reference(logits, candidates))


def test_greedy_argmax_rule(kernel_runner):
    kernel_runner(check_greedy_argmax_rule)


def check_greedy_writes_caller_buffers(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(3 * 4, 100, generator=gen).to(device)
    candidates = torch.randint(0, 100, (3, 4), generator=gen).to(device)
    out = Acceptance(
        accept_lens=torch.full((3,), -1, dtype=torch.int32, device=device),
        bonus=torch.full((3,), -1, dtype=torch.int64, device=device),
        commit_lens=torch.full((3,), -1, dtype=torch.int32, device=device),
        out_tokens=torch.full((3, 4), -1, dtype=torch.int64, device=device),
    )
    assert accept.greedy_accept(logits, candidates, out) is out
    assert_same(out, accept.greedy_accept_reference(logits, candidates))
    with pytest.raises(ValueError, match="out.bonus"):
        accept.greedy_accept(logits, candidates, replace(out, bonus=out.accept_lens))


def test_greedy_writes_caller_buffers(kernel_runner):
    kernel_runner(check_greedy_writes_caller_buffers)


# --------------------------------------------------------------------------- sampling


def sampling_case(device: torch.device, bs: int, block: int, vocab: int, min_p: bool, seed: int):
    """Tie-free logits, drafts that are often the row's top token, mixed parameters."""
    gen = torch.Generator().manual_seed(seed)
    logits = distinct_logits(bs * block, vocab, scale=3.0, gen=gen)
    temperatures = torch.tensor([0.3, 0.7, 1.0, 1.5])[torch.randint(0, 4, (bs,), generator=gen)]
    top_ks = torch.tensor([1, 5, 50, vocab, TOP_K_OFF])[torch.randint(0, 5, (bs,), generator=gen)]
    top_ps = torch.tensor([0.5, 0.9, 1.0])[torch.randint(0, 3, (bs,), generator=gen)]
    min_ps = torch.tensor([0.0, 0.05, 0.2])[torch.randint(0, 3, (bs,), generator=gen)]
    top = logits.argmax(-1).view(bs, block)
    candidates = torch.randint(0, vocab, (bs, block), generator=gen)
    likely = torch.rand(bs, block - 1, generator=gen) < 0.8
    candidates[:, 1:] = torch.where(likely, top[:, :-1], candidates[:, 1:])
    coins = torch.rand(bs, block - 1, generator=gen)
    draws = torch.rand(bs, generator=gen)
    logits, candidates, coins, draws = (t.to(device) for t in (logits, candidates, coins, draws))
    params = tuple(t.to(device) for t in (temperatures, top_ks, top_ps))
    return logits, candidates, (*params, min_ps.to(device) if min_p else None), coins, draws


def check_sampled(
    device: torch.device, bs: int, block: int, vocab: int, min_p: bool, seed: int
) -> None:
    logits, candidates, params, coins, draws = sampling_case(device, bs, block, vocab, min_p, seed)
    got = accept.sampled_accept(logits, candidates, *params, coins, draws)
    assert_same(got, accept.sampled_accept_reference(logits, candidates, *params, coins, draws))


@pytest.mark.parametrize("min_p", [False, True], ids=["no_min_p", "min_p"])
@pytest.mark.parametrize(
    "bs, block, vocab, seed",
    [(1, 1, 40, 0), (4, 2, 3000, 1), (8, 4, 200, 2), (3, 8, 1000, 3), (2, 16, 500, 4)],
)
def test_sampled_matches_torch(kernel_runner, bs, block, vocab, min_p, seed):
    kernel_runner(check_sampled, bs, block, vocab, min_p, seed)


def filtered_probs(logits: torch.Tensor, temperatures: torch.Tensor, rows: accept.RowFilter):
    """The distribution a `RowFilter` describes, per row (temperatures per row)."""
    z = logits.float() / temperatures.view(-1, 1).clamp_min(1e-6)
    top, cut, kept_mass = rows.stats.unbind(dim=1)
    ids = torch.arange(logits.shape[1], device=logits.device)
    kept = (z > cut[:, None]) | ((z == cut[:, None]) & (ids <= rows.last_ids[:, None]))
    return torch.where(kept, (z - top[:, None]).exp(), 0.0) / kept_mass[:, None]


def check_filter_matches_sampling_probs(device: torch.device, vocab: int, seed: int) -> None:
    logits, candidates, params, _, _ = sampling_case(device, 16, 2, vocab, True, seed)
    rows = accept.filter_rows(logits, 2, *params)
    per_row = [p.repeat_interleave(2) for p in params]
    want = acceptance.sampling_probs(logits, *per_row)
    got = filtered_probs(logits, per_row[0], rows)
    # Only at a top-p cut inside rounding, e.g. top_p=1 where torch's fp32 cumsum reaches
    # 1.0 before a long tail ends (it drops the tail, the kernel keeps it), may the kept
    # sets differ, and only by tokens too unlikely to matter.
    differ = (got > 0) != (want > 0)
    assert (torch.maximum(got, want)[differ] < 1e-6).all(), "kept sets differ"
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("vocab, seed", [(30, 0), (1000, 1), (3000, 2)])
def test_filter_matches_sampling_probs(kernel_runner, vocab, seed):
    kernel_runner(check_filter_matches_sampling_probs, vocab, seed)


def check_sampled_every_accept_length(device: torch.device, block: int) -> None:
    """Drafts are each row's top token; a zero coin accepts it, a coin near 1 rejects it."""
    gen = torch.Generator().manual_seed(block)
    vocab = 64
    logits = distinct_logits(block * block, vocab, scale=1.0, gen=gen)
    lens = torch.arange(block)
    candidates = torch.cat(
        [torch.zeros(block, 1, dtype=torch.int64), logits.argmax(-1).view(block, block)[:, :-1]],
        dim=1,
    )
    coins = torch.where(torch.arange(block - 1) < lens[:, None], 0.0, 1 - 1e-6)
    ones = torch.ones(block)
    params = (ones, torch.full((block,), TOP_K_OFF), ones, None)
    draws = torch.rand(block, generator=gen)
    logits, candidates, coins, draws = (t.to(device) for t in (logits, candidates, coins, draws))
    params = (*(t.to(device) for t in params[:3]), None)
    got = accept.sampled_accept(logits, candidates, *params, coins, draws)
    assert torch.equal(got.accept_lens.cpu(), lens.int()), got.accept_lens
    assert_same(got, accept.sampled_accept_reference(logits, candidates, *params, coins, draws))


@pytest.mark.parametrize("block", [2, 4, 16])
def test_sampled_every_accept_length(kernel_runner, block):
    kernel_runner(check_sampled_every_accept_length, block)


def check_greedy_rows_inside_sampled_batch(device: torch.device, seed: int) -> None:
    """top_k=1 rows accept exactly as greedy does (ties: first id), whatever the draws."""
    bs, block, vocab = 6, 4, 300
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs * block, vocab, generator=gen).mul(2).round()  # many ties
    predict = logits.argmax(-1).view(bs, block)
    candidates = chain_candidates(
        predict, torch.randint(0, block, (bs,), generator=gen), vocab, gen
    )
    is_greedy = torch.tensor([True, False, True, True, False, True])
    temperatures = torch.where(is_greedy, torch.tensor([1e-9, 1, 0.7, 1.3, 1, 1.0]), 0.8)
    top_ks = torch.where(is_greedy, 1, 20)
    top_ps = torch.where(is_greedy, 1.0, 0.9)
    coins, draws = torch.rand(bs, block - 1, generator=gen), torch.rand(bs, generator=gen)
    logits, candidates, temperatures, top_ks, top_ps, coins, draws = (
        t.to(device) for t in (logits, candidates, temperatures, top_ks, top_ps, coins, draws)
    )
    got = accept.sampled_accept(
        logits, candidates, temperatures, top_ks, top_ps, None, coins, draws
    )
    want = accept.greedy_accept_reference(logits, candidates)
    is_greedy = is_greedy.to(device)
    for field in FIELDS:
        a, b = getattr(got, field)[is_greedy], getattr(want, field)[is_greedy]
        assert torch.equal(a, b), f"{field}: {a.tolist()} != {b.tolist()}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_rows_inside_sampled_batch(kernel_runner, seed):
    kernel_runner(check_greedy_rows_inside_sampled_batch, seed)


# Ties at the cut are broken by lower token id (a stable descending sort): top-k keeps
# exactly k tokens and top-p walks a tied group in id order.
TIE_CASES = {
    "top_k_2_of_three_tied": ([1.0, 3.0, 3.0, 3.0, 0.0], 2, 1.0, 0.0, 3.0, 2, [1, 2, 2]),
    "top_k_1_first_max": ([0.0, 5.0, 5.0, 1.0], 1, 1.0, 0.0, 5.0, 1, [1, 1, 1]),
    "top_p_half_of_three_tied": ([2.0, 2.0, 2.0, 0.0], TOP_K_OFF, 0.5, 0.0, 2.0, 1, [0, 1, 1]),
    "min_p_keeps_whole_tie": ([4.0, 4.0, 1.0, 4.0], TOP_K_OFF, 1.0, 0.5, 4.0, 4, [0, 3, 3]),
}


def check_ties(device: torch.device, logits, top_k, top_p, min_p, cut, last_id, emitted) -> None:
    """One request, no drafts (B=1): the bonus is drawn from the filtered row."""
    n = len(emitted)
    logits = torch.tensor([logits], device=device).repeat(n, 1)
    params = tuple(torch.full((n,), value, device=device) for value in (1.0, top_k, top_p, min_p))
    rows = accept.filter_rows(logits, 1, *params)
    assert rows.stats[0, 1].item() == cut and rows.last_ids[0].item() == last_id, rows
    draws = torch.tensor([0.25, 0.75, 0.999], device=device)
    candidates = torch.zeros(n, 1, dtype=torch.int64, device=device)
    coins = torch.empty(n, 0, device=device)
    got = accept.sampled_accept(logits, candidates, *params, coins, draws)
    assert got.bonus.tolist() == emitted, got.bonus.tolist()


@pytest.mark.parametrize("case", list(TIE_CASES))
def test_ties(kernel_runner, case):
    kernel_runner(check_ties, *TIE_CASES[case])


def check_first_token_distribution(
    device: torch.device, draft_kind: str, min_p: float, n: int
) -> None:
    """Emitted tokens over n independent draws of one two-row request.

    The first token must follow row 0's filtered distribution whatever the draft (the
    row's top token, often accepted, or one top-k drops, always rejected); after an
    accepted draft the bonus follows row 1's. Rows are filtered once and tiled n times.
    Every frequency must lie within 5 standard errors of its probability.
    """
    gen = torch.Generator().manual_seed(0)
    block, vocab = 2, 10
    logits = distinct_logits(block, vocab, scale=1.5, gen=gen).to(device)
    params = tuple(torch.tensor([value], device=device) for value in (1.0, 6, 0.9, min_p))
    probs = acceptance.sampling_probs(logits, *[p.repeat(block) for p in params])
    draft = {"top": probs[0].argmax(), "filtered_out": probs[0].argmin()}[draft_kind]
    rows = accept.filter_rows(logits, block, *params)
    tiled = accept.RowFilter(rows.stats.repeat(n, 1), rows.last_ids.repeat(n))
    candidates = torch.tensor([[0, int(draft)]], device=device).repeat(n, 1)
    coins, draws = torch.rand(n, 1, generator=gen), torch.rand(n, generator=gen)
    got = accept.sample_chain(
        logits.repeat(n, 1),
        candidates,
        torch.ones(n, device=device),
        tiled,
        coins.to(device),
        draws.to(device),
    )
    accepted = got.accept_lens == 1
    if draft_kind == "filtered_out":
        assert not accepted.any(), "a draft outside the filtered set was accepted"
    for name, tokens, p in (
        ("first", got.out_tokens[:, 0], probs[0]),
        ("after_accept", got.out_tokens[accepted, 1], probs[1]),
    ):
        if len(tokens) == 0:
            continue
        freq = torch.bincount(tokens, minlength=vocab).double() / len(tokens)
        assert (freq[p == 0] == 0).all(), f"{name}: a filtered-out token was emitted"
        errors = (freq - p).abs() / (p * (1 - p) / len(tokens)).sqrt().clamp_min(1e-12)
        assert errors.max() < 5, f"{name}: {freq.tolist()} vs {p.tolist()}"


@pytest.mark.parametrize("draft_kind, min_p", [("top", 0.1), ("filtered_out", 0.0)])
def test_first_token_distribution(kernel_runner, draft_kind, min_p):
    kernel_runner(check_first_token_distribution, draft_kind, min_p, 1500)
