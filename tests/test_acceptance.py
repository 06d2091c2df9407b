import pytest
import torch

from dflash_sglang import acceptance
from dflash_sglang.block import assemble_candidates, build_draft_block
from dflash_sglang.suffix import SuffixProposal


def test_block_is_anchor_then_masks():
    ids = build_draft_block(torch.tensor([7, 9]), 4, mask_token_id=99)
    assert ids.tolist() == [[7, 99, 99, 99], [9, 99, 99, 99]]


def test_row_argmax_is_argmax_ties_nan_and_inf_included():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        # bf16 rounding of small integers makes many exact ties per row
        logits = torch.randint(-8, 8, (64, 4096)).to(dtype)
        logits[3, :] = float("-inf")
        logits[5, 17] = float("nan")
        logits[6, [9, 4000]] = float("inf")
        assert torch.equal(acceptance.row_argmax(logits), torch.argmax(logits, dim=-1))
    rows = torch.randn(2, 5, 300)
    assert torch.equal(acceptance.row_argmax(rows), rows.argmax(-1))


def test_greedy_accepts_matching_prefix_and_takes_bonus_at_first_mismatch():
    cand = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3], [5, 1, 2, 3]])
    pred = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [8, 2, 3, 4]])
    acc = acceptance.greedy_accept(cand, pred)
    assert acc.accept_lens.tolist() == [3, 1, 0]
    assert acc.bonus.tolist() == [4, 9, 8]
    assert acc.commit_lens.tolist() == [4, 2, 1]
    emitted = [row[:n].tolist() for row, n in zip(acc.out_tokens, acc.commit_lens, strict=True)]
    assert emitted == [[1, 2, 3, 4], [1, 9], [8]]


def test_greedy_stops_at_first_mismatch_even_if_later_drafts_match():
    acc = acceptance.greedy_accept(torch.tensor([[0, 1, 7, 3]]), torch.tensor([[1, 2, 3, 5]]))
    assert acc.accept_lens.tolist() == [1]
    assert acc.bonus.tolist() == [2]


