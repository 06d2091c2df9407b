"""Target features computed once and cached: every epoch reuses them instead of re-running
the target (on a CPU the target forward would cost more than the drafter's training step).

Per sample we keep the concatenated outputs of `target_layer_ids` (HF `hidden_states[l+1]`)
and the target's final normed hidden state, from which its logits (for distillation) are
one matmul with the frozen lm_head away. Shards are safetensors files, written atomically,
so an interrupted run resumes at the first missing shard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_sglang.reference import target_features

SHARD = 64  # samples per shard file


@dataclass(frozen=True)
class Example:
    input_ids: torch.Tensor  # [S] prompt + response
    prompt_len: int
    features: torch.Tensor  # [S, K*H] target layer outputs
    final_hidden: torch.Tensor  # [S, H] target's last normed hidden state
    target_cache: object | None = None  # the target's K/V over input_ids (for rollouts)

    def loss_mask(self) -> torch.Tensor:
        """1 on response tokens: the only positions that anchor blocks or carry loss."""
        mask = torch.zeros(len(self.input_ids))
        mask[self.prompt_len :] = 1
        return mask


def _shard_path(root: Path, index: int) -> Path:
    return root / f"shard_{index:05d}.safetensors"


@torch.no_grad()
def extract(
    target, sample: dict, layer_ids: list[int], max_len: int, keep_cache: bool = False
) -> Example:
    """One target pass over prompt + response (at most `max_len` tokens); `keep_cache`
    keeps its K/V so the target can be rolled out from anchors (`rollout.Roller`)."""
    device = target.device
    ids = torch.tensor((sample["prompt_ids"] + sample["response_ids"])[:max_len])
    # The base model: no logits over the vocabulary for every position (a fifth of
    # SmolLM2's compute); they are one matmul away from `final_hidden` when needed.
    out = target.model(
        input_ids=ids[None].to(device), output_hidden_states=True, use_cache=keep_cache
    )
    return Example(
        input_ids=ids,
        prompt_len=len(sample["prompt_ids"]),
        features=target_features(out.hidden_states, layer_ids)[0],
        final_hidden=out.last_hidden_state[0],
        target_cache=out.past_key_values if keep_cache else None,
    )


class OnlineExamples(Sequence):
    """Features computed when a batch needs them: the recipe for large targets on GPUs,
    whose cached features would not fit on disk (Qwen3-8B: 40 KB per token)."""

    def __init__(
        self,
        target,
        samples: list[dict],
        layer_ids: list[int],
        max_len: int,
        keep_cache: bool = False,
    ) -> None:
        self.target, self.samples, self.layer_ids = target, samples, layer_ids
        self.max_len, self.keep_cache = max_len, keep_cache

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Example:
        return extract(self.target, self.samples[i], self.layer_ids, self.max_len, self.keep_cache)


@torch.no_grad()
def compute(
    target,
    samples: list[dict],
    layer_ids: list[int],
    root: Path,
    *,
    max_len: int,
    dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[int], None] = lambda n: None,
) -> int:
    """Write missing shards for `samples` (JSONL rows from `data.regenerate`)."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "meta.json").write_text(
        json.dumps({"target_layer_ids": layer_ids, "samples": len(samples), "max_len": max_len})
    )
    written = 0
    for index, start in enumerate(range(0, len(samples), SHARD)):
        path = _shard_path(root, index)
        chunk = samples[start : start + SHARD]
        if _shard_size(path) == len(chunk):  # a short last shard is redone as data grows
            progress(len(chunk))
            continue
        tensors: dict[str, torch.Tensor] = {}
        for i, sample in enumerate(chunk):
            example = extract(target, sample, layer_ids, max_len)
            tensors[f"{i}.input_ids"] = example.input_ids.to(torch.int32)
            tensors[f"{i}.prompt_len"] = torch.tensor([example.prompt_len], dtype=torch.int32)
            tensors[f"{i}.features"] = example.features.to(dtype)
            tensors[f"{i}.final_hidden"] = example.final_hidden.to(dtype)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
        written += 1
        progress(len(chunk))
    return written


def _shard_size(path: Path) -> int:
    if not path.exists():
        return 0
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return len({k.split(".")[0] for k in f.keys()})  # noqa: SIM118 - not a dict


def check_layers(root: Path, layer_ids: list[int]) -> None:
    meta = json.loads((root / "meta.json").read_text())
    if list(meta["target_layer_ids"]) != list(layer_ids):
        raise ValueError(
            f"features in {root} tap target layers {meta['target_layer_ids']}, the drafter "
            f"needs {layer_ids}: recompute them (--features-dir elsewhere)"
        )


def load(root: Path) -> list[Example]:
    """Every cached example, in memory (SmolLM2, 5 taps: about 7 KB per token in bf16)."""
    from safetensors import safe_open

    examples = []
    for path in sorted(root.glob("shard_*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for i in range(_shard_size(path)):
                examples.append(
                    Example(
                        input_ids=f.get_tensor(f"{i}.input_ids").long(),
                        prompt_len=int(f.get_tensor(f"{i}.prompt_len")[0]),
                        features=f.get_tensor(f"{i}.features"),
                        final_hidden=f.get_tensor(f"{i}.final_hidden"),
                    )
                )
    return examples


def batch_indices(count: int, batch: int, generator: torch.Generator) -> list[list[int]]:
    """One epoch of shuffled batches, as indices (examples are only touched when used)."""
    order = torch.randperm(count, generator=generator).tolist()
    return [order[i : i + batch] for i in range(0, count, batch)]
