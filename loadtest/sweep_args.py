"""The sweep's command line: every flag checked up front, each error naming its flag."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from . import prompt_sets
from .server_probe import ServerUnreachable, served_model


def concurrency_list(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise argparse.ArgumentTypeError(
            f"expected distinct positive integers separated by commas (1,2,4), got {text!r}"
        )
    return sorted(levels)


def request_count(text: str) -> tuple[int, bool]:
    """`N` requests per level, or `Nx`: N per user (N × concurrency)."""
    per_user = text.endswith("x")
    try:
        n = int(text[:-1] if per_user else text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected N or Nx with N >= 1 (16, 4x), got {text!r}")
    return n, per_user


def _checked(kind: type[int] | type[float], is_ok: Callable[[Any], bool], expected: str):
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not is_ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_int = _checked(int, lambda v: v >= 1, "an integer >= 1")
non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
positive_seconds = _checked(float, lambda v: 0 < v < math.inf, "a finite number > 0")


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def http_url(text: str) -> str:
    parsed = urlparse(text)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise argparse.ArgumentTypeError(f"expected http(s)://host:port, got {text!r}")
    return text.rstrip("/")


def labelled_url(text: str) -> tuple[str, str]:
    """`LABEL=URL`: one more server under test (e.g. DFLASH_X with other flags)."""
    label, sep, url = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"expected LABEL=http(s)://host:port, got {text!r}")
    return label, http_url(url)


def build_parser(description: str = "") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.sweep",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", type=http_url, required=True, help="the server under test")
    p.add_argument("--baseline-url", type=http_url, help="same model, no speculation")
    p.add_argument("--label", default="dflash", help="name of --url in the report")
    p.add_argument("--baseline-label", default="baseline", help="name of --baseline-url")
    p.add_argument(
        "--also",
        type=labelled_url,
        action="append",
        default=[],
        metavar="LABEL=URL",
        help="another server under test, measured in turn with the others (repeatable)",
    )
    p.add_argument(
        "--concurrency",
        type=concurrency_list,
        default=[1, 2, 4, 8, 16, 32],
        help="users per level, comma-separated (default 1,2,4,8,16,32)",
    )
    p.add_argument(
        "--requests-per-level",
        type=request_count,
        default=(4, True),
        help="N requests per level, or Nx = N per user (default 4x)",
    )
    p.add_argument("--max-tokens", type=positive_int, default=128, help="per request (default 128)")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request emits exactly --max-tokens (SGLang `ignore_eos`)",
    )
    p.add_argument(
        "--extra-body",
        type=json_object,
        default={},
        help="JSON object merged into every request body",
    )
    p.add_argument(
        "--dataset",
        choices=prompt_sets.CHOICES,
        default="mt_bench",
        help="real prompts: MT-Bench, HumanEval, ShareGPT, ASDiv math, XSum summaries, or all "
        "of them alternating",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=positive_int,
        default=4000,
        help="skip longer prompts (default 4000)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompt order (default 0)")
    p.add_argument("--model", help="request `model` (default: each server's GET /v1/models)")
    p.add_argument(
        "--warmup-requests",
        type=non_negative_int,
        default=1,
        help="unmeasured requests per server before the sweep (default 1)",
    )
    p.add_argument(
        "--max-seconds-per-level",
        type=positive_seconds,
        default=600.0,
        help="time limit of each server's run at each level (default 600)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("loadtest-results"),
        help="output directory (default loadtest-results)",
    )
    return p


def parse_args(argv: list[str] | None = None, description: str = "") -> argparse.Namespace:
    """Parse, then fail before any load if a server does not answer. Adds `servers`:
    {label: (url, model)}, the server under test first, `--also` servers next, the
    baseline last."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    named = [("--url", args.label, args.url)]
    named += [("--also", label, url) for label, url in args.also]
    if args.baseline_url:
        named.append(("--baseline-url", args.baseline_label, args.baseline_url))
    for i, (flag, label, url) in enumerate(named):
        for earlier_flag, earlier_label, earlier_url in named[:i]:
            if url == earlier_url:
                parser.error(f"{flag} must differ from {earlier_flag} (both {url})")
            if label == earlier_label:
                parser.error(f"{flag}: label {label!r} is taken by {earlier_flag}")
    args.servers = {}
    for flag, label, url in named:
        try:
            served = served_model(url)  # also: fail now if nothing answers
        except ServerUnreachable as e:
            parser.error(f"{flag} {url}: {e}")
        args.servers[label] = (url, args.model or served)
    return args
