"""`python -m dflash_sglang.training <command>`: the drafter recipe, one command per stage.

generate  real prompts -> target responses through an SGLang server (JSONL, resumable)
mix       a training set from generated files: some whole, some sampled, reproducible
features  target layer outputs for every sample, cached once (resumable shards)
train     the drafter on cached features (resumable checkpoints, progress bar)
evaluate  τ and the acceptance histogram on held-out sets with the reference loop
yardstick what slot 1 can reach: a one-layer next-token head on the same cached features
export    a training checkpoint -> z-lab drafter directory (bf16)
average   drafters of one shape -> their weight-for-weight mean (bf16)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_sglang.options import DEFAULT_BLOCK_SIZE, DEFAULT_PROMPT_VOCAB

EVAL_SETS = ("mt_bench", "humaneval", "math")


class CliError(Exception):
    """A bad argument: printed with the flag's name, exit code 2."""


def _target_path(arg: str | None) -> Path:
    if arg:
        path = Path(arg)
        if not (path / "config.json").is_file():
            raise CliError(f"--target {arg}: no config.json there (a HF model directory)")
        return path
    from dflash_sglang import default_model

    return default_model.ensure_default_target(log=lambda m: print(m, file=sys.stderr))


def _load_target(path: Path, dtype: str = "bfloat16"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    model.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(path)


def _existing_file(flag: str, value: str) -> Path:
    path = Path(value)
    if not path.is_file():
        raise CliError(f"{flag} {value}: no such file")
    return path


def _existing_dir(flag: str, value: str) -> Path:
    path = Path(value)
    if not path.is_dir():
        raise CliError(f"{flag} {value}: no such directory")
    return path


def _generate_prompts(a: argparse.Namespace) -> list:
    """The prompts `generate` answers, once the flags that pick them are checked."""
    from dflash_sglang.training import data

    if a.all_turns and a.prompt_set != "sharegpt":
        raise CliError(f"--all-turns: --prompt-set {a.prompt_set} has single-turn prompts")
    if a.responses == "dataset" and a.prompt_set != "sharegpt":
        raise CliError(f"--responses dataset: --prompt-set {a.prompt_set} has no replies")
    if a.prompts_file and (a.prompt_set != "sharegpt" or a.all_turns or a.responses != "target"):
        raise CliError(
            "--prompts-file: replaces --prompt-set/--all-turns; needs --responses target"
        )
    if a.temperature < 0 or a.draw < 0:
        raise CliError("--temperature and --draw must be >= 0")
    if a.temperature and a.responses != "target":
        raise CliError("--temperature: only --responses target samples replies")
    if a.draw and a.temperature == 0:
        raise CliError("--draw: only sampled replies (--temperature > 0) have more than one")
    if a.prompts_file:
        try:
            return data.file_prompts(
                _existing_file("--prompts-file", a.prompts_file), a.num_prompts
            )
        except (ValueError, OSError) as e:
            raise CliError(f"--prompts-file: {e}") from e
    if a.prompt_set == "sharegpt":
        return data.training_prompts(a.num_prompts, a.all_turns)
    return data.heldout_prompts(a.prompt_set, a.num_prompts)


def _with_plain_server(a: argparse.Namespace, target: Path, log: Path, run) -> None:
    """`run(url)` against a plain-decoding server of `target` started for it and stopped
    afterwards, also on SIGTERM (it runs in its own session)."""
    import signal

    from dflash_sglang.managed_server import Server

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    args = ["--model-path", str(target), "--speculative-algorithm", "NONE"]
    args += ["--max-total-tokens", str(a.max_total_tokens), "--disable-radix-cache"]
    args += ["--dtype", a.dtype] if a.dtype else []
    server = Server(args, log, threads=a.threads)
    try:
        run(server.url)
    finally:
        server.stop()


def cmd_generate(a: argparse.Namespace) -> None:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from dflash_sglang.training import data

    prompts = _generate_prompts(a)
    target = _target_path(a.target)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(target)
    done = len(data.done_ids(out) & {data.sample_id(p, a.temperature, a.draw) for p in prompts})
    bar = tqdm(total=len(prompts), initial=done, desc="generate", unit="sample")
    rate = data.Throughput()

    def progress(samples: int, tokens: int) -> None:
        bar.update(samples)
        bar.set_postfix(tok_s=f"{rate.add(tokens):.0f}")

    def run(url: str) -> None:
        data.regenerate(
            prompts,
            out,
            server_url=url,
            tokenizer=tokenizer,
            max_new_tokens=a.max_new_tokens,
            max_prompt_tokens=a.max_prompt_tokens,
            batch_size=a.batch_size,
            temperature=a.temperature,
            draw=a.draw,
            progress=progress,
        )

    if a.responses == "dataset":
        data.dataset_responses(
            prompts,
            out,
            tokenizer=tokenizer,
            max_new_tokens=a.max_new_tokens,
            max_prompt_tokens=a.max_prompt_tokens,
            progress=progress,
        )
    elif a.server_url:
        run(a.server_url.rstrip("/"))
    else:
        _with_plain_server(a, target, out.with_suffix(".server.log"), run)
    bar.close()
    print(f"{len(data.done_ids(out))} samples in {out}")


def _draft_config(a: argparse.Namespace, target: Path, tokenizer):
    import dataclasses

    from dflash_sglang.checkpoint import read_config
    from dflash_sglang.training.train import draft_config_for

    target_config = read_config(str(target), "target")
    vocab = int(target_config.get("vocab_size") or target_config["text_config"]["vocab_size"])
    if a.mask_token_id is not None:
        mask_id = a.mask_token_id
        if not 0 <= mask_id < vocab:
            raise CliError(f"--mask-token-id {mask_id} is outside the target vocabulary ({vocab})")
    else:
        mask = a.mask_token or tokenizer.mask_token or "<|MASK|>"
        mask_id = tokenizer.convert_tokens_to_ids(mask)
        if mask_id is None or mask_id == tokenizer.unk_token_id:
            raise CliError(
                f"--mask-token {mask!r} is not a token of the target's vocabulary "
                "(pick an unused special token, or --mask-token-id)"
            )
    layer_ids = [int(x) for x in a.target_layer_ids.split(",")] if a.target_layer_ids else None
    config = draft_config_for(
        target_config,
        num_layers=a.num_layers,
        block_size=a.block_size or DEFAULT_BLOCK_SIZE,
        mask_token_id=mask_id,
        target_layer_ids=layer_ids,
    )
    if a.rope_theta is not None:
        if a.rope_theta <= 0:
            raise CliError(f"--rope-theta must be > 0, got {a.rope_theta}")
        config = dataclasses.replace(config, rope_theta=a.rope_theta)
    return config


def cmd_features(a: argparse.Namespace) -> None:
    import torch
    from tqdm import tqdm

    from dflash_sglang.training import data, features

    torch.set_num_threads(a.threads)
    target_dir = _target_path(a.target)
    samples = data.read_samples(_existing_file("--data", a.data))
    target, tokenizer = _load_target(target_dir, a.dtype)
    config = _draft_config(a, target_dir, tokenizer)
    bar = tqdm(total=len(samples), desc="features", unit="sample")
    features.compute(
        target,
        samples,
        list(config.target_layer_ids),
        Path(a.features_dir),
        max_len=a.max_len,
        progress=bar.update,
    )
    bar.close()


def cmd_train(a: argparse.Namespace) -> None:
    import dataclasses

    import torch

    from dflash_sglang import draft_vocab
    from dflash_sglang.drafter import DFlashDrafter
    from dflash_sglang.training import data, evaluate, features, rollout, train

    torch.set_num_threads(a.threads)
    if bool(a.features_dir) == bool(a.data):
        raise CliError("give exactly one of --features-dir (cached) or --data (online features)")
    if a.labels == "rollout" and not a.data:
        raise CliError("--labels rollout runs the target from each anchor: give --data")
    source = _existing_dir("--features-dir", a.features_dir) if a.features_dir else None
    samples = data.read_samples(_existing_file("--data", a.data)) if a.data else None
    target_dir = _target_path(a.target)
    target, tokenizer = _load_target(target_dir, a.target_dtype)
    target.to(a.device)
    if a.init_drafter:
        drafter = DFlashDrafter.load(_existing_dir("--init-drafter", a.init_drafter))
        if a.block_size:  # the same weights drafting blocks of another size
            drafter = evaluate.at_block_size(drafter, a.block_size)
    else:
        config = _draft_config(a, target_dir, tokenizer)
        if a.draft_vocab_size:
            config = dataclasses.replace(config, draft_vocab_size=a.draft_vocab_size)
        drafter = train.new_drafter(config, a.seed)
        if a.init_from_target:
            ids = [int(x) for x in a.init_from_target.split(",")]
            if len(ids) != drafter.config.num_hidden_layers:
                raise CliError(f"--init-from-target needs {a.num_layers} layer ids, got {ids}")
            train.init_from_target(drafter, target, ids)
    layer_ids = list(drafter.config.target_layer_ids)
    if source is not None:
        try:
            features.check_layers(source, layer_ids)
        except ValueError as e:
            raise CliError(f"--features-dir: {e}") from e
        examples = features.load(source)
        responses = [e.input_ids[e.prompt_len :].tolist() for e in examples]
    else:
        examples = features.OnlineExamples(
            target, samples, layer_ids, a.max_len, keep_cache=a.labels == "rollout"
        )
        responses = [s["response_ids"] for s in samples]
    if drafter.config.draft_vocab_size and not a.init_drafter:
        ids = draft_vocab.most_frequent(responses, drafter.config.draft_vocab_size)
        drafter.draft_vocab_ids.copy_(ids)
    embed = target.get_input_embeddings()
    head = train.Head(
        target.get_output_embeddings().weight.detach().float(), drafter.draft_vocab_ids, a.device
    )
    cfg = train.TrainConfig(
        source=a.features_dir or a.data,
        out_dir=a.out,
        epochs=a.epochs,
        batch_size=a.batch_size,
        num_anchors=a.num_anchors,
        lr=a.lr,
        distill=a.distill,
        gamma=a.gamma,
        labels=a.labels,
        consistent=a.consistent_labels,
        rollout_depth=a.rollout_depth or drafter.config.block_size - 1,
        seed=a.seed,
        device=a.device,
        bf16=a.bf16,
        save_every=a.save_every,
        max_steps=a.max_steps,
    )
    roller = None
    if a.labels == "rollout":
        if cfg.rollout_depth >= drafter.config.block_size:
            raise CliError(f"--rollout-depth must be < the block size {drafter.config.block_size}")
        roller = rollout.Roller(target, cfg.rollout_depth, {tokenizer.eos_token_id} - {None})
    out = train.train(cfg, drafter.to(a.device), embed, head, examples, roller=roller)
    print(f"drafter written to {out}")


def cmd_evaluate(a: argparse.Namespace) -> None:
    import torch

    from dflash_sglang.training import evaluate

    torch.set_num_threads(a.threads)
    sets = a.sets.split(",")
    unknown = set(sets) - set(EVAL_SETS)
    if unknown:
        raise CliError(f"--sets: unknown {sorted(unknown)}; choose from {','.join(EVAL_SETS)}")
    if a.baseline_url and not a.server_url:
        raise CliError("--baseline-url needs --server-url (the DFLASH_X server to compare)")
    if a.spread and a.features_dir:
        raise CliError("--spread picks prompts to decode; --features-dir reads its set whole")
    target_dir = _target_path(a.target)
    drafter_dir = _existing_dir("--drafter", a.drafter)
    from dflash_sglang.checkpoint import CheckpointError, check_pair

    try:
        check_pair(str(target_dir), str(drafter_dir))
    except CheckpointError as e:
        raise CliError(f"--drafter: {e}") from e
    if a.features_dir:
        report = _teacher_forced(
            a.features_dir, target_dir, drafter_dir, a.prompt_vocab, a.block_size
        )
    else:
        report = evaluate.run(
            target_dir,
            drafter_dir,
            sets,
            limit=a.limit,
            max_new_tokens=a.max_new_tokens,
            block_size=a.block_size,
            dtype=a.dtype,
            server_url=a.server_url,
            baseline_url=a.baseline_url,
            check_greedy=a.check_greedy,
            prompt_vocab=a.prompt_vocab,
            spread=a.spread,
        )
    text = json.dumps(report, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)


def _teacher_forced(
    features_dir: str,
    target_dir: Path,
    drafter_dir: Path,
    prompt_vocab: int,
    block_size: int | None = None,
) -> dict:
    from dflash_sglang.drafter import DFlashDrafter
    from dflash_sglang.training import evaluate, features

    source = _existing_dir("--features-dir", features_dir)
    drafter = DFlashDrafter.load(drafter_dir).eval()
    if block_size is not None:
        try:
            drafter = evaluate.at_block_size(drafter, block_size)
        except ValueError as e:
            raise CliError(f"--block-size: {e}") from e
    try:
        features.check_layers(source, list(drafter.config.target_layer_ids))
    except ValueError as e:
        raise CliError(f"--features-dir: {e}") from e
    target, _ = _load_target(target_dir, "float32")
    examples = features.load(source)
    result = evaluate.teacher_forced(
        drafter,
        target.get_input_embeddings(),
        target.get_output_embeddings().weight,
        examples,
        prompt_vocab,
    )
    return {
        "drafter": str(drafter_dir),
        "features": str(source),
        "block_size": drafter.config.block_size,
        "teacher_forced": result,
    }


def cmd_yardstick(a: argparse.Namespace) -> None:
    import torch

    from dflash_sglang import draft_vocab
    from dflash_sglang.drafter import DFlashDrafter
    from dflash_sglang.training import features, yardstick
    from dflash_sglang.training.train import Head

    torch.set_num_threads(a.threads)
    source = _existing_dir("--features-dir", a.features_dir)
    heldout = [_existing_dir("--heldout-features", d) for d in a.heldout_features.split(",")]
    layers = json.loads((source / "meta.json").read_text())["target_layer_ids"]
    for root in heldout:
        try:
            features.check_layers(root, layers)
        except ValueError as e:
            raise CliError(f"--heldout-features: {e}") from e
    drafter = None
    if a.drafter:
        drafter = DFlashDrafter.load(_existing_dir("--drafter", a.drafter)).eval()
        try:
            features.check_layers(source, list(drafter.config.target_layer_ids))
        except ValueError as e:
            raise CliError(f"--drafter: {e}") from e
    target, _ = _load_target(_target_path(a.target), "float32")
    embed = target.get_input_embeddings()
    train_examples = features.load(source)
    if drafter is not None:  # the drafter's own output vocabulary, for a like-for-like score
        vocab = drafter.draft_vocab_ids
    else:
        responses = [e.input_ids[e.prompt_len :].tolist() for e in train_examples]
        vocab = draft_vocab.most_frequent(responses, a.draft_vocab_size)
    head = Head(target.get_output_embeddings().weight.detach().float(), vocab)
    model = yardstick.fit(train_examples, embed, head, epochs=a.epochs)
    report: dict = {"features": str(source), "target_layer_ids": layers, "epochs": a.epochs}
    for root in heldout:
        examples = features.load(root)
        entry = {"yardstick_top1": yardstick.top1(model, examples, embed, head)}
        if drafter is not None:
            entry["drafter_slot1"] = yardstick.drafter_slot1(drafter, examples, embed, head)
        report[root.name] = entry
    text = json.dumps(report, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)


def _mix_group(spec: str) -> tuple[list[dict], int | None]:
    """`PATH[,PATH...][:N]`: those files' samples in that order, all or N drawn."""
    paths, _, count = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if count and not (count.isdigit() and int(count) >= 1):
        raise CliError(f"mix {spec}: N after ':' must be a positive integer")
    return _mix_files(paths), int(count) if count else None


def _mix_files(paths: str, flag: str = "mix") -> list[dict]:
    from dflash_sglang.training import data

    samples = []
    for path in paths.split(","):
        try:
            samples += data.read_samples(_existing_file(flag, path))
        except ValueError as e:  # a line that is not JSON
            raise CliError(f"{flag} {path}: {e}") from None
    return samples


def cmd_mix(a: argparse.Namespace) -> None:
    from dflash_sglang.training import data

    if not Path(a.out).parent.is_dir():
        raise CliError(f"--out {a.out}: its directory does not exist")
    groups = [_mix_group(spec) for spec in a.groups]
    if a.exclude:  # ids earlier runs trained on; a row without an id stays for mix to refuse
        seen = {row["id"] for row in _mix_files(a.exclude, "--exclude") if "id" in row}
        groups = [([r for r in samples if r.get("id") not in seen], n) for samples, n in groups]
    try:
        rows = data.mix(groups, a.seed, shuffle=not a.keep_order)
    except ValueError as e:
        raise CliError(f"mix: {e}") from None
    with open(a.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{len(rows)} samples to {a.out}")


def cmd_export(a: argparse.Namespace) -> None:
    import torch

    from dflash_sglang.drafter import DFlashDrafter, DraftConfig

    state = torch.load(_existing_file("--checkpoint", a.checkpoint), weights_only=False)
    drafter = DFlashDrafter(DraftConfig.from_json(state["draft_config"]))
    drafter.load_state_dict(state["model"])
    print(f"exported step {state['step']} to {drafter.save(a.out)}")


def cmd_average(a: argparse.Namespace) -> None:
    """Weight-for-weight mean of drafters of one shape (in fp32, saved bf16): the cheap try
    at a plateau, README 8. and 24."""
    import torch

    from dflash_sglang.drafter import DFlashDrafter

    drafters = [DFlashDrafter.load(_existing_dir("--drafters", d)) for d in a.drafters.split(",")]
    if len(drafters) < 2 or any(d.config != drafters[0].config for d in drafters):
        raise CliError("--drafters: two or more drafter dirs with the same config.json")
    states = [d.state_dict() for d in drafters]
    mean = {
        k: torch.stack([s[k] for s in states]).mean(0) if v.is_floating_point() else v
        for k, v in states[0].items()
    }
    drafters[0].load_state_dict(mean)
    print(f"averaged {len(drafters)} drafters to {drafters[0].save(a.out)}")


def _common(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--target", help="target HF model dir (default: embedded SmolLM2)")
    sp.add_argument("--threads", type=int, default=2, help="torch threads")


def _shape(sp: argparse.ArgumentParser) -> None:
    """The drafter's shape, for the commands that build one."""
    sp.add_argument("--num-layers", type=int, default=5)
    sp.add_argument(
        "--block-size",
        type=int,
        help=f"default: {DEFAULT_BLOCK_SIZE}; train --init-drafter: retrain that drafter at "
        "this size (default: its own)",
    )
    sp.add_argument("--mask-token", help="mask token string (default: <|MASK|>)")
    sp.add_argument("--mask-token-id", type=int, help="mask token id (e.g. Qwen3: 151669)")
    sp.add_argument("--target-layer-ids", help="comma list; default: the DFlash rule")
    sp.add_argument("--rope-theta", type=float, help="draft RoPE base (default: the target's)")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="target responses to real prompts")
    _common(g)
    g.add_argument("--out", required=True, help="JSONL file (appended; resumes)")
    g.add_argument("--num-prompts", type=int, default=2000)
    g.add_argument("--server-url", help="use this running server instead of starting one")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--max-prompt-tokens", type=int, default=256)
    g.add_argument("--batch-size", type=int, default=32, help="requests in flight")
    g.add_argument("--max-total-tokens", type=int, default=32768)
    g.add_argument("--dtype", help="server dtype (default: the target's own)")
    g.add_argument(
        "--prompt-set",
        choices=["sharegpt", *EVAL_SETS],
        default="sharegpt",
        help="sharegpt: training prompts (held-out sets removed); a held-out set: evaluation "
        "data for evaluate --features-dir",
    )
    g.add_argument(
        "--responses",
        choices=["target", "dataset"],
        default="target",
        help="target: regenerate through a server; dataset: the prompt set's own replies "
        "(no server; train them with --labels target)",
    )
    g.add_argument(
        "--all-turns",
        action="store_true",
        help="ShareGPT: every human turn, not only the first (after all first turns)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy replies (ids = prompt ids); > 0: sampled replies, ids ending -tT-DRAW",
    )
    g.add_argument(
        "--draw",
        type=int,
        default=0,
        help="which sampled reply per prompt this run adds (another draw, another sample)",
    )
    g.add_argument(
        "--prompts-file",
        help='training prompts from this JSONL(.gz) of {"text", "source"} lines instead of '
        "ShareGPT (held-out sets removed)",
    )
    g.set_defaults(func=cmd_generate)


def _add_mix(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("mix", help="a training set from generated files, reproducible")
    m.add_argument(
        "groups",
        nargs="+",
        metavar="PATH[,PATH...][:N]",
        help="JSONL(.gz) sample files; a group's files are read in order, all kept or N drawn",
    )
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, required=True, help="one RNG for every draw and the shuffle")
    m.add_argument("--keep-order", action="store_true", help="no final shuffle")
    m.add_argument(
        "--exclude",
        metavar="PATH[,PATH...]",
        help="sample files (earlier mixes) whose ids are left out of every group before any draw",
    )
    m.set_defaults(func=cmd_mix)


def _add_features(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("features", help="cache target features")
    _common(f)
    _shape(f)
    f.add_argument("--data", required=True)
    f.add_argument("--features-dir", required=True)
    f.add_argument("--max-len", type=int, default=512)
    f.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    f.set_defaults(func=cmd_features)


def _add_train(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train the drafter")
    _common(t)
    _shape(t)
    t.add_argument("--features-dir", help="cached features (CPU recipe)")
    t.add_argument("--data", help="generated JSONL; features computed online (GPU recipe)")
    t.add_argument("--max-len", type=int, default=512, help="with --data")
    t.add_argument(
        "--target-dtype", default="float32", choices=["bfloat16", "float32"], help="frozen target"
    )
    t.add_argument("--out", required=True, help="run dir: checkpoint.pt, train_log.jsonl, drafter/")
    t.add_argument("--epochs", type=float, default=6.0)
    t.add_argument("--batch-size", type=int, default=4)
    t.add_argument("--num-anchors", type=int, default=32)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--distill", type=float, default=0.0, help="KL weight in [0, 1]")
    t.add_argument(
        "--gamma", type=float, help="loss decay exp(-(k-1)/γ) (default: 7 for block 16, 4 for 8)"
    )
    t.add_argument(
        "--labels",
        choices=["text", "target", "rollout"],
        default="text",
        help="text: the data's tokens; target: the target's own argmax at each position "
        "(for generate --responses dataset); rollout: the target's own greedy path from "
        "each anchor, every slot on it (with --data; costs --rollout-depth - 1 target steps)",
    )
    t.add_argument(
        "--rollout-depth",
        type=int,
        help="with --labels rollout: path tokens per anchor, < block size (default: block - 1; "
        "later slots get no loss)",
    )
    t.add_argument(
        "--consistent-labels",
        action="store_true",
        help="with --labels target: no loss on a block's slots after the first where the "
        "data's token differs from the target's choice (their label follows another path)",
    )
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu")
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    t.add_argument("--save-every", type=int, default=100)
    t.add_argument("--max-steps", type=int)
    t.add_argument("--init-from-target", help="comma list of target layers to copy")
    t.add_argument("--init-drafter", help="start from this z-lab drafter dir")
    t.add_argument(
        "--draft-vocab-size", type=int, help="propose among the N most frequent response tokens"
    )
    t.set_defaults(func=cmd_train)


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("evaluate", help="τ on held-out sets")
    _common(e)
    e.add_argument("--drafter", required=True)
    e.add_argument("--sets", default=",".join(EVAL_SETS))
    e.add_argument("--limit", type=int, default=20, help="prompts per set")
    e.add_argument(
        "--spread", action="store_true", help="--limit prompts spaced evenly over each set"
    )
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.add_argument("--block-size", type=int)
    e.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    e.add_argument("--server-url", help="also measure through this DFLASH_X server")
    e.add_argument(
        "--baseline-url", help="with --server-url: plain-decoding server, interleaved (speedup)"
    )
    e.add_argument(
        "--check-greedy",
        action="store_true",
        help="also decode each prompt with the target alone and count identical outputs",
    )
    e.add_argument(
        "--features-dir",
        help="instead of decoding: teacher-forced τ on these cached features of greedy "
        "target data (e.g. generate --prompt-set mt_bench, then features)",
    )
    e.add_argument(
        "--prompt-vocab",
        type=int,
        default=DEFAULT_PROMPT_VOCAB,
        metavar="N",
        help="a restricted draft vocabulary also takes up to N of each prompt's own tokens, "
        f"as the server's --dflash-prompt-vocab (default {DEFAULT_PROMPT_VOCAB}; 0: off)",
    )
    e.add_argument("--out", help="write the JSON report here")
    e.set_defaults(func=cmd_evaluate)


def _add_yardstick(sub: argparse._SubParsersAction) -> None:
    y = sub.add_parser("yardstick", help="slot-1 yardstick: a one-layer head, same features")
    _common(y)
    y.add_argument("--features-dir", required=True, help="cached training features")
    y.add_argument(
        "--heldout-features", required=True, help="comma list of cached held-out feature dirs"
    )
    y.add_argument("--drafter", help="also the drafter's slot 1 on the same positions")
    y.add_argument("--epochs", type=int, default=3)
    y.add_argument("--draft-vocab-size", type=int, default=8192, help="head size without --drafter")
    y.add_argument("--out", help="write the JSON report here")
    y.set_defaults(func=cmd_yardstick)


def _add_export(sub: argparse._SubParsersAction) -> None:
    x = sub.add_parser("export", help="checkpoint.pt -> z-lab drafter dir")
    x.add_argument("--checkpoint", required=True)
    x.add_argument("--out", required=True)
    x.set_defaults(func=cmd_export)
    v = sub.add_parser("average", help="weight-for-weight mean of drafter dirs")
    v.add_argument("--drafters", required=True, help="comma list of drafter dirs")
    v.add_argument("--out", required=True)
    v.set_defaults(func=cmd_average)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_sglang.training",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    for add in (
        _add_generate,
        _add_mix,
        _add_features,
        _add_train,
        _add_evaluate,
        _add_yardstick,
        _add_export,
    ):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    for flag in (
        "num_prompts",
        "batch_size",
        "threads",
        "num_layers",
        "block_size",
        "limit",
        "draft_vocab_size",
    ):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if getattr(args, "epochs", None) is not None and args.epochs <= 0:
        p.error(f"--epochs must be > 0, got {args.epochs}")
    if getattr(args, "gamma", None) is not None and args.gamma <= 0:
        p.error(f"--gamma must be > 0, got {args.gamma}")
    if getattr(args, "prompt_vocab", 0) < 0:
        p.error(f"--prompt-vocab must be >= 0, got {args.prompt_vocab}")
    if getattr(args, "rollout_depth", None) is not None:
        if args.labels != "rollout":
            p.error("--rollout-depth needs --labels rollout")
        if args.rollout_depth < 1:
            p.error(f"--rollout-depth must be >= 1, got {args.rollout_depth}")
    if getattr(args, "consistent_labels", False) and args.labels != "target":
        p.error("--consistent-labels needs --labels target (it masks the target's labels)")
    if getattr(args, "distill", 0.0) and not 0.0 <= args.distill <= 1.0:
        p.error(f"--distill must be in [0, 1], got {args.distill}")
    try:
        args.func(args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
