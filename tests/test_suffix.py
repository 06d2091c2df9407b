from __future__ import annotations

import random

import pytest

from dflash_sglang.suffix import (
    SharedSuffixIndex,
    SuffixIndex,
    SuffixProposal,
    better,
    replay_tau,
)


def indexed(tokens: list[int], max_match: int = 4, max_proposal: int = 15) -> SuffixIndex:
    index = SuffixIndex(max_match, max_proposal)
    index.extend(tokens)
    return index


def brute_force_propose(
    tokens: list[int], max_match: int, max_proposal: int
) -> SuffixProposal | None:
    """Independent oracle: scan every earlier occurrence of each suffix, longest first."""
    end = len(tokens)
    for n in range(min(max_match, end - 1), 0, -1):
        suffix = tokens[end - n :]
        starts = [j for j in range(end - n) if tokens[j : j + n] == suffix]
        if starts:
            proposal: list[int] = []
            for j in range(max_proposal):
                pos = starts[-1] + n + j
                proposal.append(tokens[pos] if pos < end else proposal[pos - end])
            return SuffixProposal(tuple(proposal), n, len(starts))
    return None


def test_longest_match_preferred_over_more_recent_shorter_one():
    # 3-gram (1, 2, 3) was followed by 9; the most recent lone 3 was followed by 8.
    tokens = [1, 2, 3, 9, 7, 3, 8, 1, 2, 3]
    assert indexed(tokens, max_match=3, max_proposal=1).propose() == SuffixProposal((9,), 3, 1)
    assert indexed(tokens, max_match=1, max_proposal=1).propose() == SuffixProposal((8,), 1, 2)


def test_continuation_of_earlier_occurrence():
    proposal = indexed([4, 5, 6, 7, 8, 0, 5, 6], max_proposal=3).propose()
    assert proposal == SuffixProposal((7, 8, 0), 2, 1)


def test_most_recent_occurrence_wins_and_count_counts():
    index = indexed([1, 5, 1, 6, 1], max_match=1, max_proposal=4)
    assert index.propose() == SuffixProposal((6, 1, 6, 1), 1, 2)
    index.extend([7, 1])
    assert index.propose() == SuffixProposal((7, 1, 7, 1), 1, 3)


@pytest.mark.parametrize("tokens", [[], [7], [1, 2, 3, 4], [3, 1, 4, 5, 9, 2, 6]])
def test_no_proposal_without_repeat(tokens):
    assert indexed(tokens).propose() is None


def test_current_suffix_does_not_match_itself():
    index = indexed([1, 2, 3], max_proposal=5)
    assert index.propose() is None
    index.extend([1])
    assert index.propose() == SuffixProposal((2, 3, 1, 2, 3), 1, 1)


def test_periodic_extension():
    proposal = indexed([1, 2, 3, 1, 2, 3], max_proposal=8).propose()
    assert proposal == SuffixProposal((1, 2, 3, 1, 2, 3, 1, 2), 3, 1)


def test_slice_when_continuation_fits_before_present():
    proposal = indexed([1, 2, 3, 4, 5, 6, 1], max_proposal=3).propose()
    assert proposal == SuffixProposal((2, 3, 4), 1, 1)


@pytest.mark.parametrize("seed", range(5))
def test_incremental_matches_rebuild_and_oracle(seed):
    rng = random.Random(seed)
    max_match, max_proposal = rng.randint(1, 5), rng.randint(1, 7)
    tokens = [rng.randrange(4) for _ in range(200)]
    chunked = SuffixIndex(max_match, max_proposal)
    stepped = SuffixIndex(max_match, max_proposal)
    pos = 0
    while pos < len(tokens):
        size = rng.randint(0, 6)
        chunk = tokens[pos : pos + size]
        chunked.extend(chunk)
        for token in chunk:
            stepped.extend([token])
            prefix = tokens[: len(stepped)]
            expected = brute_force_propose(prefix, max_match, max_proposal)
            assert stepped.propose() == expected
            assert indexed(prefix, max_match, max_proposal).propose() == expected
        pos += len(chunk)
        rebuilt = indexed(tokens[:pos], max_match, max_proposal)
        assert len(chunked) == len(rebuilt) == pos
        assert chunked.propose() == rebuilt.propose()
        assert chunked._tables == rebuilt._tables == stepped._tables


