"""Two-branch verify trees (`tree.py`): layout, acceptance, exact sampling, chain order."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dflash_sglang import acceptance
from dflash_sglang.cpu_platform.attention import tree_mask
from dflash_sglang.suffix import SuffixProposal
from dflash_sglang.tree import accept, build_tree, custom_mask, permute_rows

ANCHOR = 1


def _proposal(*tokens: int) -> SuffixProposal:
    return SuffixProposal(tuple(tokens), 2, 1)


def test_layout_shares_the_common_prefix_and_pads_the_rest():
    drafts = torch.tensor([[ANCHOR, 10, 11, 12, 13, 14]] * 3)
    suffix = [_proposal(20, 21), _proposal(10, 11, 30, 31, 32), None]
    tree = build_tree(drafts, suffix, width=6, dflash_len=2)
    # Request 0: d1 d2 off the anchor, s1 s2 off the anchor, one padding row.
    assert tree.tokens[0].tolist() == [ANCHOR, 10, 11, 20, 21, 14]
    assert tree.parents[0].tolist() == [0, 0, 1, 0, 3, 0]
    assert tree.depths[0].tolist() == [0, 1, 2, 1, 2, 1]
    assert tree.valid[0].tolist() == [True] * 5 + [False]
    # Request 1: the suffix agrees with d1 d2, so its branch continues from d2 (depth 3 on).
    assert tree.tokens[1].tolist() == [ANCHOR, 10, 11, 30, 31, 32]
    assert tree.parents[1].tolist() == [0, 0, 1, 2, 3, 4]
    assert tree.depths[1].tolist() == [0, 1, 2, 3, 4, 5]
    assert tree.on_suffix[1].tolist() == [False, True, True, True, True, True]
    assert tree.on_dflash[1].tolist() == [False, True, True, False, False, False]
    # Request 2 has no suffix proposal: its whole DFlash chain.
    assert tree.tokens[2].tolist() == drafts[2].tolist()
    assert tree.parents[2].tolist() == [0, 0, 1, 2, 3, 4]


def test_ancestors_follow_the_parents():
    drafts = torch.tensor([[ANCHOR, 10, 11, 12, 13]])
    tree = build_tree(drafts, [_proposal(20, 21)], width=5, dflash_len=2)
    anc = tree.ancestors()[0].int().tolist()
    assert anc == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 0, 0, 1, 1],
    ]


@pytest.mark.parametrize("prefix_lens", [[5, 0, 9], [1, 1, 1], [12, 3, 0]])
def test_flat_custom_mask_is_the_cpu_backends_tree_mask(prefix_lens):
    """The GPU form (SGLang's flat allow-mask FlashInfer reads: per request w rows of
    prefix + w columns, concatenated) against the CPU backend's own tree mask, padding rows
    and a request without a suffix branch included; its size is the one upstream's
    `generate_attn_arg_prefill` expects (so nothing gets padded onto it)."""
    drafts = torch.tensor([[ANCHOR, 10, 11, 12, 13, 14]] * 3)
    suffix = [_proposal(20, 21), _proposal(10, 11, 30, 31, 32), None]
    tree = build_tree(drafts, suffix, width=6, dflash_len=2)
    bs, w = tree.tokens.shape
    flat = custom_mask(tree, torch.tensor(prefix_lens))
    assert flat.dtype == torch.bool
    assert flat.numel() == sum(prefix_lens) * w + w * w * bs
    kv_lens = torch.tensor(prefix_lens) + w
    kv_max = int(kv_lens.max())
    causal = torch.ones(bs, 1, w, kv_max, dtype=torch.bool)
    dense = tree_mask(causal, tree.ancestors(), kv_lens)[:, 0]
    # The CPU mask pads each request's keys to kv_max columns; the flat one packs them.
    expected = torch.cat([dense[r, :, : int(kv_lens[r])].reshape(-1) for r in range(bs)])
    assert torch.equal(flat, expected)


def _target_tokens(tree, wanted: dict[int, int], bs_row: int = 0) -> torch.Tensor:
    """The target's token at each row: `wanted[row]`, else a token no child carries."""
    out = torch.full_like(tree.tokens, 999)
    for row, token in wanted.items():
        out[bs_row, row] = token
    return out


