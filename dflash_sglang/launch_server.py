"""`python -m dflash_sglang.launch_server`: SGLang's server with DFLASH_X and our defaults.

Every SGLang server argument passes through unchanged. Added defaults (each only when the
flag is absent): `--speculative-algorithm DFLASH_X` (when a draft is given), `--enable-metrics`,
`--host 127.0.0.1`, `--device` from the machine, the platform's attention backend, and on
CPU the target's decode/verify/prefill forward compiled (`--dflash-cpu-compile`), `--sleep-on-idle`
and `--max-total-tokens` sized for 8 full contexts of target + draft KV
within 25% of host RAM (SGLang's own CPU default takes ~70% of RAM; `--mem-fraction-static`
or `--max-total-tokens` given explicitly wins).
`$DFLASH_API_KEY` (or the file `$DFLASH_API_KEY_FILE` names), when set, becomes `--api-key`
(so a secret never sits in argv or `ps`): every route then needs `Authorization: Bearer KEY`
except `/health*` and `/metrics` (SGLang's rule, for probes and scrapers); the `/dflash/`
page and stats need it too.
Without `--model-path` it serves the embedded default target (and its shared suffix lookup
starts from the bundled corpus of its own replies). Draft/target mismatches fail
here, before any process is spawned.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from dflash_sglang import ALGORITHM, platform
from dflash_sglang import options as spec_options

logger = logging.getLogger("dflash_sglang.launch_server")

NO_SPECULATION = "NONE"
# A key from the environment (a Kubernetes or compose secret) stays out of argv and `ps`.
API_KEY_ENV = "DFLASH_API_KEY"
API_KEY_FILE_ENV = "DFLASH_API_KEY_FILE"
SECRET_FLAGS = ("--api-key", "--admin-api-key")


class LaunchError(SystemExit):
    """A bad launch: printed as `error: ...` with exit status 2, like argparse."""

    def __init__(self, message: str) -> None:
        print(f"dflash_sglang.launch_server: error: {message}", file=sys.stderr)
        super().__init__(2)


def our_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_sglang.launch_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    group = parser.add_argument_group("dflash_sglang options")
    group.add_argument("-h", "--help", action="store_true", help="show this help and SGLang's")
    group.add_argument(
        "--dflash-cache-dir",
        default=None,
        help="where the embedded default model is converted and cached "
        "(default: $DFLASH_SGLANG_CACHE or ~/.cache/dflash_sglang)",
    )
    group.add_argument(
        "--dflash-cpu-compile",
        choices=("on", "target", "off"),
        default="on",
        help="CPU: run the target's decode, verify and prefill forwards and the DFlash drafter's "
        "block forward compiled by torch.compile (target: the target's only; Llama-"
        "architecture targets, SGLang's DFlashDraftModel, one rank; compiled during "
        "start-up; default: on)",
    )
    group.add_argument(
        "--dflash-cpu-freeze",
        choices=("on", "off"),
        default="on",
        help="CPU: with --dflash-cpu-compile, compile the forwards with their weights as "
        "constants, which inductor prepacks for oneDNN (bf16 GEMMs ~2x faster at decode "
        "sizes); online weight updates are then refused (default: on)",
    )
    group.add_argument(
        "--dflash-cpu-attention",
        choices=("paged", "grouped", "sdpa"),
        default="paged",
        help="CPU: attention of batches with at most 8 query rows per request (decode, "
        "narrow verify). paged: our C++ kernel reading K/V straight from the pool (AVX-512; "
        "built on first use, ~30 s; grouped where it cannot be built); grouped: grouped "
        "matmuls over gathered K/V; sdpa: SDPA for every batch (default: paged)",
    )
    group.add_argument(
        "--dflash-cpu-arena-cache",
        choices=("on", "off"),
        default="on",
        help="CPU: keep a few freed blocks of CPython's frame stack and object arenas for "
        "reuse instead of unmapping them (a hot call at a chunk boundary otherwise maps and "
        "page-faults 16 KiB each time; C, built on first use, ~2 s; default: on)",
    )
    spec_options.add_cli_args(group)
    return parser


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """Value of `--flag v` or `--flag=v` in an argument list (last one wins, as argparse)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def has_flag(args: Sequence[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def without_flag(args: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def with_api_key_from(env: dict[str, str], args: list[str]) -> list[str]:
    """`--api-key` from $DFLASH_API_KEY or the file $DFLASH_API_KEY_FILE names (a mounted
    secret) when the flag is absent; an empty or unreadable key is an error."""
    if has_flag(args, "--api-key") or not ({API_KEY_ENV, API_KEY_FILE_ENV} & env.keys()):
        return args
    source = f"${API_KEY_ENV}"
    key = env.get(API_KEY_ENV, "")
    if API_KEY_FILE_ENV in env:
        source = f"${API_KEY_FILE_ENV} ({env[API_KEY_FILE_ENV]})"
        try:
            key = Path(env[API_KEY_FILE_ENV]).read_text()
        except OSError as e:
            raise LaunchError(f"{source} cannot be read: {e.strerror}") from e
    if not key.strip():
        raise LaunchError(f"{source} gives an empty API key: unset it or give a key")
    return [*args, "--api-key", key.strip()]


def secret_values(args: Sequence[str]) -> list[str]:
    """The values of the secret flags in an argument list."""
    values = [b for a, b in zip(args, args[1:], strict=False) if a in SECRET_FLAGS]
    values += [a.split("=", 1)[1] for a in args if a.split("=", 1)[0] in SECRET_FLAGS and "=" in a]
    return [v for v in values if v]


def hide_in_logs(secrets: list[str]) -> None:
    """Mask `secrets` in every log record of this process: SGLang logs its whole
    `server_args`, API key included, at start-up."""
    if not secrets:
        return
    make_record = logging.getLogRecordFactory()

    def masked(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        message = record.getMessage()
        if any(s in message for s in secrets):
            for s in secrets:
                message = message.replace(s, "***")
            record.msg, record.args = message, None
        return record

    logging.setLogRecordFactory(masked)


def platform_of(device: str | None) -> platform.Platform:
    try:
        return platform.for_device(device)
    except ValueError as e:
        raise LaunchError(str(e)) from e


def resolve_args(
    args: list[str], device: str, default_target: str | None, default_draft: str | None
) -> list[str]:
    """SGLang arguments with our defaults applied; pure so it can be tested without a server."""
    args = list(args)
    if not has_flag(args, "--device"):
        args += ["--device", device]
    if not has_flag(args, "--model-path", "--model"):
        if default_target is None:
            raise LaunchError("no --model-path given and no embedded default model available")
        args += ["--model-path", default_target]
        if not has_flag(args, "--speculative-draft-model-path", "--speculative-draft-model"):
            if default_draft is not None:
                args += ["--speculative-draft-model-path", default_draft]
    algorithm = (flag_value(args, "--speculative-algorithm") or "").upper()
    has_draft = has_flag(args, "--speculative-draft-model-path", "--speculative-draft-model")
    if algorithm == NO_SPECULATION:
        args = without_flag(args, "--speculative-algorithm")
        args = without_flag(args, "--speculative-draft-model-path")
        args = without_flag(args, "--speculative-draft-model")
    elif not algorithm and has_draft:
        args += ["--speculative-algorithm", ALGORITHM]
    if not has_flag(args, "--enable-metrics"):
        args.append("--enable-metrics")
    if not has_flag(args, "--host"):
        args += ["--host", "127.0.0.1"]
    plat = platform_of(flag_value(args, "--device"))
    if not has_flag(args, "--attention-backend"):
        args += ["--attention-backend", plat.attention_backend]
    if plat.sleep_on_idle and not has_flag(args, "--sleep-on-idle"):
        args.append("--sleep-on-idle")
    return args


def model_paths(args: Sequence[str]) -> tuple[str | None, str | None]:
    """Target and draft paths, under either spelling of their flags."""
    target = flag_value(args, "--model-path") or flag_value(args, "--model")
    draft = flag_value(args, "--speculative-draft-model-path") or flag_value(
        args, "--speculative-draft-model"
    )
    return target, draft


def check_models(args: Sequence[str], options: spec_options.SpecOptions) -> None:
    """Fail fast on a draft that cannot serve with its target, or options that do not fit it."""
    from dflash_sglang.checkpoint import CheckpointError, check_pair, read_config

    target, draft = model_paths(args)
    try:
        read_config(target, "target")
        if (flag_value(args, "--speculative-algorithm") or "").upper() == ALGORITHM:
            if draft is None:
                raise CheckpointError(f"{ALGORITHM} needs --speculative-draft-model-path")
            info = check_pair(target, draft)
            options.check(block_size_of(args, info.block_size))
    except (CheckpointError, ValueError) as e:
        raise LaunchError(str(e)) from e


def with_default_corpus(options: spec_options.SpecOptions) -> spec_options.SpecOptions:
    """Serving the embedded target, the shared suffix lookup starts from its bundled corpus
    (its own replies to ShareGPT prompts), as if it had served those requests already."""
    from dflash_sglang import suffix_corpus

    corpus = suffix_corpus.bundled()
    if corpus is None or not options.shared_tokens:
        return options
    return dataclasses.replace(options, suffix_warm=str(corpus))


def checked_corpus(options: spec_options.SpecOptions) -> spec_options.SpecOptions:
    """Read the warm-start corpus once here, so a bad one fails the launch naming the flag
    rather than a scheduler process; the path goes on absolute."""
    from dflash_sglang import suffix_corpus

    if not options.suffix_warm:
        return options
    try:
        suffix_corpus.read(options.suffix_warm)
    except suffix_corpus.CorpusError as e:
        raise LaunchError(f"--dflash-suffix-warm: {e}") from e
    return dataclasses.replace(options, suffix_warm=str(Path(options.suffix_warm).resolve()))


def host_replicas(env: dict[str, str]) -> int:
    """Servers sharing this host (`DFLASH_HOST_REPLICAS`, set by `dflash_sglang.cluster`):
    the default KV pool takes its share of RAM divided by them."""
    text = env.get("DFLASH_HOST_REPLICAS", "1")
    if not text.isdigit() or int(text) < 1:
        raise LaunchError(f"DFLASH_HOST_REPLICAS must be a positive integer, got {text!r}")
    return int(text)


def with_cpu_kv_pool(args: list[str]) -> list[str]:
    """`--max-total-tokens` from the models' KV size and context, unless the pool is given."""
    import psutil

    from dflash_sglang.checkpoint import read_config
    from dflash_sglang.cpu_platform import kv_pool

    if has_flag(args, "--max-total-tokens", "--mem-fraction-static"):
        return args
    target_path, draft_path = model_paths(args)
    target = read_config(target_path, "target")
    draft = read_config(draft_path, "draft") if has_flag(args, "--speculative-algorithm") else None
    text = target.get("text_config") or target
    context = flag_value(args, "--context-length") or text.get("max_position_embeddings")
    if not str(context).isdigit():
        return args  # SGLang's own parser names a bad --context-length; no default without one
    context = int(context)
    dtype = flag_value(args, "--kv-cache-dtype")
    dtype = dtype if dtype not in (None, "auto") else flag_value(args, "--dtype")
    host_ram = psutil.virtual_memory().total // host_replicas(dict(os.environ))
    tokens = kv_pool.default_max_total_tokens(
        target, draft, context, kv_pool.dtype_bytes(dtype, target), host_ram
    )
    logger.info("CPU KV pool: --max-total-tokens %d (pass it to choose another size)", tokens)
    return [*args, "--max-total-tokens", str(tokens)]


def block_size_of(args: Sequence[str], draft_block_size: int | None) -> int:
    """The block size `spec.resolve_block_size` will settle on, from the argument list."""
    for flag in ("--speculative-dflash-block-size", "--speculative-num-draft-tokens"):
        value = flag_value(args, flag)
        if value is not None:
            return int(value)
    return draft_block_size or spec_options.DEFAULT_BLOCK_SIZE


def print_help() -> None:
    our_parser().print_help()
    print("\nSGLang server arguments (all accepted unchanged):\n")
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="python -m dflash_sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    parser.print_help()


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ours, sglang_args = our_parser().parse_known_args(argv)
    device = flag_value(sglang_args, "--device") or platform.detect_device()
    on_cpu = platform_of(device) is platform.CPU
    if on_cpu:
        from dflash_sglang import cpu_platform

        os.environ.update(cpu_platform.child_environment(dict(os.environ)))
        os.environ[cpu_platform.COMPILE_ENV] = ours.dflash_cpu_compile
        os.environ[cpu_platform.FREEZE_ENV] = ours.dflash_cpu_freeze
        os.environ[cpu_platform.ATTENTION_ENV] = ours.dflash_cpu_attention
        os.environ[cpu_platform.ARENA_CACHE_ENV] = ours.dflash_cpu_arena_cache
        cpu_platform.install_sgl_kernel_shim()
        if ours.dflash_cpu_attention == "paged" and not ours.help:
            from dflash_sglang.kernels import cpu_attention

            cpu_attention.available()  # build once here, not in every scheduler at once
        if ours.dflash_cpu_arena_cache == "on" and not ours.help:
            from dflash_sglang.kernels import arena_cache

            arena_cache.install()  # built here once; this process gains from it too
    if ours.help:
        print_help()
        return

    default_target = default_draft = None
    if not has_flag(sglang_args, "--model-path", "--model"):
        from dflash_sglang import default_model
        from dflash_sglang.drafters import default_draft_dir

        cache = Path(ours.dflash_cache_dir) if ours.dflash_cache_dir else None
        default_target = str(default_model.ensure_default_target(cache, log=logger.info))
        default_draft = default_draft_dir()
        if default_draft is None:
            logger.info(
                "No default drafter is bundled yet: serving the embedded target without "
                "speculative decoding. Pass --speculative-draft-model-path to use DFLASH_X."
            )
    args = resolve_args(sglang_args, device, default_target, default_draft)
    args = with_api_key_from(dict(os.environ), args)
    try:
        options = spec_options.from_cli(ours)
    except ValueError as e:
        raise LaunchError(str(e)) from e
    if ours.dflash_suffix_warm is None and default_target is not None:
        options = with_default_corpus(options)
    options = checked_corpus(options)
    check_models(args, options)
    if on_cpu:
        args = with_cpu_kv_pool(args)
    os.environ.update(options.to_env())  # read by the worker in every scheduler process

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    from sglang.srt.entrypoints.http_server import app

    from dflash_sglang import server

    server.install(app)
    hide_in_logs(secret_values(args))
    logger.info("launching SGLang: %s", " ".join(args))
    serve(lambda: run_server(prepare_server_args(args)))


def serve(run: Callable[[], None]) -> None:
    """Run SGLang; however it ends, end its children too, and exit non-zero on a failure.

    Without this a scheduler that dies at start-up (e.g. OOM-killed) leaves the launcher
    waiting on its still-running detokenizer forever: alive, not listening, never restarted
    by a supervisor.
    """
    from sglang.srt.utils import kill_process_tree

    status = 0
    try:
        run()
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException as e:  # noqa: BLE001 - any failure must end the process tree
        logger.error("dflash_sglang.launch_server: SGLang stopped: %r", e)
        status = 1
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    if status:
        logging.shutdown()
        os._exit(status)  # non-daemon threads of a half-started server must not hold us


if __name__ == "__main__":
    main()
