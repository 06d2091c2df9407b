"""The planner: verify width, draft on/off and source per request, in closed loops and alone."""

import random

import pytest

from dflash_sglang.adaptive import DEFAULT_CPU_PRIOR, CostModel
from dflash_sglang.proposals import (
    DFLASH,
    DFLASH_PRIOR_WEIGHT,
    SETTLE_STEPS,
    SHARED,
    SUFFIX,
    TREE,
    Planner,
    StepPlan,
    _Option,
)
from dflash_sglang.suffix import SuffixProposal

BLOCK = 16
WIDTHS = (1, 2, 4, 8, 16)  # the worker's default candidates for a 16-token block
BS = 4
# A GPU-like step: verifying a token is cheap next to the fixed cost of a forward.
TRUE_COST = (0.05, 0.002, 0.0005, 0.0002)


def _seconds(bs: int, width: int, run_draft: bool) -> float:
    features = (1, bs, bs * width, bs * BLOCK if run_draft else 0)
    return sum(c * f for c, f in zip(TRUE_COST, features, strict=True))


def _draft_seconds(bs: int, run_draft: bool) -> float:
    return TRUE_COST[3] * bs * BLOCK if run_draft else 0.0


def _closed_loop(planner: Planner, rates: list[float], seed: int = 0) -> list[StepPlan]:
    """Planner -> plan -> Bernoulli acceptance at `rates[t]` per slot and the true step time
    -> planner, with DFlash alone (no suffix proposals). Returns the plans run."""
    rng = random.Random(seed)
    plans = []
    for p in rates:
        plan = planner.plan([None] * BS)
        accepted = []
        for r in range(BS):
            n = 0
            while n < plan.offered(r) and rng.random() < p:
                n += 1
            accepted.append(n)
        planner.observe(plan, accepted)
        seconds = _seconds(BS, plan.width, plan.run_draft)
        planner.observe_seconds(plan, BS, seconds, _draft_seconds(BS, plan.run_draft))
        plans.append(plan)
    return plans


def _chosen_widths(plans: list[StepPlan]) -> list[int]:
    """Widths of the steps that ran because they scored best (exploration left out)."""
    return [p.width for p in plans if not p.explored]


def _proposal(n: int, match_len: int = 4) -> SuffixProposal:
    return SuffixProposal(tuple(range(100, 100 + n)), match_len, 1)


# --- closed loops: the drafter stops and starts hitting -------------------------------------


def test_a_drafter_that_never_hits_converges_to_plain_decoding():
    planner = Planner(BLOCK, WIDTHS, CostModel(TRUE_COST))
    plans = _closed_loop(planner, [0.0] * 200)
    assert plans[0].width > 1  # the prior acceptance first makes speculation look worthwhile
    first = next(t for t, p in enumerate(plans) if p.width == 1)
    assert first < 20
    after = plans[first:]
    assert {(p.width, p.run_draft) for p in after if not p.explored} == {(1, False)}
    # Exploring from plain decoding tries the next width up, once per `explore_every` picks.
    assert {(p.width, p.run_draft) for p in after if p.explored} == {(2, True)}
    assert sum(p.explored for p in after) <= len(after) // planner.explore_every + 1


def test_exploration_rediscovers_a_drafter_that_hits_again():
    # Planner defaults and cost prior as in the worker.
    off, on = 200, 800
    plans = _closed_loop(
        Planner(BLOCK, WIDTHS, CostModel(DEFAULT_CPU_PRIOR)), [0.0] * off + [0.9] * on
    )
    assert set(_chosen_widths(plans[off - 50 : off])) == {1}
    back = next(t for t in range(off, off + on) if not plans[t].explored and plans[t].width >= 8)
    assert back - off < 100  # 62-80 steps over seeds 0-19
    assert min(_chosen_widths(plans[back:])) >= 8


def test_without_exploration_plain_decoding_never_learns_the_drafter_is_back():
    planner = Planner(BLOCK, WIDTHS, CostModel(TRUE_COST), explore_every=0)
    plans = _closed_loop(planner, [0.0] * 100 + [0.9] * 500)
    assert {p.width for p in plans[50:]} == {1}