@pytest.mark.parametrize(
    "wanted, path, bonus",
    [
        ({0: 10, 1: 11, 2: 7}, [0, 1, 2], 7),  # the DFlash branch, bonus after d2
        ({0: 20, 3: 21, 4: 8}, [0, 3, 4], 8),  # the suffix branch to its end
        ({0: 5}, [0], 5),  # neither: the target's own token
    ],
)
def test_acceptance_follows_the_branch_the_target_takes(wanted, path, bonus):
    drafts = torch.tensor([[ANCHOR, 10, 11, 12, 13]])
    tree = build_tree(drafts, [_proposal(20, 21)], width=5, dflash_len=2)
    result = accept(tree, _target_tokens(tree, wanted))
    assert result.accept_lens.tolist() == [len(path) - 1]
    assert result.bonus.tolist() == [bonus]
    assert result.order[0, : len(path)].tolist() == path
    assert sorted(result.order[0].tolist()) == list(range(5))
    on_dflash = path[1:] and path[1] == 1
    assert result.dflash_accepted.tolist() == [len(path) - 1 if on_dflash else 0]
    assert result.suffix_accepted.tolist() == [0 if on_dflash else len(path) - 1]


def test_padding_rows_are_never_accepted():
    drafts = torch.tensor([[ANCHOR, 10, 11, 12, 13]])
    tree = build_tree(drafts, [_proposal(20)], width=5, dflash_len=2)
    assert tree.valid[0].tolist() == [True, True, True, True, False]
    target = _target_tokens(tree, {0: int(tree.tokens[0, 4])})  # the padding row's token
    assert accept(tree, target).accept_lens.tolist() == [0]


def test_a_chain_tree_accepts_as_greedy_chain_acceptance():
    gen = torch.Generator().manual_seed(0)
    drafts = torch.randint(0, 4, (64, 6), generator=gen)
    predict = torch.randint(0, 4, (64, 6), generator=gen)
    tree = build_tree(drafts, [None] * 64, width=6, dflash_len=2)
    got = accept(tree, predict)
    want = acceptance.greedy_accept(drafts, predict)
    assert torch.equal(got.accept_lens, want.accept_lens)
    assert torch.equal(got.bonus, want.bonus)
    chain = acceptance.commit(permute_rows(tree.tokens, got.order), got.accept_lens, got.bonus)
    assert torch.equal(chain.out_tokens, want.out_tokens)


def test_sampling_a_tree_emits_the_targets_own_distribution():
    """One draw per row from the target's distribution at that row's context: the first two
    emitted tokens follow p(x1) p(x2 | x1) exactly (chi-square-free check: within 0.015 of
    the exact probabilities over 40,000 walks)."""
    vocab = 4
    gen = torch.Generator().manual_seed(1)
    first = torch.tensor([0.4, 0.3, 0.2, 0.1])
    second = torch.softmax(torch.randn(vocab, vocab, generator=gen), dim=-1)  # p(x2 | x1)
    drafts = torch.tensor([[ANCHOR, 0, 3, 2]])  # DFlash: 0 then 3
    tree = build_tree(drafts, [_proposal(1, 2)], width=4, dflash_len=1)  # suffix: 1 then 2
    # Rows: anchor, d1=0, s1=1, s2=2 (child of s1). Row contexts: [], [0], [1], [1, 2].
    walks = 40_000
    rows = torch.stack(
        [
            torch.multinomial(first, walks, replacement=True, generator=gen),
            torch.multinomial(second[0], walks, replacement=True, generator=gen),
            torch.multinomial(second[1], walks, replacement=True, generator=gen),
            torch.zeros(walks, dtype=torch.int64),  # row s2's draw: only its depth-3 token
        ],
        dim=1,
    )
    trees = build_tree(drafts.expand(walks, 4), [_proposal(1, 2)] * walks, 4, 1)
    result = accept(trees, rows)
    emitted = acceptance.commit(
        permute_rows(trees.tokens, result.order), result.accept_lens, result.bonus
    ).out_tokens[:, :2]
    counts = Counter(map(tuple, emitted.tolist()))
    for x1 in range(vocab):
        for x2 in range(vocab):
            if x1 in (2, 3):  # the walk stops at the anchor: x2 is not drawn
                continue
            p = float(first[x1] * second[x1, x2])
            assert abs(counts[(x1, x2)] / walks - p) < 0.015, (x1, x2)
    assert tree.width == 4


def test_permute_rows_reorders_each_request():
    order = torch.tensor([[0, 2, 1], [0, 1, 2]])
    flat = torch.arange(6).view(6, 1).float()
    assert permute_rows(flat, order).view(-1).tolist() == [0, 2, 1, 3, 4, 5]
    assert permute_rows(torch.tensor([[5, 6, 7], [8, 9, 10]]), order).tolist() == [
        [5, 7, 6],
        [8, 9, 10],
    ]


def test_bad_widths_are_refused():
    with pytest.raises(ValueError, match="dflash_len"):
        build_tree(torch.zeros(1, 4, dtype=torch.int64), [None], width=4, dflash_len=3)
