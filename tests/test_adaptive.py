import random

import pytest

from dflash_sglang.adaptive import DEFAULT_CPU_PRIOR, AcceptanceStats, CostModel

BLOCK = 16
WIDTHS = [1, 2, 4, 8, 16]
# A GPU-like step: verifying a token is cheap next to the fixed cost of a forward.
TRUE_COST = (0.05, 0.002, 0.0005, 0.0002)


def _seconds(coeffs, bs, verify_tokens, draft_tokens, draft_fixed=0.0):
    """(step seconds, of them the draft forward's) for linear costs `coeffs`."""
    draft = coeffs[3] * draft_tokens + (draft_fixed if draft_tokens else 0.0)
    rest = coeffs[0] + coeffs[1] * bs + coeffs[2] * verify_tokens
    return rest + draft, draft


# --- AcceptanceStats -------------------------------------------------------------------------


def test_decay_zero_keeps_the_last_observation_of_each_reached_slot():
    stats = AcceptanceStats(5, prior=0.5, decay=0.0)
    stats.observe(accepted=2, offered=4)
    assert stats.rates == [1.0, 1.0, 0.0, 0.0, 0.0]  # slots 3, 4 follow slot 2
    assert stats.survival() == [1.0, 1.0, 0.0, 0.0, 0.0]
    stats.observe(accepted=0, offered=3)
    assert stats.rates == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert stats.observations == 2


def test_ema_survival_and_expected_accepted():
    stats = AcceptanceStats(3, prior=0.5, decay=0.5)
    stats.observe(accepted=1, offered=2)  # c0 <- (0.5 + 1)/2, c1 <- (0.5 + 0)/2, c2 <- c1
    assert stats.rates == [0.75, 0.25, 0.25]
    assert stats.survival() == pytest.approx([0.75, 0.1875, 0.046875])
    assert stats.expected_accepted(2) == pytest.approx(0.9375)
    assert stats.expected_accepted(0) == 0.0


def test_censored_slots_are_unchanged():
    stats = AcceptanceStats(4, prior=0.5, decay=0.5)
    stats.observe(accepted=4, offered=4)
    stats.observe(accepted=0, offered=1)  # slot 0 rejected; slots 1.. not verified
    assert stats.rates == [0.375, 0.75, 0.75, 0.75]


def test_slots_never_reached_follow_the_deepest_reached_slot():
    stats = AcceptanceStats(6, prior=0.3, decay=0.9)
    assert stats.rates == [0.3] * 6  # nothing reached: the prior
    # First observation of a slot weighs 1/2 (the prior counts as one): 0.3 -> 0.65.
    stats.observe(accepted=2, offered=2)  # slots 0, 1 accepted; slot 2 never verified
    assert stats.rates == pytest.approx([0.65] * 6)
    # Second observation of slots 0, 1 weighs 1/3; slot 2 reached (rejected) from 0.65.
    stats.observe(accepted=2, offered=4)
    assert stats.rates == pytest.approx([0.65 + 0.35 / 3] * 2 + [0.325] * 4)


def test_a_running_mean_until_the_ema_horizon_then_the_ema():
    stats = AcceptanceStats(1, prior=0.5, decay=0.9)
    for _ in range(8):  # weights 1/2 .. 1/9: the mean of the prior and 8 rejections
        stats.observe(accepted=0, offered=1)
    assert stats.rates[0] == pytest.approx(0.5 / 9)
    stats.observe(accepted=1, offered=1)  # weight max(1 - 0.9, 1/10) = 0.1
    assert stats.rates[0] == pytest.approx(0.5 / 9 + 0.1 * (1 - 0.5 / 9))


def test_a_prior_weighing_several_observations_moves_less_per_observation():
    stats = AcceptanceStats(1, prior=0.5, prior_weight=4)
    for _ in range(2):  # weights 1/5, 1/6: the mean of 4 prior observations and 2 rejections
        stats.observe(accepted=0, offered=1)
    assert stats.rates[0] == pytest.approx(0.5 * 4 / 6)