def test_width_one_step_equals_the_general_commit():
    """The plain-step shortcut returns what the general rule returns at width 1."""
    cand, pred = torch.tensor([[5], [6], [7]]), torch.tensor([[1], [9], [8]])
    fast = acceptance.greedy_accept(cand, pred)
    general = acceptance.commit(cand, torch.zeros(3, dtype=torch.int32), pred[:, 0])
    for name in ("accept_lens", "bonus", "commit_lens", "out_tokens"):
        got, want = getattr(fast, name), getattr(general, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name


def _probs(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_sampled_accept_with_one_hot_target_equals_greedy():
    torch.manual_seed(0)
    pred = torch.tensor([[1, 2, 0]])
    probs = torch.nn.functional.one_hot(pred, 4).float()
    cand = torch.tensor([[3, 1, 3]])
    acc = acceptance.sampled_accept(cand, probs, torch.rand(1, 2))
    assert acc.accept_lens.tolist() == [1] and acc.bonus.tolist() == [2]


def test_sampled_accept_is_distribution_exact_for_first_token():
    """P(first emitted token = x) must equal p(x) whatever the draft proposes."""
    torch.manual_seed(0)
    p = [0.5, 0.3, 0.2]
    n = 40000
    probs = _probs([p, p]).expand(n, 2, 3)
    cand = torch.tensor([[0, 1]]).expand(n, 2)  # the draft always proposes token 1
    acc = acceptance.sampled_accept(cand, probs, torch.rand(n, 1))
    first = acc.out_tokens[:, 0]
    freq = torch.bincount(first, minlength=3).float() / n
    assert torch.allclose(freq, torch.tensor(p), atol=0.01), freq


def test_sampling_probs_top_k_top_p_min_p():
    logits = torch.log(_probs([[0.5, 0.3, 0.15, 0.05]] * 4))
    temps = torch.ones(4)
    probs = acceptance.sampling_probs(
        logits,
        temps,
        torch.tensor([4, 2, 4, 4]),
        torch.tensor([1.0, 1.0, 0.7, 1.0]),
        torch.tensor([0.0, 0.0, 0.0, 0.2]),
    )
    assert torch.allclose(probs[0], _probs([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(probs[1], _probs([0.625, 0.375, 0, 0]))
    assert torch.allclose(probs[2], _probs([0.625, 0.375, 0, 0]))
    assert torch.allclose(probs[3], _probs([0.5, 0.3, 0.15, 0]) / 0.95)


def _suffix(*tokens: int) -> SuffixProposal:
    return SuffixProposal(tokens, match_len=2, count=1)


def test_assemble_candidates_replaces_the_rows_that_take_a_suffix_proposal():
    drafts = torch.tensor([[5, 1, 2, 3], [6, 1, 2, 3], [7, 1, 2, 3]])
    out = assemble_candidates(drafts, [_suffix(40, 41, 42), None, _suffix(50, 51, 52, 53)], 4, 0)
    assert out.tolist() == [[5, 40, 41, 42], [6, 1, 2, 3], [7, 50, 51, 52]]


def test_assemble_candidates_keeps_drafter_tokens_past_a_short_proposal():
    drafts = torch.tensor([[5, 1, 2, 3], [6, 1, 2, 3]])
    out = assemble_candidates(drafts, [_suffix(40), None], 3, 0)
    assert out.tolist() == [[5, 40, 2], [6, 1, 2]]


def test_assemble_candidates_pads_when_the_drafter_did_not_run():
    anchors = torch.tensor([[5], [6]])
    out = assemble_candidates(anchors, [_suffix(40, 41), None], 4, pad_token=99)
    assert out.tolist() == [[5, 40, 41, 99], [6, 99, 99, 99]]
    assert out.dtype == anchors.dtype


def test_assemble_candidates_at_width_1_is_the_anchor_alone():
    drafts = torch.tensor([[5, 1, 2], [6, 1, 2]])
    assert assemble_candidates(drafts, [_suffix(40), None], 1, 0).tolist() == [[5], [6]]
    anchors = torch.tensor([[5], [6]])
    assert assemble_candidates(anchors, [_suffix(40), None], 1, 0).tolist() == [[5], [6]]


def test_assemble_candidates_leaves_the_drafts_untouched():
    drafts = torch.tensor([[5, 1, 2, 3], [6, 1, 2, 3]])
    before = drafts.clone()
    out = assemble_candidates(drafts, [_suffix(40, 41, 42), _suffix(50)], 4, 0)
    assert out.tolist() == [[5, 40, 41, 42], [6, 50, 2, 3]]
    assert torch.equal(drafts, before)


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat (the cut beyond the head) .. sharp
def test_sampling_probs_head_path_equals_the_full_sort(monkeypatch, scale):
    """Rows filtered within the top FILTER_HEAD + 1 tokens skip the full sort; the rest take
    it. Either way the result is the full sort's, ties included (lower id first)."""
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 24, 3000
    logits = torch.randn(rows, vocab, generator=gen) * scale
    logits[::4, 1:40] = logits[::4, :1]  # a tied group at the top of some rows
    logits[1::4, 200:300] = 9.0  # ... a larger one inside the head
    logits[2::4, ::7] = 12.0  # ... and one across its boundary: topk picks among it arbitrarily
    temps = torch.full((rows,), 0.7)
    top_ks = torch.tensor([vocab, 5, 100, 1 << 30, 300, 1] * 4)
    top_ps = torch.tensor([0.9, 1.0, 0.5, 0.99, 1.0, 0.3] * 4)
    min_ps = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.01, 0.0] * 4)
    fast = acceptance.sampling_probs(logits, temps, top_ks, top_ps, min_ps)
    kept = (fast > 0).sum(-1)
    assert (kept > acceptance.FILTER_HEAD).any() or scale > 0.05  # full sort taken on some
    assert (kept <= acceptance.FILTER_HEAD).any()  # ... and the head path on others
    monkeypatch.setattr(acceptance, "FILTER_HEAD", vocab)
    full = acceptance.sampling_probs(logits, temps, top_ks, top_ps, min_ps)
    assert ((fast > 0) == (full > 0)).all()
    torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-7)


def test_sampling_probs_unfiltered_rows_are_the_softmax():
    logits = torch.randn(3, 500)
    probs = acceptance.sampling_probs(
        logits, torch.ones(3), torch.full((3,), 1 << 30), torch.ones(3), torch.zeros(3)
    )
    torch.testing.assert_close(probs, torch.softmax(logits, -1))
