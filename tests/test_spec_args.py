"""Server-argument resolution and validation for DFLASH_X, without a server."""

import json
from types import SimpleNamespace

import pytest

from dflash_sglang.checkpoint import CheckpointError, check_pair
from dflash_sglang.spec import DFlashXSpec, resolve_server_args, validate_server_args


def _args(models, **overrides):
    base = dict(
        model_path=str(models["target"]),
        speculative_draft_model_path=str(models["draft"]),
        device="cpu",
        pp_size=1,
        enable_dp_attention=False,
        speculative_draft_window_size=None,
        disaggregation_mode="null",
        speculative_num_draft_tokens=None,
        speculative_dflash_block_size=None,
        speculative_num_steps=None,
        speculative_eagle_topk=None,
        speculative_draft_attention_backend=None,
        disable_overlap_schedule=False,
        max_running_requests=None,
    )
    return SimpleNamespace(**(base | overrides))


def test_defaults_follow_the_draft_config(models):
    args = _args(models)
    resolve_server_args(args)
    assert (args.speculative_num_steps, args.speculative_eagle_topk) == (1, 1)
    assert args.speculative_num_draft_tokens == 4  # the draft's block_size
    assert args.speculative_draft_attention_backend == "dflash_cpu"
    assert args.disable_overlap_schedule is True
    assert args.max_running_requests == 48


def test_explicit_block_size_wins_and_user_choices_stay(models):
    args = _args(models, speculative_dflash_block_size=8, max_running_requests=4, device="cuda")
    resolve_server_args(args)
    assert args.speculative_num_draft_tokens == 8
    assert args.max_running_requests == 4
    assert args.speculative_draft_attention_backend == "flashinfer"
    assert args.disable_overlap_schedule is False


def test_conflicting_block_flags_are_rejected(models):
    args = _args(models, speculative_dflash_block_size=8, speculative_num_draft_tokens=4)
    with pytest.raises(ValueError, match="speculative-dflash-block-size"):
        resolve_server_args(args)


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"device": "npu"}, "--device"),
        ({"pp_size": 2}, "--pp-size"),
        ({"enable_dp_attention": True}, "--enable-dp-attention"),
        ({"speculative_draft_window_size": 64}, "--speculative-draft-window-size"),
        ({"speculative_num_draft_tokens": 1}, "--speculative-num-draft-tokens"),
        ({"speculative_draft_attention_backend": "fa3"}, "--speculative-draft-attention-backend"),
        # CUDA-only: FlashInfer's wrappers.
        (
            {"speculative_draft_attention_backend": "dflash_flashinfer"},
            "--speculative-draft-attention-backend",
        ),
        ({"speculative_draft_model_path": None}, "--speculative-draft-model-path"),
    ],
)
def test_validation_names_the_flag(models, overrides, flag):
    with pytest.raises(ValueError, match=flag):
        validate_server_args(_args(models, **overrides))


def test_valid_configuration_passes(models):
    validate_server_args(_args(models))


def test_spec_class_reports_dflash_and_fills_missing_enum_methods():
    spec = DFlashXSpec(name="DFLASH_X", factory=lambda a: None, supports_overlap=True)
    assert spec.is_dflash() and spec.is_dflash_family() and spec.is_speculative()
    assert not spec.carries_draft_hidden_states() and not spec.need_topk()
    assert spec.get_platform_worker_cls() is None
    assert spec.supports_target_verify_for_draft()


def _draft_copy(models, tmp_path, edit):
    d = tmp_path / "draft"
    d.mkdir()
    (d / "model.safetensors").write_bytes((models["draft"] / "model.safetensors").read_bytes())
    config = json.loads((models["draft"] / "config.json").read_text())
    edit(config)
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(hidden_size=32), "hidden size mismatch"),
        (lambda c: c.update(vocab_size=1000), "vocab mismatch"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]), "out-of-range"),
        (lambda c: c["dflash_config"].update(mask_token_id=4096), "mask_token_id=4096"),
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
        (lambda c: c.update(num_target_layers=30), "num_target_layers=30"),
    ],
)
def test_incompatible_pairs_name_the_mismatch(models, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        check_pair(str(models["target"]), _draft_copy(models, tmp_path, edit))


def test_missing_files_are_reported(models, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        check_pair(str(models["target"]), str(tmp_path))
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text((models["draft"] / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        check_pair(str(models["target"]), str(d))
    with pytest.raises(CheckpointError, match="not a directory"):
        check_pair(str(models["target"]), str(tmp_path / "missing"))


def test_compatible_pair_reports_block_and_layers(models):
    info = check_pair(str(models["target"]), str(models["draft2"]))
    assert info.block_size == 8 and info.target_layer_ids == [0, 2] and info.num_layers == 2