def test_bounded_memory():
    rng = random.Random(0)
    tokens = [rng.randrange(3) for _ in range(5000)]
    index = indexed(tokens, max_match=4)
    distinct = {tuple(tokens[j : j + n]) for n in range(1, 5) for j in range(len(tokens) - n)}
    assert index.num_entries == len(distinct) <= 4 * len(index)
    assert index.num_entries <= 3 + 9 + 27 + 81


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"max_match": 0}, "max_match"), ({"max_proposal": 0}, "max_proposal")],
)
def test_constructor_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SuffixIndex(**kwargs)


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        # none: emit 5 | (5)->678, all accepted: 6785 | (8,5)->678 vs 6,9: emit 6,9.
        ([5, 6, 7, 8, 5, 6, 9], (7 / 3, 2 / 3)),
        # none: 5 | (5)->678: 6785 | (8,5)->678: 6785 | (8,5)->678 vs [6]: only 6 is left.
        ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], (10 / 4, 3 / 4)),
    ],
)
def test_replay_tau_hand_computed(output, expected):
    assert replay_tau([5, 6, 7, 8], output, max_match=2, max_proposal=3) == expected


def test_replay_tau_without_repetition_is_one():
    assert replay_tau([100, 101], list(range(50))) == (1.0, 0.0)


def test_replay_tau_needs_output():
    with pytest.raises(ValueError, match="output"):
        replay_tau([1, 2], [])


# --- the shared index over finished requests' outputs -----------------------------------


def test_shared_proposes_what_followed_in_another_output_up_to_its_end():
    shared = SharedSuffixIndex(capacity=100, max_match=2, max_proposal=5)
    shared.add(context=[90, 91, 1], output=[2, 3, 4])
    shared.add(context=[92, 7], output=[8, 9])
    # (1, 2) is followed by 3, 4 and then the end of that document: no loop, no next doc.
    assert shared.propose([5, 1, 2]) == SuffixProposal((3, 4), 2, 1, shared=True)
    # The prompt's last max_match tokens are indexed: an output's opening is found.
    assert shared.propose([91, 1]) == SuffixProposal((2, 3, 4), 2, 1, shared=True)
    assert shared.propose([6, 7]) == SuffixProposal((8, 9), 1, 1, shared=True)
    assert shared.propose([4]) is None  # ended its document: nothing followed it
    assert shared.propose([9]) is None
    assert shared.propose([90]) is None  # beyond the context tail kept (max_match = 2)
    assert shared.num_documents == 2


def test_shared_capacity_holds_the_most_recent_outputs():
    shared = SharedSuffixIndex(capacity=40, max_match=1, max_proposal=3)
    for doc in range(10):  # 6 tokens each with the separator: 3 per generation of 20
        shared.add(context=[], output=[100 + doc, 200 + doc, 300, 400, 500])
        assert len(shared) <= 40
        assert shared.propose([100 + doc]) == SuffixProposal((200 + doc, 300, 400), 1, 1, True)
    assert shared.propose([100 + 5]) is None  # two generations ago: dropped whole
    assert shared.propose([100 + 6]) is not None
    count = shared.propose([300]).count  # only the young generation's occurrences count
    assert 1 <= count <= 3


def test_shared_prefers_the_longer_match_then_the_younger_generation():
    shared = SharedSuffixIndex(capacity=16, max_match=3, max_proposal=2)
    shared.add([], [1, 2, 3, 4, 5])  # old generation after the next add
    shared.add([], [2, 3, 7, 8])
    assert shared.propose([1, 2, 3]) == SuffixProposal((4, 5), 3, 1, True)  # longer, old
    assert shared.propose([9, 2, 3]) == SuffixProposal((7, 8), 2, 1, True)  # tie: young


def test_shared_truncates_an_output_longer_than_half_its_capacity():
    shared = SharedSuffixIndex(capacity=10, max_match=1, max_proposal=3)
    shared.add([], list(range(100)))
    assert len(shared) <= 10
    assert shared.propose([98]) == SuffixProposal((99,), 1, 1, True)
    assert shared.propose([5]) is None


def test_shared_capacity_validation():
    with pytest.raises(ValueError, match="capacity"):
        SharedSuffixIndex(capacity=1)


def test_better_takes_the_longer_match_and_the_own_text_on_ties():
    own = SuffixProposal((1,), 2, 1)
    assert better(own, SuffixProposal((2,), 3, 1, True)).shared
    assert better(own, SuffixProposal((2,), 2, 5, True)) is own
    assert better(None, SuffixProposal((2,), 1, 1, True)).shared
    assert better(own, None) is own and better(None, None) is None


