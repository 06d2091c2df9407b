"""What the adaptive planner (`proposals.Planner`) measures: per-slot acceptance of each
proposal source and the cost of a step.

Pure Python (no torch, no sglang): the worker feeds it host-side counts and wall times.

Conventions (shared with `acceptance` and `metrics`):
- The width `w` is the same for the whole batch: the target verifies the anchor plus `w - 1`
  proposal tokens per request. `w = 1` is plain decoding: no proposal is verified and the
  draft forward is skipped.
- A request's proposal has at most `cap` tokens (B-1 for a DFlash block, L for a suffix
  lookup), so it offers `offered = min(w - 1, cap)` tokens and emits `accepted + 1`.
- Slot k (0-based) is the k-th proposal token. `c[k]` = P(slot k accepted | slots < k
  accepted), and the survival curve is S[k] = P(accepted > k) = prod_{j<=k} c[j], so
  E[emitted | w] = 1 + sum_{k < offered} S[k].
- One step costs seconds ≈ θ · [1, bs, verify_tokens] + φ · [1, draft_tokens] with
  verify_tokens = bs*w and draft_tokens = bs*B when the draft forward runs (else no φ term).
- The planner picks the width maximising sum_r E_r[emitted | w] / seconds(w, bs).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

# Step cost, seconds per [step, request, verified token, drafted token], as profiled for the
# embedded SmolLM2 pair on a 2-core CPU (bench/profile_step.py, README "Where a step's time
# goes": a width-1 step 24.3 ms at 1 request, 0.9 ms of it KV injection now deferred, and
# 41.6 ms at 16; the whole block +8.9 ms for 15 more verified tokens, the drafter 6.1 ms for
# 16); each server replaces it with its own measurements within a few steps. The draft
# forward's fixed cost starts at 0 (its prior is the per-token cost alone).
DEFAULT_CPU_PRIOR = (0.022, 0.0006, 0.0006, 0.0004)

_MIN_SECONDS = 1e-6  # floor on a predicted step: scores stay finite and positive
# A measurement over this many times its prediction is a stall, unless the next one is too.
OUTLIER_RATIO = 4.0
_NUM_FEATURES = 4  # a prior is [step, request, verified token, drafted token]


class AcceptanceStats:
    """EMA of the conditional per-slot acceptance rates `c[k]` of one proposal source.

    Conditional rates are robust to censoring: a request-step that offered `n` tokens and
    accepted `a` reached slots 0..a (0..a-1 accepted, slot a rejected if a < n) and says
    nothing about slots beyond, so a narrow width never drags the wide slots' estimates down.

    Each slot's weight on a new observation is max(1 - decay, 1 / (n + 1 + prior_weight))
    after n earlier ones: a running mean (the prior counting as `prior_weight` observations)
    until the EMA's horizon is reached, so a fresh server learns its drafter in tens of
    steps, not hundreds.

    Slots never reached yet follow the deepest reached one instead of keeping the prior: a
    source seen accepting up to slot k likely accepts beyond it, and a pessimistic prior on
    the wide slots would keep the planner from ever trying the width that measures them.
    """

    def __init__(
        self, num_slots: int, prior: float = 0.5, decay: float = 0.98, prior_weight: float = 1.0
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {prior}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if prior_weight <= 0.0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        self._prior_weight = float(prior_weight)
        self._rates = [float(prior)] * num_slots
        self._counts = [0] * num_slots  # observations that reached each slot
        self._decay = decay
        self._observations = 0
        self._reached = 0  # slots 0.._reached-1 have been verified at least once

    @property
    def observations(self) -> int:
        return self._observations

    @property
    def rates(self) -> list[float]:
        """The conditional rates c[k], k = 0..num_slots-1 (a copy)."""
        return list(self._rates)

    def observe(self, accepted: int, offered: int) -> None:
        """One request-step: `offered` proposal tokens verified, the first `accepted` kept."""
        if not 0 <= accepted <= offered <= len(self._rates):
            raise ValueError(
                f"need 0 <= accepted <= offered <= {len(self._rates)}, "
                f"got accepted={accepted}, offered={offered}"
            )
        for k in range(accepted):  # reached and accepted: c[k] <- c[k] + a*(1 - c[k])
            self._update(k, 1.0)
        if accepted < offered:  # reached and rejected: c[k] <- c[k] + a*(0 - c[k])
            self._update(accepted, 0.0)
        self._observations += 1
        self._reached = max(self._reached, min(accepted + 1, offered))
        if self._reached:
            tail = self._rates[self._reached - 1]
            self._rates[self._reached :] = [tail] * (len(self._rates) - self._reached)

    def _update(self, k: int, outcome: float) -> None:
        weight = max(1.0 - self._decay, 1.0 / (self._counts[k] + 1 + self._prior_weight))
        self._rates[k] += weight * (outcome - self._rates[k])
        self._counts[k] += 1

    def survival(self) -> list[float]:
        """S[k] = P(accepted > k) = prod_{j<=k} c[j]."""
        out, s = [], 1.0
        for c in self._rates:
            s *= c
            out.append(s)
        return out

    def expected_accepted(self, offered: int) -> float:
        """E[accepted | offered] = sum_{k < offered} S[k]."""
        if not 0 <= offered <= len(self._rates):
            raise ValueError(f"offered must be in [0, {len(self._rates)}], got {offered}")
        return sum(self.survival()[:offered])


class CostModel:
    """Seconds of one step = rest(bs, verified tokens) + draft(drafted tokens), each part
    fitted online to its own measurement.

    rest ≈ θ · [1, bs, verify_tokens] is fitted to the step's time minus its draft forward,
    draft ≈ φ · [1, draft_tokens] (0 when the drafter does not run) to the draft forward's
    own time, which the worker measures directly. One regression over the sum could not
    tell them apart: at a fixed batch size the draft term is collinear with the width, and
    from noisy step times and a few exploring steps it under-priced the drafter at one
    request (DFLASH_X drafting at a loss, 0.89x plain decoding).

    Each part minimises  sum_i λ^(n-i) (y_i - θ·x_i)^2 + δ sum_j ((θ_j - prior_j) / s_j)^2
    (λ = `forgetting`, δ = `prior_strength`, s_j = prior_j, or the part's largest prior
    coefficient where prior_j is 0) with every coefficient >= 0: a step never costs less for
    more requests or tokens. The ridge is relative: where the data cannot tell coefficients
    apart (steps of one request at one width, the common case at low load) the fit moves
    each in proportion to its prior, so the fixed cost absorbs what the prior got wrong.
    An absolute ridge moved them in proportion to their features instead, and the
    verified-token cost, whose feature is the largest, took it all: fitted on steps of one
    width against a prior 5x too slow, every width was predicted to cost the same, and the
    planner verified the whole block with the drafter at one request (0.77x plain decoding
    on MT-Bench, README). (Only the per-token costs were constrained once: fitted on a
    server's warm-up alone, steps of one request, the fixed and per-request costs are not
    separable, the fit traded one against the other, and a negative per-request cost then
    predicted 0 s for a whole 16-token step of 16 requests: three drafting steps of 0.4 s
    before the first measurement at that size corrected it.)
    This is recursive least squares in information form: G = sum λ^(n-i) x xᵀ and
    m = sum λ^(n-i) x y are updated recursively and the small system re-solved. The ridge
    does not fade, so a direction the data never excites (a width never tried) stays at the
    prior instead of winding up. The constraint is part of the fit, not a clamp applied
    afterwards: clamping an unconstrained fit would miss even the measured points, and no
    later measurement at those points would correct it.

    A measurement over `OUTLIER_RATIO` × its prediction is skipped unless the one before
    was skipped too: one stalled step (a collection, page faults, another process taking
    the core) once weighed on the fit for hundreds of steps and stopped drafting there,
    while a real change of cost persists and is learned one step late.
    """

    def __init__(
        self, prior: Sequence[float], forgetting: float = 0.99, prior_strength: float = 1e-6
    ):
        if len(prior) != _NUM_FEATURES:
            raise ValueError(f"prior must have {_NUM_FEATURES} coefficients, got {len(prior)}")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if prior_strength <= 0.0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}")
        fit = {"forgetting": forgetting, "strength": prior_strength}
        self._rest = _LeastSquares(prior[:3], nonnegative=(0, 1, 2), **fit)
        self._draft = _LeastSquares((0.0, prior[3]), nonnegative=(0, 1), **fit)

    def predict(self, bs: int, verify_tokens: int, draft_tokens: int) -> float:
        """Predicted seconds; non-decreasing in verify and draft tokens."""
        seconds = self._rest.predict((1.0, bs, verify_tokens))
        if draft_tokens:
            seconds += self._draft.predict((1.0, draft_tokens))
        return max(seconds, _MIN_SECONDS)

    def observe(
        self,
        bs: int,
        verify_tokens: int,
        draft_tokens: int,
        seconds: float,
        draft_seconds: float = 0.0,
    ) -> None:
        """One measured step of `seconds`, `draft_seconds` of them the draft forward (which
        ran iff draft_tokens > 0)."""
        for name, value in (("seconds", seconds), ("draft_seconds", draft_seconds)):
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if draft_tokens:
            self._draft.observe((1.0, draft_tokens), draft_seconds)
        self._rest.observe((1.0, bs, verify_tokens), max(seconds - draft_seconds, 0.0))


class _LeastSquares:
    """Linear least squares with forgetting, a ridge towards a prior, and coefficients
    constrained to >= 0 (see `CostModel`)."""

    def __init__(
        self,
        prior: Sequence[float],
        nonnegative: tuple[int, ...],
        forgetting: float,
        strength: float,
    ):
        n = len(prior)
        self._prior = [float(c) for c in prior]
        largest = max((abs(c) for c in self._prior), default=0.0) or 1.0
        self._weight = [strength / (abs(c) or largest) ** 2 for c in self._prior]
        self._nonnegative = nonnegative
        self._forgetting = forgetting
        self._gram = [[0.0] * n for _ in range(n)]
        self._moment = [0.0] * n
        self._theta = self._fit()
        self._last_was_outlier = False

    def predict(self, x: Sequence[float]) -> float:
        return _dot(self._theta, x)

    def observe(self, x: Sequence[float], y: float) -> None:
        """G <- λG + x xᵀ, m <- λm + x y, then re-fit θ; an isolated outlier is skipped."""
        outlier = y > OUTLIER_RATIO * max(self.predict(x), _MIN_SECONDS)
        isolated, self._last_was_outlier = outlier and not self._last_was_outlier, outlier
        if isolated:
            return
        lam = self._forgetting
        self._gram = [
            [lam * g + xi * xj for g, xj in zip(row, x, strict=True)]
            for row, xi in zip(self._gram, x, strict=True)
        ]
        self._moment = [lam * m + xi * y for m, xi in zip(self._moment, x, strict=True)]
        self._theta = self._fit()

    def _fit(self) -> list[float]:
        """argmin θᵀAθ - 2bᵀθ with A = G + W, b = m + W·prior (W = diag(δ / s²)), θ_i >= 0
        for constrained i.

        A is positive definite, so the constrained optimum is the unconstrained optimum on the
        face of its active constraints: solve on every face, keep the best feasible one (the
        face with all constrained coefficients at zero is always feasible), starting with the
        unconstrained face, which ends the search when feasible (most steps)."""
        n, w = len(self._prior), self._weight
        a = [
            [g + (w[i] if i == j else 0.0) for j, g in enumerate(row)]
            for i, row in enumerate(self._gram)
        ]
        b = [m + wi * p for m, wi, p in zip(self._moment, w, self._prior, strict=True)]
        best, best_obj = [0.0] * n, math.inf
        faces = (
            zeroed
            for k in range(len(self._nonnegative) + 1)
            for zeroed in itertools.combinations(self._nonnegative, k)
        )
        for zeroed in faces:
            free = [i for i in range(n) if i not in zeroed]
            sol = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
            theta = [0.0] * n
            for i, v in zip(free, sol, strict=True):
                theta[i] = v
            if any(theta[i] < 0.0 for i in self._nonnegative):
                continue
            if not zeroed:  # the unconstrained optimum is feasible: no face beats it
                return theta
            obj = _dot(theta, [_dot(row, theta) for row in a]) - 2.0 * _dot(b, theta)
            if obj < best_obj:
                best, best_obj = theta, obj
        return best


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(u * v for u, v in zip(a, b, strict=True))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b, by Gaussian elimination with partial pivoting (a is small and SPD)."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            m[r] = [u - f * v for u, v in zip(m[r], m[col], strict=True)]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - _dot(m[r][r + 1 : n], x[r + 1 :])) / m[r][r]
    return x
