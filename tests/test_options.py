"""DFLASH_X's own options: parsing, validation against the block, and the env hand-off."""

from __future__ import annotations

import argparse

import pytest

from dflash_sglang import options
from dflash_sglang.options import SpecOptions


def _parse(*argv: str) -> SpecOptions:
    parser = argparse.ArgumentParser()
    options.add_cli_args(parser.add_argument_group())
    return options.from_cli(parser.parse_args(list(argv)))


def test_defaults_adapt_and_look_up_suffixes():
    opts = _parse()
    assert opts.adaptive and opts.suffix
    assert opts.candidate_widths(16) == (1, 2, 4, 8, 16)
    assert opts.candidate_widths(4) == (1, 2, 4)
    assert opts.max_proposal(16) == 15


def test_fixed_width_is_the_block_alone():
    assert _parse("--dflash-adaptive", "off").candidate_widths(16) == (16,)


def test_flags_round_trip_through_the_environment():
    opts = _parse(
        "--dflash-adaptive=off",
        "--dflash-widths=1,3",
        "--dflash-suffix=off",
        "--dflash-suffix-max-match=3",
        "--dflash-suffix-max-proposal=5",
        "--dflash-explore-every=0",
        "--dflash-explore-budget=0.25",
        "--dflash-defer-injection=0",
        "--dflash-prompt-vocab=0",
    )
    assert SpecOptions.from_env(opts.to_env()) == opts
    assert opts.defer_rows == 0 and SpecOptions().defer_rows > 0
    assert opts.prompt_vocab == 0 and SpecOptions().prompt_vocab > 0
    shared = _parse("--dflash-suffix-shared=4096")
    assert SpecOptions.from_env(shared.to_env()) == shared
    assert SpecOptions.from_env(_parse().to_env()) == SpecOptions()
    assert SpecOptions.from_env({}) == SpecOptions()


def test_upstream_kernels_survive_the_environment():
    opts = _parse("--dflash-kernels", "upstream")
    assert opts.kernels == "upstream" and SpecOptions.from_env(opts.to_env()) == opts
    assert SpecOptions().kernels == "ours"


def test_suffix_always_implies_on_and_survives_the_environment():
    opts = _parse("--dflash-suffix", "always")
    assert opts.suffix and opts.suffix_always
    assert SpecOptions.from_env(opts.to_env()) == opts


def test_tree_option_defaults_off_and_reaches_the_workers():
    assert _parse().tree == "off"
    opts = _parse("--dflash-tree", "always")
    assert SpecOptions.from_env(opts.to_env()).tree == "always"


def test_explicit_widths_are_sorted_and_deduplicated():
    assert _parse("--dflash-widths", "4,1,4,2").candidate_widths(8) == (1, 2, 4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dflash-widths", "0,2"], "--dflash-widths must be integers >= 1"),
        (["--dflash-widths", "a"], "--dflash-widths takes comma-separated integers"),
        (["--dflash-suffix-max-proposal", "-1"], "--dflash-suffix-max-proposal must be >= 1"),
        (["--dflash-explore-every", "-1"], "--dflash-explore-every must be >= 0"),
        (["--dflash-explore-budget", "2"], "--dflash-explore-budget must be in [0, 1]"),
        (["--dflash-explore-budget", "x"], "--dflash-explore-budget takes a number"),
        (["--dflash-explore-budget", "nan"], "--dflash-explore-budget must be in [0, 1]"),
        (["--dflash-suffix-shared", "1"], "--dflash-suffix-shared must be 0 (off) or >= 2"),
        (["--dflash-suffix-shared", "x"], "--dflash-suffix-shared takes an integer"),
        (["--dflash-kernels", "mine"], "--dflash-kernels: invalid choice: 'mine'"),
        (["--dflash-defer-injection", "-5"], "--dflash-defer-injection must be >= 0"),
        (["--dflash-prompt-vocab", "-1"], "--dflash-prompt-vocab must be >= 0"),
        (["--dflash-tree", "yes"], "--dflash-tree: invalid choice: 'yes'"),
    ],
)
def test_bad_values_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert message in capsys.readouterr().err


def test_checks_against_the_block_size_name_the_flag():
    with pytest.raises(ValueError, match="--dflash-widths 32 exceeds the block size 16"):
        _parse("--dflash-widths", "1,32").check(16)
    with pytest.raises(ValueError, match="--dflash-suffix-max-proposal 16 exceeds"):
        _parse("--dflash-suffix-max-proposal", "16").check(16)
    _parse("--dflash-widths", "1,16", "--dflash-suffix-max-proposal", "15").check(16)


def test_shared_lookup_is_on_with_the_suffix_source_and_needs_it():
    assert _parse().shared_tokens == options.DEFAULT_SHARED_TOKENS == SpecOptions().shared_tokens
    assert _parse("--dflash-suffix-shared", "0").shared_tokens == 0
    assert _parse("--dflash-suffix", "off").shared_tokens == 0
    assert SpecOptions(suffix=False).shared_tokens == 0
    with pytest.raises(ValueError, match="--dflash-suffix-shared needs --dflash-suffix on"):
        _parse("--dflash-suffix", "off", "--dflash-suffix-shared", "4096")
    assert _parse("--dflash-suffix", "always", "--dflash-suffix-shared", "4096").shared_tokens
    off = _parse("--dflash-suffix-shared", "0")
    assert SpecOptions.from_env(off.to_env()) == off


def test_warm_corpus_needs_the_shared_lookup_and_none_starts_cold():
    assert _parse().suffix_warm == "" == _parse("--dflash-suffix-warm", "none").suffix_warm
    warm = _parse("--dflash-suffix-warm", "/data/past.jsonl.gz")
    assert warm.suffix_warm == "/data/past.jsonl.gz"
    assert SpecOptions.from_env(warm.to_env()) == warm
    for cold in (("--dflash-suffix-shared", "0"), ("--dflash-suffix", "off")):
        with pytest.raises(ValueError, match="--dflash-suffix-warm needs the shared suffix"):
            _parse(*cold, "--dflash-suffix-warm", "/data/past.jsonl.gz")
        assert _parse(*cold, "--dflash-suffix-warm", "none").suffix_warm == ""
