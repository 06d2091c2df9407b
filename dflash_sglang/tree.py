"""Two-branch verify trees: the DFlash block and a suffix proposal verified in one pass.

A chain verifies one proposal per request; when a request has both a DFlash block and a
suffix proposal, a tree verifies both and keeps whichever the target follows further.
Layout of request r's `w` rows (row 0 the anchor, rows in topological order):

    anchor | d_1 .. d_a (DFlash, a chain under the anchor) | s_{c+1} .. s_{c+b} | padding

where c = the length of the suffix proposal's common prefix with d_1..d_a (shared nodes
are verified once, so siblings always carry different tokens), s_{c+1} hangs off d_c (the
anchor when c = 0), and padding rows are never accepted. Requests without a suffix proposal
fill all `w - 1` rows with their DFlash chain, as a chain step would.

Acceptance walks the tree as the target would decode (`accept`): at each accepted node the
target's token (argmax, or one draw from its distribution when sampling) either equals a
child's token, and the walk moves there, or becomes the bonus token. Every node on the walk
is drawn once, so emitted tokens are distributed exactly as the target's own samples; with
distinct siblings at most one child matches, so the accepted nodes form one path.

`chain_order` then puts that path first, in depth order: permuting the step's rows (tokens,
KV slots, hidden states, logits) by it turns the accepted path into the chain prefix every
later stage (commit, KV injection, logprobs) already handles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_sglang.suffix import SuffixProposal


@dataclass(frozen=True)
class VerifyTree:
    """Rows of one tree step, `[bs, w]` each (row 0 the anchor)."""

    tokens: torch.Tensor  # int64
    parents: torch.Tensor  # int64, parent row; 0 for the anchor itself and for padding
    depths: torch.Tensor  # int64, position offset after the committed prefix
    valid: torch.Tensor  # bool, False for padding rows (never accepted)
    on_dflash: torch.Tensor  # bool, row lies on the DFlash chain (anchor excluded)
    on_suffix: torch.Tensor  # bool, on the path to the suffix leaf (shared prefix included)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def ancestors(self) -> torch.Tensor:
        """`[bs, w, w]` bool: row j is row i itself or one of its ancestors (what i attends
        to inside the block)."""
        bs, w = self.tokens.shape
        eye = torch.eye(w, dtype=torch.bool, device=self.tokens.device)
        anc = eye.expand(bs, w, w).clone()
        for j in range(1, w):  # parents precede children: row j's parent row is final
            parent = self.parents[:, j].view(bs, 1, 1).expand(bs, 1, w)
            anc[:, j : j + 1] |= anc.gather(1, parent) & self.valid[:, j].view(bs, 1, 1)
        return anc


def custom_mask(tree: VerifyTree, prefix_lens: torch.Tensor) -> torch.Tensor:
    """The tree as SGLang's flat verify allow-mask (its EAGLE convention, which FlashInfer's
    custom-mask prefill reads on GPU): request r contributes `w` rows of `p_r + w` columns,
    row-major, requests concatenated, `p_r = prefix_lens[r]` its committed length (the
    verify's `seq_lens`); every committed column is allowed, block column j where j is the
    row itself or one of its ancestors. One scatter, no host sync given host `prefix_lens`.

    Request r starts at `w * (sum_{q<r} p_q + r * w)`; its row i, block column j lies at
    `start_r + i * (p_r + w) + p_r + j`.
    """
    anc = tree.ancestors()
    bs, w = tree.tokens.shape
    device = anc.device
    p = prefix_lens.to(device=device, dtype=torch.int64)
    starts = w * (torch.cumsum(p, 0) - p + torch.arange(bs, device=device) * w)
    i = torch.arange(w, device=device)
    index = (
        starts.view(bs, 1, 1)
        + (i.view(1, w, 1) * (p + w).view(bs, 1, 1))
        + p.view(bs, 1, 1)
        + i.view(1, 1, w)
    )
    total = w * int(prefix_lens.sum()) + bs * w * w
    mask = torch.ones(total, dtype=torch.bool, device=device)
    return mask.index_put_((index.view(-1),), anc.reshape(-1))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def build_tree(
    drafts: torch.Tensor,
    suffix: Sequence[SuffixProposal | None],
    width: int,
    dflash_len: int,
) -> VerifyTree:
    """The tree rows of a step that drafted `drafts` (`[bs, n]`: anchor + DFlash proposals,
    n >= width) and took `suffix[r]` beside request r's first `dflash_len` DFlash tokens.

    Built on the host (w <= 16 rows a request; on GPU one copy each way per tree step).
    """
    bs, n = drafts.shape
    if not 1 <= dflash_len < width - 1 or width > n:
        raise ValueError(
            f"need 1 <= dflash_len < width - 1 and width <= {n}, got {dflash_len}, {width}"
        )
    rows = drafts[:, :width].tolist()
    parents = [list(range(-1, width - 1)) for _ in range(bs)]
    depths = [list(range(width)) for _ in range(bs)]
    valid = [[True] * width for _ in range(bs)]
    on_dflash = [[0 < j for j in range(width)] for _ in range(bs)]
    on_suffix = [[False] * width for _ in range(bs)]
    for r, proposal in enumerate(suffix):
        if proposal is None:
            continue
        d = rows[r][1 : 1 + dflash_len]
        c = _common_prefix(d, proposal.tokens)
        branch = proposal.tokens[c : c + width - 1 - dflash_len]
        start = 1 + dflash_len
        for j in range(1, 1 + c):
            on_suffix[r][j] = True
        for i, token in enumerate(branch):
            row = start + i
            rows[r][row] = token
            parents[r][row] = c if i == 0 else row - 1
            depths[r][row] = c + 1 + i
            on_dflash[r][row], on_suffix[r][row] = False, True
        for row in range(start + len(branch), width):
            parents[r][row], depths[r][row], valid[r][row] = 0, 1, False
            on_dflash[r][row] = False
    device = drafts.device
    parents_t = torch.tensor(parents, dtype=torch.int64).clamp_min_(0)
    return VerifyTree(
        tokens=torch.tensor(rows, dtype=torch.int64).to(device),
        parents=parents_t.to(device),
        depths=torch.tensor(depths, dtype=torch.int64).to(device),
        valid=torch.tensor(valid, dtype=torch.bool).to(device),
        on_dflash=torch.tensor(on_dflash, dtype=torch.bool).to(device),
        on_suffix=torch.tensor(on_suffix, dtype=torch.bool).to(device),
    )


@dataclass(frozen=True)
class TreeAcceptance:
    accept_lens: torch.Tensor  # [bs] int32, depth of the deepest accepted node
    bonus: torch.Tensor  # [bs] int64, the target's token at that node
    order: torch.Tensor  # [bs, w] int64, accepted path in depth order, then the other rows
    dflash_accepted: torch.Tensor  # [bs] int32, accepted rows on the DFlash chain
    suffix_accepted: torch.Tensor  # [bs] int32, accepted rows on the suffix path
    dflash_offered: torch.Tensor  # [bs] int32, rows on the DFlash chain
    suffix_offered: torch.Tensor  # [bs] int32, rows on the suffix path

    def branches(self) -> list[tuple[int, int, int, int]]:
        """Per request (DFlash accepted, offered, suffix accepted, offered), on the host."""
        columns = (self.dflash_accepted, self.dflash_offered)
        columns += (self.suffix_accepted, self.suffix_offered)
        return list(zip(*(c.tolist() for c in columns), strict=True))


def accept(tree: VerifyTree, target_tokens: torch.Tensor) -> TreeAcceptance:
    """Walk `tree` with the target's token at every row (`[bs, w]`: argmax, or one sample
    per row from its distribution); see the module docstring for why that is exact."""
    bs, w = tree.tokens.shape
    from_parent = target_tokens.gather(1, tree.parents)
    matched = tree.valid & (tree.tokens == from_parent)
    accepted = torch.zeros(bs, w, dtype=torch.bool, device=tree.tokens.device)
    accepted[:, 0] = True
    for j in range(1, w):
        accepted[:, j] = matched[:, j] & accepted.gather(1, tree.parents[:, j : j + 1]).squeeze(1)
    depth = torch.where(accepted, tree.depths, torch.full_like(tree.depths, -1))
    deepest = depth.argmax(dim=1, keepdim=True)
    columns = torch.arange(w, device=tree.tokens.device).expand(bs, w)
    order = torch.where(accepted, tree.depths, w + columns).argsort(dim=1)
    return TreeAcceptance(
        accept_lens=depth.gather(1, deepest).squeeze(1).to(torch.int32),
        bonus=target_tokens.gather(1, deepest).squeeze(1).to(torch.int64),
        order=order,
        dflash_accepted=(accepted & tree.on_dflash).sum(1, dtype=torch.int32),
        suffix_accepted=(accepted & tree.on_suffix).sum(1, dtype=torch.int32),
        dflash_offered=tree.on_dflash.sum(1, dtype=torch.int32),
        suffix_offered=tree.on_suffix.sum(1, dtype=torch.int32),
    )


def permute_rows(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`rows` (`[bs * w, ...]` or `[bs, w]`) reordered per request by `order` (`[bs, w]`)."""
    bs, w = order.shape
    if rows.dim() == 2 and rows.shape == order.shape:
        return rows.gather(1, order)
    flat = (order + torch.arange(bs, device=order.device).view(-1, 1) * w).view(-1)
    return rows.index_select(0, flat)
