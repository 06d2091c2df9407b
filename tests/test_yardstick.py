"""The slot-1 yardstick learns what the features and token say, and the drafter's slot 1 is
scored on the same positions and labels."""

from __future__ import annotations

import torch

from dflash_sglang.drafter import DFlashDrafter
from dflash_sglang.training import yardstick
from dflash_sglang.training.features import Example
from dflash_sglang.training.train import Head, draft_config_for, new_drafter

V, H = 24, 16


def _examples(n: int, seed: int, head_weight: torch.Tensor) -> list[Example]:
    """The target's choice after token x is (x + 1) mod V: learnable from the embedding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (40,), generator=g)
        out.append(
            Example(
                input_ids=ids,
                prompt_len=8,
                features=torch.randn(40, 2 * H, generator=g),
                final_hidden=head_weight[(ids + 1) % V] * 10,
            )
        )
    return out


def test_yardstick_learns_the_next_token_and_scores_held_out():
    torch.manual_seed(0)
    weight = torch.nn.functional.normalize(torch.randn(V, H), dim=-1)
    head = Head(weight, None)
    embed = torch.nn.Embedding(V, H)
    train, held = _examples(64, 1, weight), _examples(8, 2, weight)
    assert (head.target_choice(held[0].final_hidden) == (held[0].input_ids + 1) % V).all()
    untrained = yardstick.Yardstick(2 * H, H).eval()
    assert yardstick.top1(untrained, held, embed, head) < 0.3
    model = yardstick.fit(
        train, embed, head, epochs=30, batch_rows=256, lr=3e-3, log=lambda m: None
    )
    assert yardstick.top1(model, held, embed, head) > 0.9


def test_drafter_slot1_counts_the_same_positions():
    weight = torch.nn.functional.normalize(torch.randn(V, H), dim=-1)
    head = Head(weight, None)
    embed = torch.nn.Embedding(V, H)
    config = draft_config_for(
        {
            "num_hidden_layers": 4,
            "hidden_size": H,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 32,
            "vocab_size": V,
            "rope_parameters": {"rope_theta": 100000.0},
        },
        num_layers=1,
        block_size=4,
        mask_token_id=0,
        target_layer_ids=[0, 2],
    )
    assert config.rope_theta == 100000.0  # transformers 5 keeps it under rope_parameters
    drafter: DFlashDrafter = new_drafter(config, seed=0).eval()
    held = _examples(3, 3, weight)
    score = yardstick.drafter_slot1(drafter, held, embed, head)
    # By hand: one block per response position, slot 1 against the target's choice there.
    from dflash_sglang.training.train import draft_blocks

    hits = total = 0
    for ex in held:
        for t in range(ex.prompt_len, len(ex.input_ids)):
            _, hidden = draft_blocks(drafter, embed, ex, torch.tensor([t]), gamma=1.0)
            hits += int((hidden[1] @ weight.T).argmax() == (ex.input_ids[t] + 1) % V)
            total += 1
    assert abs(score - hits / total) < 1e-9
