"""The drafter the package ships for the embedded default target: small, bf16, z-lab format,
matched to SmolLM2-135M-Instruct, and the launcher's default."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from dflash_sglang import default_model
from dflash_sglang.checkpoint import check_pair
from dflash_sglang.drafter import DFlashDrafter
from dflash_sglang.drafters import default_draft_dir
from dflash_sglang.launch_server import resolve_args


@pytest.fixture(scope="module")
def bundled() -> Path:
    path = default_draft_dir()
    assert path is not None, "the default drafter is not bundled"
    return Path(path)


def test_is_small_bf16_and_z_lab_shaped(bundled):
    weights = bundled / "model.safetensors"
    assert weights.stat().st_size < 40 * 2**20
    with safe_open(str(weights), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys() if k != "draft_vocab_ids"}
    assert dtypes == {"BF16"}
    drafter = DFlashDrafter.load(bundled)
    c = drafter.config
    assert (c.block_size, c.mask_token_id) == (16, default_model.MASK_TOKEN_ID)
    assert c.num_hidden_layers <= 5 and c.num_target_layers == 30
    assert drafter.draft_vocab_ids is None or len(set(drafter.draft_vocab_ids.tolist())) == len(
        drafter.draft_vocab_ids
    )


def test_matches_the_embedded_target(bundled, converted):
    target, _ = converted
    info = check_pair(str(target), str(bundled))
    assert info is not None


def test_is_the_launchers_default(bundled):
    args = resolve_args([], "cpu", "/cache/smollm2", str(bundled))
    assert args[args.index("--speculative-draft-model-path") + 1] == str(bundled)
    assert args[args.index("--speculative-algorithm") + 1] == "DFLASH_X"
