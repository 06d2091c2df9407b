"""Tiny random models in the formats the product serves: a Llama target and a z-lab draft."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_sglang.checkpoint import write_random_draft

MASK_TOKEN = "<|MASK|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TARGET_LAYERS = 4
HIDDEN = 64
VOCAB = 512


def _corpus() -> list[str]:
    words = "the quick brown fox jumps over a lazy dog while speculative decoding drafts blocks"
    return [f"{words} {i} {words[::-1]} number {i * 7}" for i in range(300)]


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 16,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out)
    return hf


def make_tiny_target(out: Path, seed: int = 0, head_dim: int = 64) -> Path:
    """A 4-layer Llama (SmolLM2's architecture) with random weights, bf16 on disk.

    Heads of 64 by default: a width the CPU paged-attention kernel serves, so servers run it.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,  # SmolLM2's; not the default, so a draft must carry it through
        tie_word_embeddings=True,
        initializer_range=0.2,  # chaotic enough that greedy output does not loop on one token
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def make_tiny_draft(
    target: Path,
    out: Path,
    *,
    block_size: int = 4,
    num_layers: int = 1,
    target_layer_ids: list[int] | None = None,
    seed: int = 1,
) -> Path:
    """A random `DFlashDraftModel` checkpoint in z-lab format for `target`."""
    from transformers import AutoTokenizer

    mask_id = AutoTokenizer.from_pretrained(target).convert_tokens_to_ids(MASK_TOKEN)
    return write_random_draft(
        target,
        out,
        block_size=block_size,
        num_layers=num_layers,
        mask_token_id=mask_id,
        target_layer_ids=target_layer_ids or [1],
        head_dim=16,
        seed=seed,
    )


def zero_final_norm(model_dir: Path, key: str) -> Path:
    """Zero a final norm: every logit becomes 0 and argmax is always token 0.

    A target and a draft both treated this way agree on every token, which makes a pair
    whose acceptance is known exactly (every draft accepted).
    """
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    weights[key] = torch.zeros_like(weights[key])
    save_file(weights, str(path), metadata={"format": "pt"})
    return model_dir


def steer_token_zero(model_dir: Path, scale: float, seed: int = 2) -> Path:
    """Point token 0's (tied) embedding/lm_head row along a random direction times `scale`.

    With the target's final norm zeroed the target still always emits token 0, while a
    draft sharing this lm_head picks token 0 only where its hidden state leans along that
    direction: a pair whose acceptance is partial, and varies by position and context.
    """
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    key = "model.embed_tokens.weight"
    row = torch.randn(weights[key].shape[1], generator=torch.Generator().manual_seed(seed))
    weights[key][0] = (scale * row / row.norm()).to(weights[key].dtype)
    save_file(weights, str(path), metadata={"format": "pt"})
    return model_dir
