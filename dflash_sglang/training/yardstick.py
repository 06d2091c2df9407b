"""The slot-1 yardstick: the cheapest next-token head trained on the drafter's own features.

Slot 1 of a block anchored at t sees the target's features before t and the token x_t, and
must name the target's next token after x_t. An EAGLE-style head, one layer, given exactly
that (fused features at t-1, embedding of x_t) shows what slot 1 can reasonably reach from
these features and this much data: a drafter far below it misuses its context.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dflash_sglang.training.features import Example


class Yardstick(nn.Module):
    """fc + norm over the tapped features (as the drafter fuses them), concatenated with the
    token embedding, one residual MLP block, final norm; the target's frozen head on top."""

    def __init__(self, feature_width: int, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.fc = nn.Linear(feature_width, hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
        self.inp = nn.Linear(2 * hidden, hidden, bias=False)
        self.mlp = nn.Sequential(
            nn.RMSNorm(hidden, eps=eps),
            nn.Linear(hidden, 3 * hidden, bias=False),
            nn.SiLU(),
            nn.Linear(3 * hidden, hidden, bias=False),
        )
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """features [N, K*H] at t-1, token_embeds [N, H] of x_t -> normed hidden [N, H]."""
        h = self.inp(torch.cat([self.hidden_norm(self.fc(features)), token_embeds], -1))
        return self.norm(h + self.mlp(h))


def rows(
    examples: Sequence[Example], embed: nn.Embedding, head
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features at t-1, embedding of x_t, local label) for every response position t.

    The label is the target's own choice at t within the head's vocabulary (what
    `--labels target` trains the drafter on), the token slot 1 must match when served.
    """
    feats, embeds, labels = [], [], []
    with torch.no_grad():
        for ex in examples:
            t = torch.arange(max(ex.prompt_len, 1), len(ex.input_ids))
            feats.append(ex.features[t - 1])
            embeds.append(embed(ex.input_ids[t]).float())
            labels.append(head.target_choice(ex.final_hidden[t]))
    return torch.cat(feats), torch.cat(embeds), torch.cat(labels)


def fit(
    train: Sequence[Example],
    embed: nn.Embedding,
    head,
    *,
    epochs: int = 3,
    batch_rows: int = 1024,
    lr: float = 1e-3,
    seed: int = 0,
    log=print,
) -> Yardstick:
    """AdamW over shuffled response positions (the same recipe for every feature set)."""
    torch.manual_seed(seed)
    x, e, y = rows(train, embed, head)
    model = Yardstick(x.shape[1], e.shape[1])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    started = time.monotonic()
    for epoch in range(epochs):
        order = torch.randperm(len(y))
        for i in range(0, len(y), batch_rows):
            b = order[i : i + batch_rows]
            logits = model(x[b].float(), e[b]) @ head.weight.T
            loss = F.cross_entropy(logits, y[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        log(
            f"yardstick epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}, "
            f"{len(y)} positions, {time.monotonic() - started:.0f}s"
        )
    return model.eval()


@torch.no_grad()
def top1(model: Yardstick, examples: Sequence[Example], embed: nn.Embedding, head) -> float:
    """Held-out top-1 against the target's choice at every response position."""
    x, e, y = rows(examples, embed, head)
    hits = 0
    for i in range(0, len(y), 4096):
        pred = (model(x[i : i + 4096].float(), e[i : i + 4096]) @ head.weight.T).argmax(-1)
        hits += int((pred == y[i : i + 4096]).sum())
    return hits / max(1, len(y))


@torch.no_grad()
def drafter_slot1(drafter, examples: Sequence[Example], embed: nn.Embedding, head) -> float:
    """The drafter's slot 1, teacher-forced, on the positions and labels `top1` uses: a block
    anchored at every response position t, slot 1 against the target's choice at t."""
    from dflash_sglang.training.train import draft_blocks

    hits = total = 0
    for ex in examples:
        positions = torch.arange(max(ex.prompt_len, 1), len(ex.input_ids))
        labels = head.target_choice(ex.final_hidden[positions])
        for i in range(0, len(positions), 64):
            anchors = positions[i : i + 64]
            _, hidden = draft_blocks(drafter, embed, ex, anchors, gamma=1.0)
            slot1 = hidden.view(len(anchors), -1, hidden.shape[-1])[:, 1]
            hits += int(((slot1 @ head.weight.T).argmax(-1) == labels[i : i + 64]).sum())
            total += len(anchors)
    return hits / max(1, total)