@pytest.mark.parametrize("accepted, offered", [(3, 2), (-1, 2), (0, 5), (1, -1)])
def test_observe_rejects_impossible_counts(accepted, offered):
    with pytest.raises(ValueError, match="accepted"):
        AcceptanceStats(4).observe(accepted, offered)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_slots": 0}, "num_slots"),
        ({"prior": 1.5}, "prior"),
        ({"decay": 1.0}, "decay"),
        ({"prior_weight": 0.0}, "prior_weight"),
    ],
)
def test_acceptance_stats_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AcceptanceStats(**{"num_slots": 4, **kwargs})


def test_expected_accepted_rejects_more_than_the_slots():
    with pytest.raises(ValueError, match="offered"):
        AcceptanceStats(4).expected_accepted(5)


# --- CostModel -------------------------------------------------------------------------------


def _random_step(rng):
    bs, w = rng.randint(1, 16), rng.choice(WIDTHS)
    draft = bs * BLOCK if w > 1 and rng.random() < 0.5 else 0
    return bs, bs * w, draft


def test_cost_model_recovers_a_linear_cost_from_exact_data():
    truth = (0.03, 0.004, 0.0007, 0.0003)
    rng = random.Random(0)
    model = CostModel(DEFAULT_CPU_PRIOR)
    for _ in range(50):
        step = _random_step(rng)
        model.observe(*step, *_seconds(truth, *step))
    for bs in (1, 5, 16):
        for w in WIDTHS:
            for draft in (0, bs * BLOCK):
                want, _ = _seconds(truth, bs, bs * w, draft)
                assert model.predict(bs, bs * w, draft) == pytest.approx(want, rel=0.01)


def test_cost_model_is_monotone_in_verify_tokens_even_if_data_slopes_down():
    rng = random.Random(1)
    model = CostModel(DEFAULT_CPU_PRIOR)
    for _ in range(50):
        bs, verify, draft = _random_step(rng)
        model.observe(bs, verify, draft, 0.2 - 0.0005 * verify + 0.0001 * draft, 0.0001 * draft)
    for bs in (1, 8):
        preds = [model.predict(bs, bs * w, 0) for w in range(1, 17)]
        assert all(a <= b for a, b in zip(preds, preds[1:], strict=False))


def test_cost_model_reproduces_a_measured_point_when_the_constraint_binds():
    # Against this prior, the unconstrained fit of one point has a negative verify slope;
    # clamping it only at prediction time would predict far more than measured forever.
    model = CostModel(DEFAULT_CPU_PRIOR)
    for _ in range(3):
        model.observe(1, 4, BLOCK, 0.0572, 0.004)
    assert model.predict(1, 4, BLOCK) == pytest.approx(0.0572, rel=0.01)


def test_cost_model_fitted_on_one_request_never_prices_a_larger_batch_cheaper():
    # A server's warm-up, as measured: 12 steps of one request verifying 8 suffix tokens in
    # 25 ms. Fixed and per-request cost are collinear there; neither may go negative.
    model = CostModel(DEFAULT_CPU_PRIOR)
    for _ in range(12):
        model.observe(1, 8, 0, 0.025)
    assert model.predict(1, 8, 0) == pytest.approx(0.025, rel=0.01)
    for w in (1, 8, 16):
        assert model.predict(16, 16 * w, 0) >= model.predict(1, w, 0) > 0.001
    assert model.predict(16, 256, 256) > model.predict(16, 256, 0) + 0.1  # the drafter's prior


def test_cost_model_fitted_at_one_width_keeps_wider_steps_dearer():
    """Steps of one request at one width cannot tell the fixed cost from the per-token one.
    The fit must keep the prior's slope there rather than price every width the same: an
    absolute ridge did, from a prior 5x too slow, and the planner then verified the whole
    block with the drafter at one request, at a loss."""
    model = CostModel(tuple(5 * c for c in DEFAULT_CPU_PRIOR))
    for _ in range(30):
        model.observe(1, 4, 0, 0.020 + 0.0006 * 4)
    assert model.predict(1, 4, 0) == pytest.approx(0.0224, rel=0.01)
    assert model.predict(1, 16, 0) - model.predict(1, 4, 0) > 12 * 0.0006


