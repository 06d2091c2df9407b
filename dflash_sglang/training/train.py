"""The training loop: random anchors over response tokens, weighted same-position CE.

One code path for CPU and GPU (`device`, bf16 autocast). Deterministic from `seed`: the
epoch order and each step's anchors derive from (seed, epoch/step), so a resumed run makes
the same batches it would have made without the interruption.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash_sglang.drafter import DFlashDrafter, DraftConfig
from dflash_sglang.training import features as feature_cache
from dflash_sglang.training.blocks import (
    Blocks,
    build_blocks,
    consistent_slots,
    default_gamma,
    sample_anchors,
)
from dflash_sglang.training.rollout import Rollout


@dataclass
class TrainConfig:
    source: str  # cached features dir, or data JSONL when features are computed online
    out_dir: str
    epochs: float = 6.0
    batch_size: int = 4  # sequences per optimizer step
    num_anchors: int = 32  # blocks per sequence per step
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None  # loss decay; None = the paper's value for the block size
    distill: float = 0.0  # weight of KL to the target's distribution (0 = hard labels only)
    labels: str = "text"  # "text": the data's tokens; "target": the target's own argmax;
    # "rollout": the target's own greedy path from each anchor (needs a `roller`)
    rollout_depth: int = 15  # with labels="rollout": path tokens per anchor (< block size)
    consistent: bool = False  # with labels="target": drop slots after the data leaves the target
    seed: int = 0
    device: str = "cpu"
    bf16: bool = True
    save_every: int = 100
    max_steps: int | None = None  # stop early (the schedule still spans all epochs)


class Head:
    """The target's frozen lm_head, optionally restricted to the drafter's vocabulary."""

    def __init__(
        self, weight: torch.Tensor, vocab_ids: torch.Tensor | None, device: str = "cpu"
    ) -> None:
        vocab_ids = None if vocab_ids is None else vocab_ids.cpu()
        self.vocab_ids = vocab_ids  # row index -> full id (None: the full vocabulary)
        self.weight = (weight if vocab_ids is None else weight[vocab_ids.to(weight.device)]).to(
            device
        )
        self._lookup = None  # labels stay on the CPU, where blocks are built
        if vocab_ids is not None:
            self._lookup = torch.full((weight.shape[0],), -1, dtype=torch.long)
            self._lookup[vocab_ids] = torch.arange(len(vocab_ids))

    def target_logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits over this vocabulary, exact fp32 (argmax and KL targets)."""
        with torch.autocast(self.weight.device.type, enabled=False):
            return final_hidden.to(self.weight.device, torch.float32) @ self.weight.T

    def target_choice(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The target's greedy token within this vocabulary (row index)."""
        return self.target_logits(final_hidden).argmax(-1)

    def to_local(self, labels: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary labels -> row indices; ids outside the draft vocabulary -> -1."""
        return labels if self._lookup is None else self._lookup[labels]


def cosine_lr(step: int, total: int, warmup: int) -> float:
    """Multiplier: linear warmup, then cosine to zero."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def draft_blocks(
    drafter: DFlashDrafter,
    embed: torch.nn.Embedding,
    example: feature_cache.Example,
    anchors: torch.Tensor,
    gamma: float,
    device: torch.device | str = "cpu",
) -> tuple[Blocks, torch.Tensor]:
    """One sequence's blocks at `anchors` and the drafter's normed hidden state per slot."""
    c = drafter.config
    blocks = build_blocks(
        example.input_ids,
        example.loss_mask(),
        anchors,
        block_size=c.block_size,
        mask_token_id=c.mask_token_id,
        gamma=gamma,
    )
    hidden = drafter(
        embed(blocks.input_ids.to(device)).float()[None],
        example.features.to(device, torch.float32)[None],
        blocks.position_ids.to(device)[None],
        blocks.attention_mask.to(device)[None, None],
    )[0]
    return blocks, hidden


def block_loss(
    drafter: DFlashDrafter,
    embed: torch.nn.Embedding,
    head: Head,
    example: feature_cache.Example,
    anchors: torch.Tensor,
    gamma: float,
    distill: float,
    target_labels: bool = False,
    consistent: bool = False,
    rollout: Rollout | None = None,
) -> tuple[torch.Tensor, dict]:
    """Weighted CE (and optional KL to the target) of one sequence's blocks.

    With `target_labels` the CE label of each slot is the target's own argmax (within the
    draft vocabulary) instead of the data's token: on greedy regenerated data the two agree
    up to numerics; on text the target did not write, only the target's choice is right.
    `consistent` (with `target_labels`) also drops every slot after the first where the
    data's token differs from that choice (`blocks.consistent_slots`). `rollout` (the target
    rolled out from `anchors`, `rollout.Roller`) gives every slot the target's choice after
    its OWN earlier tokens instead: labels and teacher from the path, slots kept while the
    path stays followable (`_path_slots`).
    """
    if consistent and not target_labels:
        raise ValueError("consistent labels need the target's labels (labels='target')")
    target_labels = target_labels or rollout is not None
    c = drafter.config
    device = head.weight.device
    blocks, hidden = draft_blocks(drafter, embed, example, anchors, gamma, device)
    labels = head.to_local(blocks.labels.clamp(min=0))
    keep = (blocks.weights > 0) & ((labels >= 0) | target_labels)
    weights = blocks.weights[keep].to(device)
    teacher, stats = None, {}
    if rollout is not None:
        slot_hidden, valid = _path_slots(rollout, head, c.block_size)
        teacher = head.target_logits(slot_hidden[keep])
        weights = weights * valid[keep].to(device)
        stats = _later_kept(valid, keep, c.block_size)
    elif distill > 0 or target_labels:
        # The target's distribution for the token at position p comes from position p - 1.
        positions = (blocks.position_ids[len(example.input_ids) :] - 1)[keep]
        teacher = head.target_logits(example.final_hidden[positions])
    targets = teacher.argmax(-1) if target_labels else labels[keep].to(device)
    if consistent:
        agree = torch.zeros_like(keep)
        agree[keep] = labels[keep] == targets.cpu()
        valid = consistent_slots(agree.view(-1, c.block_size)).flatten()
        weights = weights * valid[keep].to(device)
        stats = _later_kept(valid, keep, c.block_size)
    logits = hidden[keep.to(device)] @ head.weight.T
    ce = F.cross_entropy(logits.float(), targets, reduction="none")
    loss = (ce * weights).sum() / (weights.sum() + 1e-6)
    if distill > 0:
        kl = F.kl_div(
            F.log_softmax(logits.float(), -1),
            F.log_softmax(teacher.float(), -1),
            log_target=True,
            reduction="none",
        ).sum(-1)
        loss = (1 - distill) * loss + distill * (kl * weights).sum() / (weights.sum() + 1e-6)
    slot1 = keep & (torch.arange(len(keep)) % c.block_size == 1)
    correct = (logits.argmax(-1) == targets)[slot1[keep].to(device)]
    return loss, {"slot1_correct": int(correct.sum()), "slot1_total": int(correct.numel()), **stats}


def _path_slots(path: Rollout, head: Head, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher state per slot and which slots keep a loss [N*bs]: slot k needs a path
    token (k ≤ depth) and every earlier path token followable — inside the draft vocabulary
    (else the drafter cannot propose it and nothing after it is accepted) and not a stop
    token (generation ends there)."""
    slot_hidden, has = path.slots(block_size)
    followable = torch.zeros(len(path.tokens), block_size, dtype=torch.bool)
    depth = path.tokens.shape[1]
    followable[:, 1 : depth + 1] = (head.to_local(path.tokens) >= 0) & ~path.stop
    return slot_hidden, has & consistent_slots(followable).flatten()


def _later_kept(valid: torch.Tensor, keep: torch.Tensor, block_size: int) -> dict:
    """How many labelled slots ≥ 2 keep their loss (the train log's `later_kept`)."""
    later = keep & (torch.arange(len(keep)) % block_size >= 2)
    return {"later_kept": int((valid & later).sum()), "later_total": int(later.sum())}


def _save(path: Path, **state) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def _resume(ckpt: Path, drafter: DFlashDrafter, opt, sched) -> int:
    """The step a checkpoint left off at (0 without one); model, optimiser and schedule
    restored to the bit."""
    if not ckpt.exists():
        return 0
    state = torch.load(ckpt, weights_only=False)
    drafter.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    return state["step"]


def _accumulate_batch(
    cfg: TrainConfig,
    drafter: DFlashDrafter,
    embed: torch.nn.Embedding,
    head: Head,
    batch: Sequence[feature_cache.Example],
    gamma: float,
    anchor_gen: torch.Generator,
    roller: Callable[[feature_cache.Example, torch.Tensor], Rollout] | None,
) -> tuple[float, dict, int]:
    """Gradients of one batch's mean block loss, one sequence at a time (bounded memory);
    returns (loss, summed loss statistics, block tokens)."""
    autocast = torch.autocast(cfg.device.split(":")[0], dtype=torch.bfloat16, enabled=cfg.bf16)
    total_loss, stats, tokens = 0.0, {}, 0
    for example in batch:
        anchors = sample_anchors(example.loss_mask(), cfg.num_anchors, anchor_gen)
        if len(anchors) == 0:
            continue
        rollout = roller(example, anchors) if roller else None  # outside autocast
        with autocast:
            loss, s = block_loss(
                drafter,
                embed,
                head,
                example,
                anchors,
                gamma,
                cfg.distill,
                target_labels=cfg.labels == "target",
                consistent=cfg.consistent,
                rollout=rollout,
            )
        (loss / len(batch)).backward()
        total_loss += loss.item() / len(batch)
        stats = {k: stats.get(k, 0) + s[k] for k in s}
        tokens += len(anchors) * drafter.config.block_size
    return total_loss, stats, tokens


def _log_row(
    step: int, steps_per_epoch: int, loss: float, stats: dict, lr: float, tokens_per_s: float
) -> dict:
    row = {
        "step": step,
        "epoch": step / steps_per_epoch,
        "loss": loss,
        "slot1_acc": stats.get("slot1_correct", 0) / max(1, stats.get("slot1_total", 0)),
        "lr": lr,
        "block_tokens_per_s": tokens_per_s,
    }
    if "later_total" in stats:  # share of slots ≥ 2 whose label stays on the path
        row["later_kept"] = stats["later_kept"] / max(1, stats["later_total"])
    return row


def train(
    cfg: TrainConfig,
    drafter: DFlashDrafter,
    embed: torch.nn.Embedding,
    head: Head,
    examples: Sequence[feature_cache.Example],
    log=print,
    roller: Callable[[feature_cache.Example, torch.Tensor], Rollout] | None = None,
) -> Path:
    """Train `drafter` on cached features; resumes from `out_dir/checkpoint.pt`.
    `roller` (for labels="rollout") rolls the target out from a sequence's anchors."""
    from tqdm import tqdm

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not examples:
        raise ValueError(f"no training examples in {cfg.source}")
    if (cfg.labels == "rollout") != (roller is not None):
        raise ValueError("labels='rollout' and a roller go together")
    gamma = cfg.gamma or default_gamma(drafter.config.block_size)
    steps_per_epoch = math.ceil(len(examples) / cfg.batch_size)
    total = max(1, int(cfg.epochs * steps_per_epoch))
    warmup = max(1, int(cfg.warmup_ratio * total))
    drafter.to(cfg.device).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_lr(s, total, warmup))
    ckpt = out / "checkpoint.pt"
    step = _resume(ckpt, drafter, opt, sched)
    if step:
        log(f"resumed at step {step}/{total}")
    end = min(total, cfg.max_steps if cfg.max_steps is not None else total)
    bar = tqdm(total=end, initial=step, desc="train", unit="step", dynamic_ncols=True)
    with (out / "train_log.jsonl").open("a") as log_file:
        while step < end:
            epoch, offset = divmod(step, steps_per_epoch)
            order = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
            batches = feature_cache.batch_indices(len(examples), cfg.batch_size, order)
            for indices in batches[offset : offset + end - step]:  # the last epoch stops at end
                started = time.monotonic()
                anchor_gen = torch.Generator().manual_seed(cfg.seed * 7919 + step)
                opt.zero_grad(set_to_none=True)
                batch = [examples[j] for j in indices]
                loss, stats, tokens = _accumulate_batch(
                    cfg, drafter, embed, head, batch, gamma, anchor_gen, roller
                )
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                sched.step()
                step += 1
                tok_s = tokens / (time.monotonic() - started)
                row = _log_row(step, steps_per_epoch, loss, stats, sched.get_last_lr()[0], tok_s)
                log_file.write(json.dumps(row) + "\n")
                bar.update(1)
                bar.set_postfix(
                    loss=f"{loss:.3f}", acc1=f"{row['slot1_acc']:.2f}", tok_s=f"{tok_s:.0f}"
                )
                if step % cfg.save_every == 0 or step == end:
                    log_file.flush()
                    _save(
                        ckpt,
                        model=drafter.state_dict(),
                        optimizer=opt.state_dict(),
                        scheduler=sched.state_dict(),
                        step=step,
                        config=asdict(cfg),
                        draft_config=drafter.config.to_json(),
                    )
    bar.close()
    return drafter.save(out / "drafter")


def draft_config_for(
    target_config: dict,
    *,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
) -> DraftConfig:
    """A drafter shaped like the target's own layers (so they can initialise it)."""
    from sglang.srt.speculative.dflash_utils import build_target_layer_ids

    from dflash_sglang.checkpoint import rope_theta_of

    n_target = int(target_config["num_hidden_layers"])
    hidden = int(target_config["hidden_size"])
    heads = int(target_config["num_attention_heads"])
    return DraftConfig(
        hidden_size=hidden,
        intermediate_size=int(target_config["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(target_config.get("num_key_value_heads", heads)),
        head_dim=int(target_config.get("head_dim") or hidden // heads),
        vocab_size=int(target_config["vocab_size"]),
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(target_layer_ids or build_target_layer_ids(n_target, num_layers)),
        num_target_layers=n_target,
        rms_norm_eps=float(target_config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(target_config),
        max_position_embeddings=int(target_config.get("max_position_embeddings", 4096)),
    )


def init_from_target(drafter: DFlashDrafter, target, layer_ids: list[int]) -> None:
    """Copy target decoder layers `layer_ids` into the draft layers (q/k norms stay at 1)."""
    target_layers = target.model.layers
    with torch.no_grad():
        for draft_layer, i in zip(drafter.layers, layer_ids, strict=True):
            source = target_layers[i].state_dict()
            own = draft_layer.state_dict()
            draft_layer.load_state_dict({k: source.get(k, v) for k, v in own.items()})


def new_drafter(config: DraftConfig, seed: int) -> DFlashDrafter:
    """Fresh weights: normal(0, 0.02) linears, unit norms (as SpecForge's post_init)."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config)
    for module in drafter.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    return drafter