def test_an_explored_step_that_beats_its_prediction_is_explored_again():
    planner = Planner(
        BLOCK, WIDTHS, CostModel(TRUE_COST), explore_every=3, explore_budget=float("inf")
    )
    for _ in range(300):  # the drafter has been missing for long: plain decoding
        planner.dflash.observe(0, BLOCK - 1)
    proposals = [None] * BS
    assert [planner.plan(proposals).width for _ in range(2)] == [1, 1]
    explored = planner.plan(proposals)
    assert (explored.width, explored.explored) == (2, True)
    planner.observe(explored, [1] * BS)  # every slot hit: more than predicted
    again = planner.plan(proposals)
    assert (again.width, again.explored) == (2, True)
    planner.observe(again, [0] * BS)  # missed as predicted: back to plain decoding
    assert planner.plan(proposals).width == 1


# --- hysteresis ------------------------------------------------------------------------------


def _cost_of_width_2(ratio: float) -> CostModel:
    """A fixed cost (no observations) where a 1-request step at width 2 takes `ratio` times
    one at width 1: the drafter's B tokens are all that differs."""
    return CostModel((1.0, 0.0, 0.0, (ratio - 1.0) / BLOCK))


def test_hysteresis_holds_below_the_margin_and_switches_above():
    planner = Planner(BLOCK, (1, 2), _cost_of_width_2(1.04), hysteresis=0.05, explore_every=0)
    for _ in range(300):  # nothing accepted: score(1) / score(2) is the cost ratio
        planner.dflash.observe(0, 1)
    assert planner.plan([None]).width == 2  # starts wide; 4% better is not enough
    planner.cost = _cost_of_width_2(1.06)
    assert planner.plan([None]).width == 1
    planner.cost = _cost_of_width_2(1.0 / 1.04)  # width 2 now 4% better: stay
    assert planner.plan([None]).width == 1


# --- source per request ----------------------------------------------------------------------


def _planner_trusting_suffix(widths=WIDTHS) -> Planner:
    """Suffix proposals with a 4-token match nearly always hit; the drafter nearly never."""
    planner = Planner(BLOCK, widths, CostModel(TRUE_COST), explore_every=0)
    for _ in range(300):
        planner.suffix[3].observe(BLOCK - 1, BLOCK - 1)
        planner.dflash.observe(0, BLOCK - 1)
    return planner


def test_requests_with_a_trusted_suffix_proposal_take_it_and_the_drafter_still_runs():
    planner = _planner_trusting_suffix()
    # A drafter that hits at slot 0 and rarely beyond: worth one verified token, not more.
    for _ in range(300):
        planner.dflash.observe(1, 2)
    proposals = [_proposal(10), None, _proposal(3), None]
    plan = planner.plan(proposals)
    assert plan.width > 1 and plan.run_draft
    assert plan.suffix == (proposals[0], None, proposals[2], None)
    assert [plan.source(r) for r in range(4)] == [SUFFIX, DFLASH, SUFFIX, DFLASH]
    assert plan.offered(2) == min(plan.width - 1, 3)
    assert plan.offered(1) == plan.width - 1


def test_a_plan_carries_what_it_expects_each_request_to_accept():
    """Exported beside what was accepted (`dflash_predicted_accepted_tokens_total`)."""
    planner = _planner_trusting_suffix()
    for _ in range(300):
        planner.dflash.observe(1, 2)
    proposals = [_proposal(10), None, _proposal(3, match_len=2), None]
    plan = planner.plan(proposals)
    n = plan.width - 1
    assert n > 0 and plan.run_draft
    own = planner.suffix_stats
    assert plan.expected == pytest.approx(
        [
            own(proposals[0]).expected_accepted(min(n, 10)),
            planner.dflash.expected_accepted(n),
            max(
                own(proposals[2]).expected_accepted(min(n, 3)), planner.dflash.expected_accepted(n)
            ),
            planner.dflash.expected_accepted(n),
        ]
    )
    plain = Planner(BLOCK, (1,), CostModel(TRUE_COST)).plan([None, _proposal(3)])
    assert plain.expected == (0.0, 0.0)


def test_when_every_request_takes_its_suffix_proposal_the_drafter_is_skipped():
    planner = _planner_trusting_suffix()
    proposals = [_proposal(BLOCK - 1)] * BS
    plan = planner.plan(proposals)
    assert plan.width == BLOCK and not plan.run_draft
    assert plan.suffix == tuple(proposals)
    assert plan.predicted_seconds == pytest.approx(planner.cost.predict(BS, BS * BLOCK, 0))


