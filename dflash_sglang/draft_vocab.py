"""A restricted draft vocabulary: the drafter proposes only among the target's most frequent
tokens, mapped back to full ids.

On a small target the output layer dominates a draft pass (SmolLM2: 12 of 21 ms are the
49k-row lm_head over 15 slots), and a proposal outside the frequent set is rarely accepted.
The ids live in the drafter's checkpoint as `draft_vocab_ids` with
`dflash_config.draft_vocab_size`; loaders that do not know them (SGLang's upstream DFLASH)
ignore the extra tensor and use the full vocabulary, and drafts without one (every z-lab
checkpoint) run on the full vocabulary here.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from dflash_sglang.acceptance import row_argmax

KEY = "draft_vocab_ids"


def most_frequent(token_lists: Iterable[Iterable[int]], size: int) -> torch.Tensor:
    """The `size` most frequent ids (ties by id), sorted ascending."""
    counts: Counter[int] = Counter()
    for tokens in token_lists:
        counts.update(tokens)
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    return torch.tensor(sorted(t for t, _ in top), dtype=torch.long)


def draft_argmax(
    hidden: torch.Tensor, head_weight: torch.Tensor, vocab_ids: torch.Tensor | None
) -> torch.Tensor:
    """Greedy proposals in full-vocabulary ids, from the full lm_head weight."""
    if vocab_ids is None:
        return head_argmax(hidden, head_weight)
    return select(hidden, head_weight[vocab_ids], vocab_ids)


def select(hidden: torch.Tensor, vocab_head: torch.Tensor, vocab_ids: torch.Tensor):
    """Greedy proposals from the lm_head rows of the draft vocabulary (`vocab_head`)."""
    return vocab_ids[head_argmax(hidden, vocab_head)]


def head_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`argmax(hidden @ weight.T)` over the last dim, as one 2-D GEMM.

    A strided 3-D `hidden` (the worker's `[bs, B, d][:, 1:]`) sends `@` down a batched
    path that on CPU costs 11x the GEMM at 4 requests and 14x at 16 (bf16, 8,192 rows:
    20 ms vs 1.8 ms), most of a plain decoding step there (25.8 ms).
    """
    rows = hidden.reshape(-1, hidden.shape[-1])
    return row_argmax(torch.nn.functional.linear(rows, weight)).view(hidden.shape[:-1])


def prompt_extra(prompt_ids: Sequence[int], vocab_ids: torch.Tensor, cap: int) -> torch.Tensor:
    """The request's own prompt tokens outside the draft vocabulary, at most `cap` (the most
    recently seen first kept): they join its vocabulary for the whole request.

    A restricted vocabulary is frequent tokens over a corpus; what a reply copies from its
    prompt — names, quantities' nouns, identifiers — is rare there. On the held-out math
    set 13% of the target's greedy tokens lie outside the 8,192 ids and 1% outside them
    plus the prompt's (`bench/drafter_vocab.py`).
    """
    if cap <= 0 or not len(prompt_ids):
        return torch.empty(0, dtype=torch.long)
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).flip(0)  # latest occurrence first
    unique, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((len(unique),), len(ids), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(len(ids)), reduce="amin")
    order = unique[first.argsort()]  # most recent first
    outside = order[~torch.isin(order, vocab_ids.to(order.device))]
    return outside[:cap]


def pad_extras(extras: Sequence[torch.Tensor]) -> torch.Tensor:
    """[bs, E] ids, short rows padded with -1 (never proposed)."""
    width = max((len(e) for e in extras), default=0)
    out = torch.full((len(extras), width), -1, dtype=torch.long)
    for row, extra in zip(out, extras, strict=True):
        row[: len(extra)] = extra
    return out


def select_extended(
    hidden: torch.Tensor,
    vocab_head: torch.Tensor,
    vocab_ids: torch.Tensor,
    head_weight: torch.Tensor,
    extra_ids: torch.Tensor,
) -> torch.Tensor:
    """Greedy proposals [bs, k] over the draft vocabulary plus each request's own extra ids.

    hidden [bs, k, d]; extra_ids [bs, E] (`pad_extras`). The argmax over the union is the
    static argmax unless an extra row scores strictly higher:

        best = argmax_{v ∈ V ∪ E_b} h·w_v
    """
    static = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]), vocab_head)
    top, local = static.max(-1)
    top, proposals = top.view(hidden.shape[:-1]), vocab_ids[local].view(hidden.shape[:-1])
    if extra_ids.shape[1] == 0:
        return proposals
    extra_ids = extra_ids.to(head_weight.device)
    extra_rows = head_weight[extra_ids.clamp(min=0)]  # [bs, E, d]
    scores = torch.bmm(hidden.to(extra_rows.dtype), extra_rows.transpose(1, 2))  # [bs, k, E]
    scores = scores.masked_fill((extra_ids < 0)[:, None, :], float("-inf"))
    extra_top, pick = scores.max(-1)
    wins = extra_top > top.to(extra_top.dtype)
    return torch.where(wins, torch.gather(extra_ids, 1, pick), proposals)


def load_ids(draft_dir: str | Path) -> torch.Tensor | None:
    """The checkpoint's draft vocabulary, or None when it has none."""
    draft_dir = Path(draft_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    if not (config.get("dflash_config") or {}).get("draft_vocab_size"):
        return None
    from safetensors import safe_open

    for file in sorted(draft_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if KEY in f.keys():  # noqa: SIM118 - safe_open is not a dict
                return f.get_tensor(KEY).long()
    raise ValueError(f"{draft_dir}: config sets draft_vocab_size but no {KEY} tensor exists")


def write_full_vocabulary_copy(draft_dir: str | Path, out_dir: str | Path) -> Path:
    """A copy of the drafter without its restricted vocabulary, for loaders that reject an
    unknown tensor (vLLM): the same weights, proposing over the full vocabulary."""
    from safetensors.torch import load_file, save_file

    draft_dir, out_dir = Path(draft_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((draft_dir / "config.json").read_text())
    (config.get("dflash_config") or {}).pop("draft_vocab_size", None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    for file in sorted(draft_dir.glob("*.safetensors")):
        tensors = {k: v for k, v in load_file(str(file)).items() if k != KEY}
        save_file(tensors, str(out_dir / file.name), metadata={"format": "pt"})
    return out_dir


class InGraphHead:
    """Greedy proposals over the draft vocabulary into a static buffer.

    SGLang folds a draft head into the draft CUDA graph only for the full vocabulary; this
    one has the same call shape (hidden states of whole blocks in, `out[: bs*(B-1)]` out),
    so the restricted head is captured too instead of running eagerly after every replay.
    """

    def __init__(
        self, head_rows: torch.Tensor, vocab_ids: torch.Tensor, block_size: int, max_bs: int
    ) -> None:
        self.head_rows, self.vocab_ids, self.block_size = head_rows, vocab_ids, block_size
        self.out = torch.empty(
            max_bs * (block_size - 1), dtype=torch.int64, device=head_rows.device
        )

    def __call__(self, hidden_states: torch.Tensor, input_ids=None) -> None:
        width = hidden_states.shape[-1]
        blocks = hidden_states.view(-1, self.block_size, width)[:, 1:, :].reshape(-1, width)
        proposals = select(blocks.to(self.head_rows.dtype), self.head_rows, self.vocab_ids)
        self.out[: proposals.numel()].copy_(proposals)
