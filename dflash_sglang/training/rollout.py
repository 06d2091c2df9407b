"""The target's own greedy continuation from every anchor: on-path labels for slots 2..16.

With `--labels target` on text the target did not write, slot k's label is the target's
argmax after the DATA's tokens at slots 1..k-1. At inference slot k counts only after
slots 1..k-1 were accepted, i.e. after the target's OWN tokens, so that label is right only
while the data agrees with the target (one later-slot label in eight on ShareGPT text;
`--consistent-labels` keeps just those). Rolling the target out from each anchor gives every
slot its inference-time label and distribution instead: `depth - 1` batched target steps per
sequence, all anchors advancing together, one token each, over the sequence's cached prefix
K/V (`rollout_mask`), so no prefix is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_sglang.reference import crop_to
from dflash_sglang.training.features import Example


@dataclass(frozen=True)
class Rollout:
    """The target's greedy path after each of N anchors, D tokens deep."""

    tokens: torch.Tensor  # [N, D] full-vocabulary greedy tokens at anchor + 1 .. anchor + D
    hidden: torch.Tensor  # [N, D, H] the final normed state whose logits chose tokens[:, k]
    stop: torch.Tensor  # [N, D] bool, True where tokens is a stop token (nothing follows it)

    def slots(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block slot: the teacher's state [N*bs, H] (slot k ← hidden[:, k-1]) and
        whether slot k has a path label at all [N*bs] (1 ≤ k ≤ D)."""
        n, depth, width = self.hidden.shape
        if depth >= block_size:
            raise ValueError(f"path depth {depth} must be < block size {block_size}")
        hidden = self.hidden.new_zeros(n, block_size, width)
        hidden[:, 1 : depth + 1] = self.hidden
        has = torch.zeros(n, block_size, dtype=torch.bool)
        has[:, 1 : depth + 1] = True
        return hidden.flatten(0, 1), has.flatten()


def rollout_mask(anchors: torch.Tensor, seq_len: int, step: int) -> torch.Tensor:
    """Keys visible to step `step` (≥ 1) of the rollout, [N, S + N*step] bool.

    Key layout: the S prefix positions, then one block of N rollout tokens per step so far
    (this step's included). Anchor n's token sees the prefix up to its anchor and its own
    rollout tokens, nothing of the other anchors':

        mask[n, j]              = j ≤ anchors[n]          (prefix, j < S)
        mask[n, S + t*N + m]    = (m == n)                (rollout step t + 1)
    """
    prefix = torch.arange(seq_len)[None, :] <= anchors[:, None]
    own = torch.eye(len(anchors), dtype=torch.bool).repeat(1, step)
    return torch.cat([prefix, own], dim=1)


class Roller:
    """Rolls a HF causal LM out from a sequence's anchors; the fp32 head is built once."""

    def __init__(self, target, depth: int, stop_ids: set[int]) -> None:
        if depth < 1:
            raise ValueError(f"rollout depth must be >= 1, got {depth}")
        self.target, self.depth = target, depth
        self.head = target.get_output_embeddings().weight.detach().float()
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long)

    def _choose(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden.float().to(self.head.device) @ self.head.T).argmax(-1).cpu()

    @torch.no_grad()
    def __call__(self, example: Example, anchors: torch.Tensor) -> Rollout:
        """Needs `example.target_cache` (`extract(..., keep_cache=True)`); leaves it as found."""
        cache = example.target_cache
        if cache is None:
            raise ValueError("rollout needs the prefix K/V: extract(..., keep_cache=True)")
        seq_len = len(example.input_ids)
        device = example.final_hidden.device
        hidden = [example.final_hidden[anchors]]  # slot 1's state is the data pass's own
        tokens = [self._choose(hidden[0])]
        try:
            for step in range(1, self.depth):
                mask = rollout_mask(anchors, seq_len, step)
                out = self.target.model(
                    input_ids=tokens[-1][None].to(device),
                    position_ids=(anchors + step)[None].to(device),
                    attention_mask=mask[None, None].to(device),
                    past_key_values=cache,
                    use_cache=True,
                )
                hidden.append(out.last_hidden_state[0])
                tokens.append(self._choose(hidden[-1]))
        finally:
            crop_to(cache, seq_len)
        path_tokens = torch.stack(tokens, dim=1)
        return Rollout(
            tokens=path_tokens,
            hidden=torch.stack(hidden, dim=1),
            stop=torch.isin(path_tokens, self.stop_ids),
        )