def test_a_weak_suffix_match_loses_to_the_drafter():
    planner = Planner(BLOCK, WIDTHS, CostModel(TRUE_COST), explore_every=0)
    for _ in range(300):
        planner.dflash.observe(BLOCK - 1, BLOCK - 1)
        planner.suffix[0].observe(0, BLOCK - 1)
    plan = planner.plan([_proposal(BLOCK - 1, match_len=1), None])
    assert plan.run_draft and plan.suffix == (None, None)
    assert [plan.source(r) for r in range(2)] == [DFLASH, DFLASH]


# --- StepPlan and observe --------------------------------------------------------------------


def test_step_plan_source_and_offered():
    short, long = _proposal(3), _proposal(12)
    plan = StepPlan(8, True, (short, long, None), 0.1)
    assert [plan.source(r) for r in range(3)] == [SUFFIX, SUFFIX, DFLASH]
    assert [plan.offered(r) for r in range(3)] == [3, 7, 7]  # capped by proposal and width
    plain = StepPlan(1, False, (short, None), 0.1)
    assert [plain.source(r) for r in range(2)] == [None, None]
    assert [plain.offered(r) for r in range(2)] == [0, 0]
    no_draft = StepPlan(4, False, (short, None), 0.1)  # request 1 verifies padding only
    assert [no_draft.source(r) for r in range(2)] == [SUFFIX, None]
    assert [no_draft.offered(r) for r in range(2)] == [3, 0]


def test_observe_credits_each_source_and_match_length():
    planner = Planner(BLOCK, WIDTHS, CostModel(TRUE_COST))
    plan = StepPlan(8, True, (_proposal(3, match_len=2), _proposal(12, match_len=4), None), 0.1)
    # Request 0 accepted its 3 suffix tokens and 2 DFlash tokens past them: only 3 count.
    planner.observe(plan, [5, 0, 7])
    assert [s.observations for s in planner.suffix] == [0, 1, 0, 1]
    assert planner.dflash.observations == 1
    # A suffix slot's first observation weighs 1/2 against the 0.5 prior, a DFlash slot's
    # 1/9 (its prior counts as DFLASH_PRIOR_WEIGHT = 8 observations).
    assert planner.suffix[1].rates[:3] == pytest.approx([0.75] * 3)  # accepted 3 of 3
    assert planner.suffix[3].rates[0] == pytest.approx(0.25)  # rejected at slot 0
    assert planner.dflash.rates[:7] == pytest.approx([0.5 + 0.5 / 9] * 7)


def test_two_early_misses_do_not_stop_drafting_at_one_request():
    # The worker's cost prior at one request: a width-4 drafting step costs ~1.35 plain ones.
    # Weighed as one observation, two first missed blocks would put every slot at 1/6 and the
    # planner on plain decoding, where only exploration (~1 step in 70) could measure again.
    for weight, drafts in ((DFLASH_PRIOR_WEIGHT, True), (1.0, False)):
        planner = Planner(BLOCK, WIDTHS, CostModel(DEFAULT_CPU_PRIOR), dflash_prior_weight=weight)
        for _ in range(2):
            plan = planner.plan([None])
            assert plan.run_draft
            planner.observe(plan, [0])
        assert planner.plan([None]).run_draft == drafts


def test_shared_proposals_keep_their_own_statistics_and_source():
    planner = Planner(BLOCK, WIDTHS, CostModel(TRUE_COST))
    shared = SuffixProposal((1, 2, 3), 2, 1, shared=True)
    plan = StepPlan(8, False, (shared, _proposal(3, match_len=2)), 0.1)
    assert [plan.source(r) for r in range(2)] == [SHARED, SUFFIX]
    assert [plan.offered(r) for r in range(2)] == [3, 3]
    planner.observe(plan, [3, 0])
    assert [s.observations for s in planner.shared] == [0, 1, 0, 0]
    assert [s.observations for s in planner.suffix] == [0, 1, 0, 0]
    assert planner.shared[1].rates[0] == pytest.approx(0.75)
    assert planner.suffix[1].rates[0] == pytest.approx(0.25)
    # Same match length, same length: the source that has been accepted is the one taken.
    for _ in range(30):
        planner.observe(plan, [3, 0])
    picked = planner.plan([shared, _proposal(3, match_len=2)])
    assert picked.width > 1 and picked.suffix[0] is shared
    assert picked.offered(0) == 3