def test_cost_model_forgets_an_old_cost():
    rng = random.Random(2)
    slow = tuple(2 * c for c in TRUE_COST)
    model = CostModel(DEFAULT_CPU_PRIOR, forgetting=0.99)
    for coeffs, n in ((TRUE_COST, 100), (slow, 500)):
        for _ in range(n):
            step = _random_step(rng)
            model.observe(*step, *_seconds(coeffs, *step))
    assert model.predict(4, 16, 4 * BLOCK) == pytest.approx(
        _seconds(slow, 4, 16, 4 * BLOCK)[0], rel=0.01
    )


def test_cost_model_prices_the_drafter_from_its_own_timing_through_noisy_steps():
    """One request, as at concurrency 1: the step time is noisy (±30%), mostly drafting
    widths, a plain step now and then. The drafter's price comes from its own timer, so
    the predicted difference between drafting and not is right, fixed cost included."""
    rng = random.Random(3)
    truth, draft_fixed = (0.10, 0.0, 0.001, 0.0005), 0.012  # the drafter: 20 ms of 16 tokens
    model = CostModel(DEFAULT_CPU_PRIOR)
    for i in range(300):
        w = 1 if i % 50 == 0 else rng.choice([2, 4, 8])
        draft = BLOCK if w > 1 else 0
        seconds, drafting = _seconds(truth, 1, w, draft, draft_fixed)
        model.observe(1, w, draft, seconds * rng.uniform(0.7, 1.3) + drafting * 0.3, drafting)
    price = model.predict(1, 2, BLOCK) - model.predict(1, 2, 0)
    assert price == pytest.approx(draft_fixed + truth[3] * BLOCK, rel=0.02)


def test_cost_model_ignores_one_stalled_step_but_learns_a_lasting_change():
    """A multi-second stall in one step (GC, another process) is not what steps cost; a
    cost that really jumps, by more than the outlier ratio, is learned one step late."""
    rng = random.Random(4)
    model = CostModel(DEFAULT_CPU_PRIOR)
    for _ in range(100):
        step = _random_step(rng)
        model.observe(*step, *_seconds(TRUE_COST, *step))
    before = model.predict(4, 16, 4 * BLOCK)
    seconds, drafting = _seconds(TRUE_COST, 4, 16, 4 * BLOCK)
    model.observe(4, 16, 4 * BLOCK, seconds + 5.0, drafting + 2.0)
    assert model.predict(4, 16, 4 * BLOCK) == pytest.approx(before, rel=1e-9)
    slow = tuple(10 * c for c in TRUE_COST)
    for _ in range(500):
        step = _random_step(rng)
        model.observe(*step, *_seconds(slow, *step))
    assert model.predict(4, 16, 4 * BLOCK) == pytest.approx(
        _seconds(slow, 4, 16, 4 * BLOCK)[0], rel=0.02
    )


def test_cost_model_prediction_has_a_positive_floor():
    assert CostModel([0.0, 0.0, 0.0, 0.0]).predict(1, 1, 0) > 0.0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"prior": [0.1, 0.0, 0.0]}, "prior"),
        ({"forgetting": 0.0}, "forgetting"),
        ({"prior_strength": 0.0}, "prior_strength"),
    ],
)
def test_cost_model_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CostModel(**{"prior": DEFAULT_CPU_PRIOR, **kwargs})


def test_cost_model_rejects_a_negative_duration():
    with pytest.raises(ValueError, match="seconds"):
        CostModel(DEFAULT_CPU_PRIOR).observe(1, 1, 0, -0.1)
    with pytest.raises(ValueError, match="draft_seconds"):
        CostModel(DEFAULT_CPU_PRIOR).observe(1, 2, BLOCK, 0.1, float("nan"))
