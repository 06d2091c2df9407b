"""DFLASH_X's own serving options: adaptive verify width and the suffix-lookup source.

The launcher parses and validates them (errors name the flag) and hands them to the
scheduler processes SGLang spawns through the environment, the one channel that reaches
every process without changing SGLang's `ServerArgs`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

ENV_PREFIX = "DFLASH_SGLANG_"
DEFAULT_BLOCK_SIZE = 16  # a drafter whose config names none; fresh drafters in training
DEFAULT_WIDTHS = (1, 2, 4, 8)  # plus the block size
# Every step drafts and verifies the whole block: what measures a drafter's own τ.
PURE_DFLASH_ARGS = ("--dflash-adaptive", "off", "--dflash-suffix", "off")
# Tokens of finished outputs the shared suffix lookup holds (~45 MB of n-gram table).
DEFAULT_SHARED_TOKENS = 262144
# Committed rows whose draft-KV injection may wait for one batched write (CPU): 1.5 MB of
# bf16 features for the embedded pair (256 x 2,880 x 2 bytes).
DEFAULT_DEFER_ROWS = 4096
# A request's own prompt tokens a restricted draft vocabulary takes in (`draft_vocab.prompt_extra`).
DEFAULT_PROMPT_VOCAB = 256


@dataclass(frozen=True)
class SpecOptions:
    adaptive: bool = True
    widths: tuple[int, ...] | None = None  # None: DEFAULT_WIDTHS + block size
    suffix: bool = True
    suffix_always: bool = False  # take a suffix proposal whenever one exists
    suffix_max_match: int = 4
    suffix_max_proposal: int | None = None  # None: block size - 1
    suffix_shared: int = DEFAULT_SHARED_TOKENS  # recent outputs the shared lookup holds; 0: off
    suffix_warm: str = ""  # a corpus (`suffix_corpus`) the shared lookup starts from; "": cold
    explore_every: int = 25  # planner steps between exploratory widths; 0: never
    explore_budget: float = 0.01  # share of step time exploration may add
    kernels: str = "ours"  # GPU: our Triton KV injection and acceptance, or "upstream"
    defer_rows: int = DEFAULT_DEFER_ROWS  # CPU: draft-KV rows held until read, at most; 0: off
    prompt_vocab: int = DEFAULT_PROMPT_VOCAB  # prompt tokens joining a restricted vocab; 0: off
    tree: str = "off"  # two-branch trees (DFlash + suffix): "on", "off", "always" (comparisons)

    def candidate_widths(self, block_size: int) -> tuple[int, ...]:
        """Verify widths the controller may pick; fixed width = the block alone."""
        if not self.adaptive:
            return (block_size,)
        widths = self.widths or (*DEFAULT_WIDTHS, block_size)
        return tuple(sorted({w for w in widths if w <= block_size}))

    def max_proposal(self, block_size: int) -> int:
        return min(self.suffix_max_proposal or block_size - 1, block_size - 1)

    @property
    def shared_tokens(self) -> int:
        """The shared lookup's size, 0 when off: it is part of the suffix source."""
        return self.suffix_shared if self.suffix else 0

    def check(self, block_size: int) -> None:
        """Errors that need the block size, which only the draft checkpoint knows."""
        for w in self.widths or ():
            if w > block_size:
                raise ValueError(f"--dflash-widths {w} exceeds the block size {block_size}")
        if self.suffix_max_proposal is not None and self.suffix_max_proposal > block_size - 1:
            raise ValueError(
                f"--dflash-suffix-max-proposal {self.suffix_max_proposal} exceeds the block "
                f"size - 1 ({block_size - 1})"
            )

    def to_env(self) -> dict[str, str]:
        return {
            ENV_PREFIX + "ADAPTIVE": _on_off(self.adaptive),
            ENV_PREFIX + "WIDTHS": ",".join(map(str, self.widths or ())),
            ENV_PREFIX + "SUFFIX": "always" if self.suffix_always else _on_off(self.suffix),
            ENV_PREFIX + "SUFFIX_MAX_MATCH": str(self.suffix_max_match),
            ENV_PREFIX + "SUFFIX_MAX_PROPOSAL": str(self.suffix_max_proposal or ""),
            ENV_PREFIX + "SUFFIX_SHARED": str(self.suffix_shared),
            ENV_PREFIX + "SUFFIX_WARM": self.suffix_warm,
            ENV_PREFIX + "EXPLORE_EVERY": str(self.explore_every),
            ENV_PREFIX + "EXPLORE_BUDGET": repr(self.explore_budget),
            ENV_PREFIX + "KERNELS": self.kernels,
            ENV_PREFIX + "DEFER_ROWS": str(self.defer_rows),
            ENV_PREFIX + "PROMPT_VOCAB": str(self.prompt_vocab),
            ENV_PREFIX + "TREE": self.tree,
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SpecOptions:
        def get(name: str) -> str:
            return env.get(ENV_PREFIX + name, "")

        default = cls()
        return cls(
            adaptive=get("ADAPTIVE") != "off" if get("ADAPTIVE") else default.adaptive,
            widths=parse_widths(get("WIDTHS")) if get("WIDTHS") else None,
            suffix=get("SUFFIX") != "off" if get("SUFFIX") else default.suffix,
            suffix_always=get("SUFFIX") == "always",
            suffix_max_match=int(get("SUFFIX_MAX_MATCH") or default.suffix_max_match),
            suffix_max_proposal=int(get("SUFFIX_MAX_PROPOSAL") or 0) or None,
            suffix_shared=int(get("SUFFIX_SHARED") or default.suffix_shared),
            suffix_warm=get("SUFFIX_WARM"),
            explore_every=int(get("EXPLORE_EVERY") or default.explore_every),
            explore_budget=float(get("EXPLORE_BUDGET") or default.explore_budget),
            kernels=get("KERNELS") or default.kernels,
            defer_rows=int(get("DEFER_ROWS") or default.defer_rows),
            prompt_vocab=int(get("PROMPT_VOCAB") or default.prompt_vocab),
            tree=get("TREE") or default.tree,
        )


def _on_off(value: bool) -> str:
    return "on" if value else "off"


def parse_widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise ValueError(f"--dflash-widths takes comma-separated integers, got {text!r}") from None
    if not widths or min(widths) < 1:
        raise ValueError(f"--dflash-widths must be integers >= 1, got {text!r}")
    return widths


def at_least(flag: str, low: int):
    """An argparse type: an integer >= `low`, a bad one named by its `flag`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {low}, got {value}")
        return value

    return parse


def number(flag: str, low: float, high: float | None = None):
    """An argparse type: a number >= `low` (and <= `high`), a bad one named by its `flag`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a number, got {text!r}") from None
        if not (value >= low and (high is None or value <= high)):  # NaN fails too
            bound = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{flag} must be {bound}, got {text}")
        return value

    return parse


def _positive(flag: str):
    return at_least(flag, 1)


def _non_negative(flag: str):
    return at_least(flag, 0)


def _shared_capacity(text: str) -> int:
    value = _non_negative("--dflash-suffix-shared")(text)
    if value == 1:
        raise argparse.ArgumentTypeError("--dflash-suffix-shared must be 0 (off) or >= 2 tokens")
    return value


def _shared_tokens(value: int | None, suffix: str) -> int:
    """The default follows --dflash-suffix; asking for the shared lookup without the suffix
    source is a contradiction, not something to ignore."""
    if value is None:
        return DEFAULT_SHARED_TOKENS if suffix != "off" else 0
    if value and suffix == "off":
        raise ValueError("--dflash-suffix-shared needs --dflash-suffix on (or always)")
    return value


def _suffix_warm(value: str | None, shared_tokens: int) -> str:
    """A corpus path, "" for a cold start ("none"); given explicitly it needs the shared
    lookup it fills. An unset flag stays "": the launcher picks the bundled corpus for the
    embedded target (`launch_server.with_default_corpus`)."""
    if value is None or value == "none":
        return ""
    if not shared_tokens:
        raise ValueError(
            "--dflash-suffix-warm needs the shared suffix lookup (--dflash-suffix on and "
            "--dflash-suffix-shared > 0)"
        )
    return value


def _widths_arg(text: str) -> tuple[int, ...]:
    try:
        return parse_widths(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_cli_args(group: argparse._ArgumentGroup) -> None:
    _add_width_args(group)
    _add_suffix_args(group)
    _add_step_args(group)


def _add_width_args(group: argparse._ArgumentGroup) -> None:
    """How wide the target verifies, and how the planner measures the widths it skips."""
    group.add_argument(
        "--dflash-adaptive",
        choices=("on", "off"),
        default="on",
        help="pick the verify width each step from measured acceptance and step cost; "
        "width 1 is plain decoding (default on; off verifies the whole block every step)",
    )
    group.add_argument(
        "--dflash-widths",
        type=_widths_arg,
        default=None,
        help="candidate verify widths, comma-separated (default 1,2,4,8 and the block size)",
    )
    group.add_argument(
        "--dflash-explore-every",
        type=_non_negative("--dflash-explore-every"),
        default=SpecOptions.explore_every,
        help="at most every N steps the adaptive planner tries a neighbouring width, when "
        "its exploration budget covers it, so its cost model and acceptance estimates stay "
        "current (default %(default)s; 0: never)",
    )
    group.add_argument(
        "--dflash-explore-budget",
        type=number("--dflash-explore-budget", 0.0, 1.0),
        default=SpecOptions.explore_budget,
        help="the share of step time exploring steps may add (default 0.01; 1: explore "
        "every --dflash-explore-every steps whatever it costs)",
    )


def _add_suffix_args(group: argparse._ArgumentGroup) -> None:
    """The lookups that propose beside the DFlash block."""
    group.add_argument(
        "--dflash-suffix",
        choices=("on", "off", "always"),
        default="on",
        help="also propose the continuation of the longest earlier match of the text so far "
        "(prompt + output), per request, when it is expected to beat the DFlash block "
        "(default on; always: whenever a match exists, for comparisons)",
    )
    group.add_argument(
        "--dflash-suffix-max-match",
        type=_positive("--dflash-suffix-max-match"),
        default=4,
        help="longest suffix looked up, in tokens (default 4)",
    )
    group.add_argument(
        "--dflash-suffix-max-proposal",
        type=_positive("--dflash-suffix-max-proposal"),
        default=None,
        help="most tokens a suffix proposal offers (default: block size - 1)",
    )
    group.add_argument(
        "--dflash-suffix-shared",
        type=_shared_capacity,
        default=None,
        metavar="TOKENS",
        help="also look suffixes up in the outputs of recently finished requests, holding "
        f"the last TOKENS/2 to TOKENS tokens, ~180 bytes each (default {DEFAULT_SHARED_TOKENS} "
        "with --dflash-suffix on; 0: off)",
    )
    group.add_argument(
        "--dflash-suffix-warm",
        default=None,
        metavar="PATH",
        help="fill the shared suffix lookup at start-up from past requests and their outputs: "
        "JSONL(.gz) of prompt_ids/response_ids (token ids, as `training generate` writes) or "
        "prompt/response text (default: the bundled corpus when serving the embedded default "
        "model, else none; none: start cold)",
    )


def _add_step_args(group: argparse._ArgumentGroup) -> None:
    """What one step runs: kernels, draft-KV injection, the draft vocabulary, trees."""
    group.add_argument(
        "--dflash-kernels",
        choices=("ours", "upstream"),
        default="ours",
        help="on GPU: our Triton KV injection and acceptance kernels (dflash_sglang.kernels), "
        "or upstream SGLang's (default ours; CPU always runs torch paths)",
    )
    group.add_argument(
        "--dflash-defer-injection",
        type=_non_negative("--dflash-defer-injection"),
        default=DEFAULT_DEFER_ROWS,
        metavar="ROWS",
        help="on CPU, committed tokens' draft-KV rows are held until read: written before "
        "the drafter next runs for their request or a prefill's radix-cached prefix covers "
        "them; rows of finished requests not read by then are dropped once ROWS are held "
        f"(default {DEFAULT_DEFER_ROWS}; 0: inject every step, as on GPU, where injection "
        "is one fused kernel)",
    )
    group.add_argument(
        "--dflash-prompt-vocab",
        type=_non_negative("--dflash-prompt-vocab"),
        default=DEFAULT_PROMPT_VOCAB,
        metavar="N",
        help="a drafter with a restricted vocabulary also proposes up to N of each "
        "request's own prompt tokens outside it (names, identifiers a reply copies; "
        f"default {DEFAULT_PROMPT_VOCAB}; 0: the checkpoint's vocabulary alone)",
    )
    group.add_argument(
        "--dflash-tree",
        choices=("on", "off", "always"),
        default="off",
        help="when a request has both a DFlash block and a suffix proposal, let the planner "
        "verify both as two branches of one tree and keep the one the target follows "
        "further (default off: on this project's CPU it did not pay; always: every such "
        "request on drafting steps, for comparisons; CPU only for now, ignored on GPU)",
    )


def from_cli(ns: argparse.Namespace) -> SpecOptions:
    shared = _shared_tokens(ns.dflash_suffix_shared, ns.dflash_suffix)
    return SpecOptions(
        adaptive=ns.dflash_adaptive == "on",
        widths=ns.dflash_widths,
        suffix=ns.dflash_suffix != "off",
        suffix_always=ns.dflash_suffix == "always",
        suffix_max_match=ns.dflash_suffix_max_match,
        suffix_max_proposal=ns.dflash_suffix_max_proposal,
        suffix_shared=shared,
        suffix_warm=_suffix_warm(ns.dflash_suffix_warm, shared),
        explore_every=ns.dflash_explore_every,
        explore_budget=ns.dflash_explore_budget,
        kernels=ns.dflash_kernels,
        defer_rows=ns.dflash_defer_injection,
        prompt_vocab=ns.dflash_prompt_vocab,
        tree=ns.dflash_tree,
    )
