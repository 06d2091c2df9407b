"""Default KV pool size on CPU, from what the model and its context need.

SGLang sizes a CPU pool from a share of host RAM (~70% here: one scheduler of a 135M model
reached 13 GB RSS, and a second server on the same 24 GB machine was OOM-killed at start-up).
On CPU the launcher instead passes `--max-total-tokens`: room for CONTEXTS_PER_POOL full
contexts, capped at RAM_SHARE of host memory for target and draft KV together.
"""

from __future__ import annotations

from typing import Any

CONTEXTS_PER_POOL = 8
RAM_SHARE = 0.25
MIN_TOKENS = 4096
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "bf16": 2}


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """K and V of every layer for one token, from a HF config."""
    config = config.get("text_config") or config
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def dtype_bytes(dtype_flag: str | None, config: dict[str, Any]) -> int:
    """Bytes per KV element: `--kv-cache-dtype`/`--dtype` if given, else the config's dtype."""
    name = dtype_flag if dtype_flag not in (None, "auto") else config.get("torch_dtype")
    name = name or (config.get("text_config") or {}).get("torch_dtype") or "bfloat16"
    return DTYPE_BYTES.get(str(name).removeprefix("torch."), 2)


def default_max_total_tokens(
    target: dict[str, Any],
    draft: dict[str, Any] | None,
    context_len: int,
    kv_dtype_bytes: int,
    host_ram_bytes: int,
) -> int:
    """Tokens of KV pool: CONTEXTS_PER_POOL contexts, within RAM_SHARE of host RAM."""
    per_token = kv_bytes_per_token(target, kv_dtype_bytes)
    if draft is not None:
        per_token += kv_bytes_per_token(draft, kv_dtype_bytes)
    by_ram = int(RAM_SHARE * host_ram_bytes) // per_token
    return max(MIN_TOKENS, min(CONTEXTS_PER_POOL * context_len, by_ram))