def test_between_own_and_shared_proposals_the_learned_better_one_is_taken():
    """A long shared match loses to a shorter own-text match whose source accepts more."""
    planner = Planner(BLOCK, WIDTHS, CostModel(TRUE_COST))
    own, shared = _proposal(BLOCK - 1, match_len=2), SuffixProposal((9,) * 15, 4, 1, True)
    assert planner.plan([(own, shared)]).suffix == (own,)  # equal priors: own text first
    for _ in range(40):
        planner.shared[3].observe(BLOCK - 1, BLOCK - 1)
    assert planner.plan([(own, shared)]).suffix == (shared,)
    for _ in range(40):
        planner.shared[3].observe(0, 4)
        planner.suffix[1].observe(4, 4)
    plan = planner.plan([(own, shared), (shared,)])
    assert plan.suffix[0] is own and plan.source(0) == SUFFIX


def test_observe_ignores_requests_that_verified_nothing():
    planner = Planner(BLOCK, WIDTHS, CostModel(TRUE_COST))
    planner.observe(StepPlan(1, False, (_proposal(3), None), 0.1), [0, 0])
    planner.observe(StepPlan(4, False, (None, None), 0.1), [0, 0])
    assert planner.dflash.observations == 0
    assert [s.observations for s in planner.suffix] == [0] * 4


def test_observe_seconds_fits_the_cost_of_the_plan_that_ran():
    planner = Planner(BLOCK, WIDTHS, CostModel(DEFAULT_CPU_PRIOR))
    for width, run_draft in [(1, False), (4, True), (16, True), (16, False), (8, True)] * 20:
        plan = StepPlan(width, run_draft, (None,) * BS, 0.0)
        seconds = _seconds(BS, width, run_draft)
        for _ in range(SETTLE_STEPS + 1):  # steps right after the drafter turns on or off: unfitted
            planner.observe_seconds(plan, BS, seconds, _draft_seconds(BS, run_draft))
    for width, run_draft in [(2, True), (16, False), (1, False)]:
        drafted = BS * BLOCK if run_draft else 0
        predicted = planner.cost.predict(BS, BS * width, drafted)
        assert predicted == pytest.approx(_seconds(BS, width, run_draft), rel=0.01)


# --- fixed width -----------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.0, 0.9])
def test_a_single_width_always_verifies_the_whole_drafted_block(rate):
    plans = _closed_loop(Planner(BLOCK, (BLOCK,), CostModel(TRUE_COST)), [rate] * 120)
    assert {(p.width, p.run_draft, p.explored) for p in plans} == {(BLOCK, True, False)}


def test_a_single_width_skips_the_drafter_only_when_every_request_takes_a_suffix():
    planner = _planner_trusting_suffix(widths=(BLOCK,))
    assert not planner.plan([_proposal(BLOCK - 1)] * BS).run_draft
    for _ in range(300):  # a good drafter: requests without a suffix proposal want it
        planner.dflash.observe(BLOCK - 1, BLOCK - 1)
    plan = planner.plan([_proposal(BLOCK - 1), None])
    assert (plan.width, plan.run_draft) == (BLOCK, True)


@pytest.mark.parametrize("widths", [(), (0, 2), (2, BLOCK + 1)])
def test_planner_rejects_widths_outside_the_block(widths):
    with pytest.raises(ValueError, match="widths"):
        Planner(BLOCK, widths, CostModel(TRUE_COST))


def test_prefer_suffix_takes_every_suffix_proposal_even_against_a_better_drafter():
    planner = Planner(4, (4,), CostModel(DEFAULT_CPU_PRIOR), prefer_suffix=True)
    for _ in range(50):  # the drafter hits everything, suffix proposals nothing
        planner.dflash.observe(3, 3)
        planner.suffix[0].observe(0, 3)
    plan = planner.plan([SuffixProposal((5, 6, 7), 1, 1), None])
    assert plan.source(0) == "suffix" and plan.source(1) == "dflash" and plan.run_draft


def test_another_ranks_choice_reuses_this_ranks_proposals():
    planner = Planner(4, (1, 2, 4), CostModel(DEFAULT_CPU_PRIOR))
    proposals = [SuffixProposal((5, 6, 7), 2, 1), None]
    plan = planner.plan(proposals)
    other = plan.with_choice((2, True, (-1, -1), 0, ()))
    assert (other.width, other.run_draft, other.suffix) == (2, True, (None, None))
    back = other.with_choice((4, False, (0, -1), 0, ()))
    assert back.suffix == (proposals[0], None) and back.choice() == (4, False, (0, -1), 0, ())
    both = [(SuffixProposal((5,), 1, 1), SuffixProposal((6, 7), 4, 1, shared=True))]
    shared = planner.plan(both).with_choice((4, False, (1,), 0, ()))
    assert shared.suffix == both[0][1:] and shared.choice() == (4, False, (1,), 0, ())
    tree = plan.with_choice((4, True, (0, -1), 1, (True, False)))
    assert tree.source(0) == TREE and tree.source(1) == DFLASH and tree.offered(0) == 3


