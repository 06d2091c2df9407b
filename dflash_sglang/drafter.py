"""The DFlash drafter in plain PyTorch: Qwen3-style layers with target-feature KV injection.

Same maths as z-lab's `DFlashDraftModel` and SGLang's loader: fused context
`hidden_norm(fc(concat target layer outputs))` becomes extra K/V (context first) in every
layer through that layer's own `k_proj`/`k_norm`/`v_proj`; RoPE at absolute positions;
no embedding or lm_head of its own (the target's are borrowed, frozen). Checkpoints are
z-lab format: `config.json` + `model.safetensors` with unprefixed keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_sglang.options import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    draft_vocab_size: int | None = None  # restricted draft vocabulary (see draft_vocab.py)

    @classmethod
    def from_json(cls, config: dict) -> DraftConfig:
        dflash = config.get("dflash_config") or {}
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_key_value_heads=int(config["num_key_value_heads"]),
            head_dim=int(
                config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
            ),
            vocab_size=int(config["vocab_size"]),
            block_size=int(
                config.get("block_size") or dflash.get("block_size") or DEFAULT_BLOCK_SIZE
            ),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
            num_target_layers=int(config["num_target_layers"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            draft_vocab_size=dflash.get("draft_vocab_size"),
        )

    def to_json(self) -> dict:
        dflash = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        if self.draft_vocab_size:
            dflash["draft_vocab_size"] = self.draft_vocab_size
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "sliding_window": None,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
            "torch_dtype": "bfloat16",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
        }


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) RoPE tables for `positions` [..., T] -> [..., T, head_dim]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d]; cos/sin [B or 1, T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=c.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_k: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, q_len, _ = x.shape
        kv_in = torch.cat([context, x], dim=1)  # context K/V first, then the block's own
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, self.kv_heads, self.head_dim))
        v = self.v_proj(kv_in).view(b, -1, self.kv_heads, self.head_dim)
        q = apply_rope(q, *rope_q)
        k = apply_rope(k.transpose(1, 2), *rope_k)
        out = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class MLP(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, h, context, rope_q, rope_k, mask):
        h = h + self.self_attn(self.input_layernorm(h), context, rope_q, rope_k, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        features = len(config.target_layer_ids)
        self.fc = nn.Linear(features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.draft_vocab_size:
            self.register_buffer(
                "draft_vocab_ids", torch.zeros(config.draft_vocab_size, dtype=torch.long)
            )
        else:
            self.draft_vocab_ids: torch.Tensor | None = None

    def forward(
        self,
        block_embeds: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Normed hidden states of the block slots.

        block_embeds [B, Q, H] (target embeddings of the block ids); target_hidden
        [B, S, K*H] (concatenated target layer outputs of the S context positions);
        position_ids [B or 1, S+Q]; attention_mask [B or 1, 1, Q, S+Q] bool or None
        (None = every slot sees every context position and block slot, as at inference).
        """
        q_len = block_embeds.shape[1]
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        rope_k = (cos.to(block_embeds.dtype), sin.to(block_embeds.dtype))
        rope_q = (rope_k[0][:, -q_len:], rope_k[1][:, -q_len:])
        h = block_embeds
        for layer in self.layers:
            h = layer(h, context, rope_q, rope_k, attention_mask)
        return self.norm(h)

    def save(self, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        """Write z-lab format; SGLang's upstream loader and DFLASH_X both read it."""
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.config.to_json(), indent=1))
        weights = {
            k: (v.detach().to(dtype) if v.is_floating_point() else v).contiguous()
            for k, v in self.state_dict().items()
        }
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
        from safetensors.torch import load_file

        path = Path(path)
        config = DraftConfig.from_json(json.loads((path / "config.json").read_text()))
        model = cls(config)
        weights = {}
        for file in sorted(path.glob("*.safetensors")):
            weights |= {k.removeprefix("model."): v for k, v in load_file(str(file)).items()}
        model.load_state_dict(weights, strict=True)
        return model.to(dtype)