def test_replay_with_a_shared_index_learns_from_earlier_outputs():
    output = [11, 12, 13, 14, 15, 16, 17, 18]
    shared = SharedSuffixIndex(capacity=1000)
    assert replay_tau([1, 2, 3], output, shared=shared) == (1.0, 0.0)
    shared.add([1, 2, 3], output)
    # Second time: the prompt's tail finds the first output, accepted whole (+ no bonus left).
    assert replay_tau([1, 2, 3], output, shared=shared) == (8.0, 1.0)


def test_warm_starts_as_full_as_capacity_allows_with_the_newest_documents():
    # 6 tokens per document with its separator: 3 fit in each generation of 20.
    docs = [([], [100 + i, 200 + i, 300, 400, 500]) for i in range(10)]
    warmed = SharedSuffixIndex(capacity=40, max_match=1, max_proposal=3)
    assert warmed.warm(docs) == 6
    assert len(warmed) == 36
    for i in range(10):  # the newest 6 are found, the older ones were never added
        proposal = warmed.propose([100 + i])
        assert proposal == (SuffixProposal((200 + i, 300, 400), 1, 1, True) if i >= 4 else None)
    one_by_one = SharedSuffixIndex(capacity=40, max_match=1, max_proposal=3)
    for context, output in docs:
        one_by_one.add(context, output)
    assert len(one_by_one) < len(warmed)  # adding them one by one ends after an eviction
    # Later documents go on as if the warm ones had been added: the oldest 3 leave first.
    warmed.add([], [700, 701, 702, 703, 704])
    assert warmed.propose([104]) is None and warmed.propose([107]) is not None
    assert warmed.propose([700]) == SuffixProposal((701, 702, 703), 1, 1, True)
    assert SharedSuffixIndex(capacity=1000).warm(docs) == len(docs)
    assert SharedSuffixIndex(capacity=1000).warm([]) == 0
    with pytest.raises(ValueError, match="empty index"):
        warmed.warm(docs)


def _replay_main():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from replay_suffix import main

    return main


def test_replay_cli_caps_outputs_and_refuses_a_negative_cap(tmp_path, capsys):
    import json

    record = {"source": "s", "prompt_ids": [5, 6], "response_ids": [1, 2, 3] * 4}
    heldout = tmp_path / "h.jsonl"
    heldout.write_text(json.dumps(record) + "\n")
    main = _replay_main()
    out = tmp_path / "r.json"
    main(
        [
            "--heldout",
            str(heldout),
            "--capacities",
            "0",
            "--max-output-tokens",
            "3",
            "--out",
            str(out),
        ]
    )
    # The cap replays the first 3 tokens, as replay_tau on them alone (not on all 6).
    capped, _ = replay_tau([5, 6], [1, 2, 3])
    whole, _ = replay_tau([5, 6], record["response_ids"])
    assert capped != pytest.approx(whole)
    assert json.loads(out.read_text())["results"]["0"]["s"]["tau"] == pytest.approx(capped)
    with pytest.raises(SystemExit) as exc:
        main(["--heldout", str(heldout), "--max-output-tokens", "-1"])
    assert exc.value.code == 2
    assert "--max-output-tokens must be >= 0" in capsys.readouterr().err


def test_the_worker_looks_nothing_up_when_no_width_could_verify_a_proposal():
    """`--dflash-widths 1`: plain decoding throughout, so the per-step lookups (~0.6 ms a
    step at sixteen requests) are skipped; with a wider width the same request gets one."""
    import weakref
    from types import SimpleNamespace

    import torch

    from dflash_sglang.options import SpecOptions
    from dflash_sglang.worker import DFlashXWorker

    class Req:
        origin_input_ids = [5, 6, 7, 5, 6]
        output_ids = [7]

    req = Req()

    def proposals(widths: tuple[int, ...]) -> tuple[list, weakref.WeakKeyDictionary]:
        worker = object.__new__(DFlashXWorker)
        worker.options = SpecOptions(widths=widths, suffix_shared=0)
        worker.planner = SimpleNamespace(widths=widths)
        worker.block_size = 16
        worker._shared = None
        worker._suffix_indexes = weakref.WeakKeyDictionary()
        batch = SimpleNamespace(reqs=[req])
        return worker._suffix_proposals(batch, torch.tensor([5])), worker._suffix_indexes

    found, indexes = proposals((1,))
    assert found == [()] and len(indexes) == 0
    found, indexes = proposals((1, 4))
    assert [p.tokens[:2] for p in found[0]] == [(5, 6)] and len(indexes) == 1