def test_the_step_that_turns_the_drafter_on_or_off_is_not_fitted():
    planner = Planner(BLOCK, WIDTHS, CostModel(TRUE_COST))
    drafting = StepPlan(4, True, (None,) * BS, 0.0)
    plain = StepPlan(1, False, (None,) * BS, 0.0)
    before = [planner.cost.predict(BS, BS * w, BS * BLOCK * (w > 1)) for w in (1, 4)]
    for plan in (plain, drafting, drafting, plain, plain, plain):  # within SETTLE_STEPS of a switch
        planner.observe_seconds(plan, BS, 0.2, 0.1 if plan.run_draft else 0.0)
    after = [planner.cost.predict(BS, BS * w, BS * BLOCK * (w > 1)) for w in (1, 4)]
    assert after == before
    planner.observe_seconds(plain, BS, 0.2)  # the fourth plain step in a row: fitted
    assert planner.cost.predict(BS, BS, 0) > before[0]


def test_an_explored_step_is_charged_its_measured_time_and_refunded_its_tokens():
    planner = Planner(4, (1, 4), CostModel((1.0, 0.0, 0.0, 2.0 / 4)), explore_every=1)
    for _ in range(300):  # the drafter has been missing: plain decoding, 1 s a step
        planner.dflash.observe(0, 3)
    plans = [planner.plan([None]) for _ in range(300)]
    explored = next(p for p in plans if p.explored)
    assert explored.predicted_seconds == 3.0 and explored.displaced == (1.0, 1.0)
    credit = planner._credit
    planner.observe_seconds(explored, 1, 5.0, 2.0)  # took 2 s more than predicted
    assert planner._credit == pytest.approx(credit - 2.0)
    planner.observe(explored, [3])  # emitted 4 tokens where plain decoding emits 1 in 1 s
    assert planner._credit == pytest.approx(credit - 2.0 + 3.0)


def test_exploration_spends_at_most_its_budget_of_step_time():
    """Explored steps cost 3x a plain step here: with the default 1% budget and a pick every
    step allowed, the extra time stays within 1% of the time spent on plain steps."""
    planner = Planner(4, (1, 4), CostModel((1.0, 0.0, 0.0, 2.0 / 4)), explore_every=1)
    for _ in range(300):
        planner.dflash.observe(0, 3)
    plans = [planner.plan([None]) for _ in range(2000)]
    plain = sum(1.0 for p in plans if not p.explored)
    extra = sum(p.predicted_seconds - 1.0 for p in plans if p.explored)
    assert plans[0].width == 1 and 0 < extra <= planner.explore_budget * plain == 0.01 * plain


def test_exploration_cycles_up_plain_and_down():
    planner = Planner(16, (1, 2, 4, 8, 16), CostModel(DEFAULT_CPU_PRIOR), explore_every=1)
    planner._current = _Option(4, True)  # drafting at width 4, held there by hysteresis
    planner.hysteresis = float("inf")
    planner.explore_budget = float("inf")
    picks = [planner.plan([None]) for _ in range(4)]
    assert [(p.width, p.run_draft, p.explored) for p in picks] == [
        (4, True, False),  # exploiting first earns the budget the explorations spend
        (8, True, True),
        (1, False, True),
        (2, True, True),
    ]


def test_exploring_up_from_plain_decoding_measures_the_best_drafting_width():
    """The draft forward costs the same at every width: from plain decoding the drafter is
    measured at the width that scores best (4 here: slots accepted half the time, the CPU
    prior's costs), not at the next one up, which would see slot 0 alone."""
    planner = Planner(16, (1, 2, 4, 8, 16), CostModel(DEFAULT_CPU_PRIOR), explore_every=1)
    planner._current = _Option(1, False)  # plain decoding, held there by hysteresis
    planner.hysteresis = float("inf")
    planner.explore_budget = float("inf")
    picks = [planner.plan([None]) for _ in range(3)]
    assert [(p.width, p.run_draft, p.explored) for p in picks] == [
        (1, False, False),
        (4, True, True),
        (4, True, True),  # from plain decoding every turn goes up
    ]


def test_exploring_up_goes_at_most_two_widths_past_a_step_without_the_drafter():
    """Even where the whole block scores best, exploring from plain decoding stops at width
    4 (a wide step the fit has not seen may cost far more than it predicts), and from
    suffix proposals alone at width 4 it turns the drafter on at 4 or 8."""
    planner = Planner(16, (1, 2, 4, 8, 16), CostModel(TRUE_COST), explore_every=1)
    for _ in range(50):
        planner.dflash.observe(15, 15)  # every slot hits: the whole block scores best
    planner.hysteresis = float("inf")
    planner.explore_budget = float("inf")
    for current, allowed in ((_Option(1, False), 4), (_Option(4, False), 8)):
        planner._current = current
        picks = [planner.plan([_proposal(3)] * BS) for _ in range(4)]
        assert max(p.width for p in picks if p.explored) == allowed  # up; then plain, down


# --- two-branch trees --------------------------------------------------------------------


def _tree_planner(d_rate: float, s_rate: float, tree: str = "on") -> Planner:
    """Acceptance learned at fixed per-slot rates; a cost where verified tokens are cheap."""
    planner = Planner(BLOCK, WIDTHS, CostModel(TRUE_COST), explore_every=0, tree=tree)
    for stats, rate in ((planner.dflash, d_rate), (planner.suffix[3], s_rate)):
        for _ in range(400):
            n = 0
            while n < 7 and random.random() < rate:
                n += 1
            stats.observe(n, 7)
    return planner


def test_a_tree_is_planned_when_both_sources_hit_and_verifying_is_cheap():
    random.seed(0)
    plan = _tree_planner(0.6, 0.6).plan([_proposal(8), None])
    assert plan.tree_dflash in (1, 3) and plan.run_draft
    assert plan.trees == (True, False)
    assert [plan.source(r) for r in range(2)] == [TREE, DFLASH]


def test_no_tree_when_disabled_or_when_one_source_never_hits():
    random.seed(0)
    assert not _tree_planner(0.6, 0.6, tree="off").plan([_proposal(8)]).trees
    random.seed(0)
    plan = _tree_planner(0.6, 0.0).plan([_proposal(8)])  # the suffix branch adds nothing
    assert not plan.trees
    random.seed(0)
    forced = _tree_planner(0.6, 0.0, tree="always").plan([_proposal(8), None])
    assert forced.trees == (True, False) and forced.run_draft


def test_a_tree_step_observes_each_branch_in_its_own_statistics():
    planner = Planner(BLOCK, WIDTHS, CostModel(TRUE_COST), tree="on")
    plan = StepPlan(8, True, (_proposal(8),), 0.01, tree_dflash=3, trees=(True,))
    before_d, before_s = list(planner.dflash.rates), list(planner.suffix[3].rates)
    planner.observe(plan, [4], branches=[(0, 3, 4, 4)])
    assert planner.suffix[3].rates != before_s  # 4 of 4 suffix rows accepted
    assert planner.dflash.rates[0] < before_d[0]  # the tree's DFlash branch missed at slot 1


def test_a_bad_tree_setting_is_refused():
    with pytest.raises(ValueError, match="tree must be on, off or always"):
        Planner(BLOCK, WIDTHS, CostModel(TRUE_COST), tree="yes")


def test_tree_steps_priced_apart_by_their_measured_cost():
    """A tree step that runs dearer than a chain of its width (GPU: eager verify) raises
    `tree_cost` instead of bending the chain cost model, and the planner stops choosing
    trees once they cost more than they bring; a chain step still trains the cost model."""
    random.seed(0)
    planner = _tree_planner(0.6, 0.6)
    plan = planner.plan([_proposal(8), None])
    assert plan.trees == (True, False)
    chain_cost = planner.cost.predict(2, 2 * plan.width, 2 * BLOCK)
    for _ in range(40):
        planner.observe_seconds(plan, 2, 4.0 * chain_cost)
    assert planner.cost.predict(2, 2 * plan.width, 2 * BLOCK) == chain_cost
    assert 3.5 < planner.tree_cost <= 4.0
    dear = planner.plan([_proposal(8), None])
    assert not dear.trees
    drafted = 2 * BLOCK if dear.run_draft else 0
    assert dear.predicted_seconds == planner.cost.predict(2, 2 * dear.width, drafted)
    chain = StepPlan(8, True, (None, None), 0.01)
    planner.observe_seconds(chain, 2, 4.0 * chain_cost)
    assert planner.cost.predict(2, 16, 2 * BLOCK) != chain_cost
