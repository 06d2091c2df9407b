"""The batch-1 DFlash decode loop with z-lab semantics: the oracle for losslessness and τ.

Block = [last committed token, MASK...]; the drafter's argmax fills the masks; the target
verifies the whole block in one pass; the longest matching prefix plus the target's bonus
token is committed; the target KV cache is cropped and the committed positions' features
join the draft context. The draft context is recomputed from all committed features each
step, which equals z-lab's cached draft K/V exactly (context K/V never depend on the block).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_sglang.acceptance import accepted_prefix_len
from dflash_sglang.draft_vocab import draft_argmax, prompt_extra, select_extended
from dflash_sglang.drafter import DFlashDrafter
from dflash_sglang.options import DEFAULT_PROMPT_VOCAB


@dataclass
class Generation:
    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)  # accepted drafts + 1, per step

    @property
    def tau(self) -> float | None:
        steps = self.acceptance_lengths
        return sum(steps) / len(steps) if steps else None


def target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids) -> torch.Tensor:
    """Outputs of target layers `layer_ids`: HF's `hidden_states[l + 1]` (0 is the embedding)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def crop_to(cache, length: int) -> None:
    """Drop a HF cache's positions from `length` on, passed as a (negative) count to remove:
    the absolute `crop(length)` is deprecated in transformers 5 and warns on every run."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None):
    """Target tokens for each position: argmax, or one exact sample per position."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=generator).view(
        probs.shape[:-1]
    )


class ReferenceDecoder:
    """`target` is a HF causal LM; `drafter` borrows its embedding and lm_head.
    `prompt_vocab` > 0: a restricted draft vocabulary also takes up to that many of the
    prompt's own tokens (`draft_vocab.prompt_extra`), as DFLASH_X's `--dflash-prompt-vocab`
    (default: the server's)."""

    def __init__(
        self, target, drafter: DFlashDrafter, prompt_vocab: int = DEFAULT_PROMPT_VOCAB
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.prompt_vocab = prompt_vocab
        self.config = drafter.config
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()

    def _target(self, ids: torch.Tensor, positions: torch.Tensor, cache):
        out = self.target(
            input_ids=ids[None],
            position_ids=positions[None],
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        return out.logits[0], target_features(out.hidden_states, self.config.target_layer_ids)[0]

    def _draft(
        self, block: torch.Tensor, context: torch.Tensor, start: int, extra: torch.Tensor
    ) -> torch.Tensor:
        """Greedy proposals for block slots 1.. (draft proposals are always argmax)."""
        bs = len(block)
        positions = torch.arange(start + bs)[None]
        hidden = self.drafter(self.embed(block)[None], context[None], positions)
        ids, weight = self.drafter.draft_vocab_ids, self.lm_head.weight
        if ids is None or not len(extra):
            return draft_argmax(hidden[0, 1:], weight, ids)
        return select_extended(hidden[:, 1:], weight[ids], ids, weight, extra[None])[0]

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        stop_ids: tuple[int, ...] = (),
        block_size: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Generation:
        from transformers import DynamicCache

        bs = block_size or self.config.block_size
        mask_id = self.config.mask_token_id
        cache = DynamicCache()
        prompt = torch.tensor(prompt_ids)
        ids = self.drafter.draft_vocab_ids
        extra = prompt_extra(prompt_ids, ids, self.prompt_vocab) if ids is not None else prompt[:0]
        logits, context = self._target(prompt, torch.arange(len(prompt)), cache)
        out = [int(choose(logits[-1], temperature, generator))]
        gen = Generation(tokens=out)
        start = len(prompt)
        while len(out) < max_new_tokens and out[-1] not in stop_ids:
            block = torch.full((bs,), mask_id)
            block[0] = out[-1]
            block[1:] = self._draft(block, context, start, extra)
            logits, features = self._target(block, torch.arange(start, start + bs), cache)
            post = choose(logits, temperature, generator)
            acc = int(accepted_prefix_len((block[1:] == post[:-1])[None])[0])
            out += [*block[1 : acc + 1].tolist(), int(post[acc])]
            gen.acceptance_lengths.append(acc + 1)
            start += acc + 1
            crop_to(cache, start)
            context = torch.cat([context, features[: acc + 1]])
        gen.tokens = _truncate(out, max_new_tokens, stop_ids)
        return gen


def _truncate(tokens: list[int], limit: int, stop_ids: tuple[int, ...]) -> list[int]:
    tokens = tokens[:limit]
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens
