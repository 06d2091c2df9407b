"""Draft checkpoints (z-lab DFlash format) and their compatibility with a target.

A draft directory holds `config.json` (`architectures: ["DFlashDraftModel"]`, `block_size`,
`dflash_config.{mask_token_id,target_layer_ids}`, `num_target_layers`) and safetensors with
`layers.{i}.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight` (no embedding or lm_head:
the draft borrows the target's). Mismatches are caught here, before any process is spawned,
with a message that names the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_sglang.options import DEFAULT_BLOCK_SIZE

DRAFT_ARCHITECTURES = frozenset({"DFlashDraftModel"})


class CheckpointError(ValueError):
    """A model directory is missing, unreadable, or does not fit its partner."""


@dataclass(frozen=True)
class DraftInfo:
    block_size: int | None
    mask_token_id: int | None
    target_layer_ids: list[int]
    num_layers: int


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def read_config(model_path: str, role: str) -> dict[str, Any]:
    """`config.json` of a local model directory (or, for a hub id, what transformers resolves)."""
    path = Path(model_path)
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{role} model directory {path} has no config.json")
        try:
            return json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{role} config {config_file} is not valid JSON: {e}") from e
    if path.exists() or model_path.startswith((".", "/", "~")):
        raise CheckpointError(f"{role} model path {model_path} is not a directory")
    from transformers import AutoConfig  # a hub id: only resolvable where the hub is reachable

    try:
        return AutoConfig.from_pretrained(model_path).to_dict()
    except Exception as e:  # noqa: BLE001 - any resolution failure is the same user error
        raise CheckpointError(f"{role} model {model_path!r} cannot be resolved: {e}") from e


def rope_theta_of(config: dict[str, Any]) -> float:
    """The RoPE base of a HF config: transformers 5 writes it under `rope_parameters`, older
    configs at the top level (a drafter copying target layers must rotate like the target)."""
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)


def _require_weights(model_path: str, role: str) -> None:
    path = Path(model_path)
    if path.is_dir() and not any(path.glob("*.safetensors")):
        raise CheckpointError(f"{role} model directory {path} has no *.safetensors weights")


def check_pair(target_path: str, draft_path: str) -> DraftInfo:
    """Validate a draft against its target; return what the server needs from the draft."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    target = _text_config(read_config(target_path, "target"))
    draft_config = read_config(draft_path, "draft")
    _require_weights(target_path, "target")
    _require_weights(draft_path, "draft")
    draft = _text_config(draft_config)

    archs = set(draft_config.get("architectures") or [])
    if not archs & DRAFT_ARCHITECTURES:
        raise CheckpointError(
            f"draft {draft_path} has architectures {sorted(archs)}; DFLASH_X serves "
            f"{sorted(DRAFT_ARCHITECTURES)} checkpoints"
        )
    if draft.get("hidden_size") != target.get("hidden_size"):
        raise CheckpointError(
            f"hidden size mismatch: draft hidden_size={draft.get('hidden_size')} but target "
            f"hidden_size={target.get('hidden_size')} (the draft consumes target embeddings "
            "and feeds the target lm_head)"
        )
    target_vocab = int(target["vocab_size"])
    if draft.get("vocab_size") is not None and int(draft["vocab_size"]) != target_vocab:
        raise CheckpointError(
            f"vocab mismatch: draft vocab_size={draft['vocab_size']} but target "
            f"vocab_size={target_vocab}"
        )
    try:
        parsed = parse_dflash_draft_config(draft_hf_config=draft_config)
        layer_ids = parsed.resolve_target_layer_ids(
            target_num_layers=int(target["num_hidden_layers"])
        )
    except ValueError as e:
        raise CheckpointError(f"draft {draft_path}: {e}") from e
    if parsed.num_target_layers is not None and parsed.num_target_layers != int(
        target["num_hidden_layers"]
    ):
        raise CheckpointError(
            f"draft {draft_path} was built for num_target_layers={parsed.num_target_layers} "
            f"but the target has num_hidden_layers={target['num_hidden_layers']}"
        )
    mask_id = parsed.mask_token_id
    if mask_id is not None and not 0 <= mask_id < target_vocab:
        raise CheckpointError(
            f"mask_token_id={mask_id} is outside the target vocabulary [0, {target_vocab})"
        )
    if parsed.block_size is not None and parsed.block_size < 2:
        raise CheckpointError(f"draft block_size={parsed.block_size} must be at least 2")
    return DraftInfo(
        block_size=parsed.block_size,
        mask_token_id=mask_id,
        target_layer_ids=layer_ids,
        num_layers=parsed.require_num_layers(),
    )


def write_random_draft(
    target_path: str | Path,
    out: str | Path,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_layers: int = 5,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    head_dim: int = 64,
    intermediate_size: int | None = None,
    seed: int = 0,
) -> Path:
    """A randomly initialised draft for `target` in z-lab format (benchmarks, tests).

    Random drafts accept nothing beyond chance; they measure the cost of speculation.
    """
    import torch
    from sglang.srt.speculative.dflash_utils import build_target_layer_ids

    from dflash_sglang.drafter import DFlashDrafter, DraftConfig

    target = _text_config(read_config(str(target_path), "target"))
    hidden, n_target = int(target["hidden_size"]), int(target["num_hidden_layers"])
    head_dim = min(head_dim, hidden)
    heads = max(1, hidden // head_dim)
    config = DraftConfig(
        hidden_size=hidden,
        intermediate_size=intermediate_size or 2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=next(
            k for k in (heads // 3, heads // 2, 1) if k >= 1 and heads % k == 0
        ),
        head_dim=head_dim,
        vocab_size=int(target["vocab_size"]),
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(target_layer_ids or build_target_layer_ids(n_target, num_layers)),
        num_target_layers=n_target,
        rope_theta=rope_theta_of(target),
        max_position_embeddings=int(target.get("max_position_embeddings", 4096)),
    )
    drafter = DFlashDrafter(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in drafter.parameters():
            if weight.dim() == 2:  # projections; the RMSNorm gains keep their ones
                weight.copy_(torch.randn(weight.shape, generator=gen) * 0.05)
    return drafter.save(out)
