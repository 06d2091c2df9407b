"""Per step: which source proposes for each request, how wide the target verifies, and
whether the draft forward runs at all.

Sources: the DFlash block (B-1 tokens from one drafter pass) and a suffix lookup (free)
over the request's own text (`suffix.SuffixIndex`) or, when enabled, over recent requests'
outputs (`suffix.SharedSuffixIndex`); the two lookups keep separate statistics. The
planner scores every option (width w, draft on/off) by expected emitted tokens per second,
each request taking the source it expects more from at that width, and keeps the current
option unless another beats it by the hysteresis margin. Pure Python: the worker feeds it
host-side counts.

Options it does not pick are measured by exploration: at most every `explore_every` picks
a neighbouring option runs instead (from a step without the drafter, the better-scoring
of the next two drafting widths up), and an explored step that accepted more than
predicted is explored again on the next pick, so a drafter that starts hitting again is
measured in a burst of steps (an EMA moves little per step) rather than one per
`explore_every`; one that keeps missing costs a single step per period. Exploration only
spends an earned budget, `explore_budget` (1%) of the time of the steps it chose to
exploit: an explored step is charged its extra time, as measured, and refunded the tokens it
emitted beyond what the displaced option expected, at that option's seconds per token. So
a drafter that misses is measured about once per 1% of step time, and one that hits pays
for its own measurement and is measured as often as `explore_every` allows. (Charged its
predicted time alone, an isolated drafting step cost ~2x what the fit said; and with no
refund, a drafter accepting 45% of its first slots, unlucky at a reply's opening, was
measured once per ~70 steps at one request and stayed on plain decoding for whole runs.)
The first `SETTLE_STEPS` steps timed after the drafter turns on or off are left out of the
cost fit: caches are cold for a few steps (at one request on this CPU the first drafting
step after plain ones took ~2 ms more in the drafter and ~4 ms more outside it, the next
two +1.5-4 ms, then none; the first plain step after drafting up to +9 ms), and fitted as
if every step paid that, short exploring bursts priced drafting at ~1.6x a plain step
where steps in a long run cost ~1.35x. The exploration budget pays these steps as measured.

Expected emitted tokens for request r at width w (notation of `adaptive`):
  E_r(w) = 1 + max(S_dflash[:w-1].sum() if the draft runs,
                   max over r's suffix proposals p of S_src(p)[m_p][:min(w-1, L_p)].sum())
where src(p) is own text or shared, m_p and L_p the match length and length of proposal p.
A request may bring both lookups' proposals: which one it takes is learned, not fixed by
match length (a large shared index matches long but predicts worse than a request's own
text; measured in README).

With trees enabled (`tree.py`), a drafting option may also verify, for a request with a
suffix proposal p, the first a DFlash tokens and p's first w-1-a tokens as two branches;
the target follows whichever it agrees with further, so with D_k = S_dflash[k-1] (k <= a)
and P_k = S_src(p)[k-1] (k <= min(w-1-a, L_p)), taking the branches as independent:
  E_r(tree) = 1 + sum_k [1 - (1 - D_k)(1 - P_k)] = 1 + sum D_k + sum P_k - sum D_k P_k.
Each branch's acceptance is observed on its own (the walk shows how far each agreed), so
the statistics stay per source. A tree step's verify may cost more than a chain's of the
same width (GPU: it runs eager, FlashInfer's custom mask having no graph; CPU: no paged
kernel), so tree steps stay out of the cost model's fit and are priced at its prediction
times `tree_cost`, an EMA of their measured / predicted seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import TypeAlias

from dflash_sglang.adaptive import AcceptanceStats, CostModel
from dflash_sglang.suffix import SuffixProposal

DFLASH = "dflash"
SUFFIX = "suffix"  # lookup over the request's own prompt and output
SHARED = "shared"  # lookup over other requests' outputs
TREE = "tree"  # the DFlash block and a suffix proposal as two branches of one tree
SOURCES = (DFLASH, SUFFIX, SHARED, TREE)
TREE_DFLASH_LENS = (1, 3)  # DFlash branch lengths a tree option may take
TREE_COST_EMA = 0.1  # weight of one tree step's measured / predicted seconds in `tree_cost`
TREE_COST_RANGE = (0.5, 10.0)  # one step's ratio is clipped to this (outliers)
# Observations the DFlash prior counts as. Each one costs a draft forward, and once plain
# decoding wins they come only from exploration: at 1, one early miss took every slot from
# 0.5 to 0.25, and the bundled drafter, which misses its first ~7 blocks of an MT-Bench
# reply, was written off before it was measured (`bench/planner_sim.py`, replies opening
# with 8 missed tokens: worst of 16 seeds 1.02x plain decoding at 1, 1.09x at 8).
DFLASH_PRIOR_WEIGHT = 8.0
# Timed steps the cost fit leaves out after the drafter turns on or off (module docstring).
SETTLE_STEPS = 3
# A tree request's branches as the walk saw them: (DFlash accepted, DFlash offered,
# suffix accepted, suffix offered); None for a request verified as a chain.
Branches: TypeAlias = tuple[int, int, int, int] | None
# A request's suffix proposals: none, one, or one per lookup (own text, shared).
Candidates: TypeAlias = SuffixProposal | tuple[SuffixProposal, ...] | None


def candidates(proposals: Candidates) -> tuple[SuffixProposal, ...]:
    if proposals is None:
        return ()
    return (proposals,) if isinstance(proposals, SuffixProposal) else tuple(proposals)


@dataclass(frozen=True)
class StepPlan:
    width: int  # tokens verified per request, anchor included (1 = plain decoding)
    run_draft: bool  # the DFlash drafter runs this step
    suffix: tuple[SuffixProposal | None, ...]  # per request: the suffix proposal it takes
    predicted_seconds: float
    explored: bool = False  # chosen to measure, not because it scored best
    # An explored step's alternative: the option it displaced, (expected emitted tokens,
    # predicted seconds); what the step emits beyond it is refunded to the budget.
    displaced: tuple[float, float] = (0.0, 0.0)
    proposals: tuple[tuple[SuffixProposal, ...], ...] = ()  # every request's, taken or not
    tree_dflash: int = 0  # DFlash branch length of tree requests (0: a chain step)
    trees: tuple[bool, ...] = ()  # per request: verified as a tree (its suffix proposal beside)
    # Per request: proposal tokens the planner expected accepted (E_r - 1), by the statistics
    # it planned with; exported beside what was accepted, to check its estimates.
    expected: tuple[float, ...] = ()

    def choice(self) -> tuple[int, bool, tuple[int, ...], int, tuple[bool, ...]]:
        """What differs between ranks' planners: (width, run_draft, per request the index of
        the suffix proposal it takes among its candidates, -1 for none, the tree's DFlash
        branch length and which requests it covers)."""
        return self.width, self.run_draft, self._taken(), self.tree_dflash, self.trees

    def _taken(self) -> tuple[int, ...]:
        return tuple(
            -1 if p is None else next(i for i, c in enumerate(cands) if c is p)
            for p, cands in zip(self.suffix, self.proposals, strict=True)
        )

    def with_choice(
        self, choice: tuple[int, bool, tuple[int, ...], int, tuple[bool, ...]]
    ) -> StepPlan:
        """This plan with another rank's choice (its proposals are the same on every rank)."""
        width, run_draft, taken, tree_dflash, trees = choice
        if taken == self._taken():
            suffix = self.suffix
        else:  # the other rank chose per request with its own statistics: same proposals
            suffix = tuple(
                cands[i] if i >= 0 else None for i, cands in zip(taken, self.proposals, strict=True)
            )
        return replace(
            self,
            width=width,
            run_draft=run_draft,
            suffix=suffix,
            tree_dflash=tree_dflash,
            trees=trees,
        )

    def is_tree(self, r: int) -> bool:
        return bool(self.trees) and self.trees[r]

    def source(self, r: int) -> str | None:
        """What request r verifies this step; None when nothing is (width 1, or no suffix
        proposal on a step without the drafter: its slots hold padding)."""
        if self.width == 1:
            return None
        if self.is_tree(r):
            return TREE
        if self.suffix[r] is not None:
            return SHARED if self.suffix[r].shared else SUFFIX
        return DFLASH if self.run_draft else None

    def offered(self, r: int) -> int:
        """Proposal tokens of request r the target verifies (a tree's rows)."""
        source = self.source(r)
        if source in (SUFFIX, SHARED):
            return min(self.width - 1, len(self.suffix[r].tokens))
        return self.width - 1 if source in (DFLASH, TREE) else 0


@dataclass(frozen=True)
class _Option:
    width: int
    run_draft: bool
    tree_dflash: int = 0  # > 0: requests with a suffix proposal may verify both as a tree


class Planner:
    """Source per request, verify width and draft on/off for the next step."""

    def __init__(
        self,
        block_size: int,
        widths: Sequence[int],
        cost: CostModel,
        max_match: int = 4,
        hysteresis: float = 0.05,
        explore_every: int = 25,
        prefer_suffix: bool = False,
        explore_budget: float = 0.01,
        tree: str = "off",
        dflash_prior_weight: float = DFLASH_PRIOR_WEIGHT,
    ) -> None:
        if not widths or min(widths) < 1 or max(widths) > block_size:
            raise ValueError(f"widths must lie in [1, {block_size}], got {list(widths)}")
        self.block_size = block_size
        self.widths = tuple(sorted(set(widths)))
        self.cost = cost
        self.dflash = AcceptanceStats(block_size - 1, prior_weight=dflash_prior_weight)
        self.suffix = [AcceptanceStats(block_size - 1) for _ in range(max_match)]  # by match length
        self.shared = [AcceptanceStats(block_size - 1) for _ in range(max_match)]
        self.hysteresis = hysteresis
        self.explore_every = explore_every
        self.explore_budget = explore_budget  # share of step time exploration may add
        self._credit = 0.0  # seconds of exploration the budget has earned and not spent
        self.prefer_suffix = prefer_suffix  # take any suffix proposal (`--dflash-suffix always`)
        if tree not in ("on", "off", "always"):
            raise ValueError(f"tree must be on, off or always, got {tree!r}")
        # Two-branch tree options (`tree.py`); "always": a request with a suffix proposal
        # takes a tree on every drafting step (comparisons, tests).
        self.tree = tree if not prefer_suffix else "off"
        self.tree_cost = 1.0  # a tree step's seconds over the cost model's chain prediction
        self._current = _Option(self.widths[-1], self.widths[-1] > 1)
        self._picks = 0
        self._last_explored = 0  # the pick that last explored
        self._last_drafted: bool | None = None  # whether the last step timed ran the drafter
        self._settling = 0  # timed steps left before the fit takes them (`SETTLE_STEPS`)
        self._explore_turns = 0
        self._explore_again: _Option | None = None  # an explored option that beat its prediction

    def options(self, any_suffix: bool) -> list[_Option]:
        opts = [_Option(w, w > 1) for w in self.widths]
        if any_suffix:  # suffix proposals alone, no drafter pass
            opts += [_Option(w, False) for w in self.widths if w > 1]
        if any_suffix and self.tree != "off":
            trees = [
                _Option(w, True, a) for w in self.widths for a in TREE_DFLASH_LENS if a < w - 1
            ]
            opts = trees if self.tree == "always" and trees else opts + trees
        return opts

    def plan(self, proposals: Sequence[Candidates]) -> StepPlan:
        """`proposals[r]`: request r's suffix proposals (`Candidates`)."""
        proposals = [candidates(p) for p in proposals]
        bs = len(proposals)
        gains = _Expectations(self, proposals)
        picks_of = {
            opt: [gains.expected(opt, r) for r in range(bs)] for opt in self.options(any(proposals))
        }

        def seconds(opt: _Option) -> float:
            """Predicted step time; priced as a tree when some request would take one."""
            drafted = bs * self.block_size if opt.run_draft else 0
            chain = self.cost.predict(bs, bs * opt.width, drafted)
            return chain * self.tree_cost if any(t for _, _, t in picks_of[opt]) else chain

        scores = {
            opt: sum(1.0 + e for e, _, _ in picks) / seconds(opt) for opt, picks in picks_of.items()
        }
        chosen, explored = self._choose(scores, seconds)
        displaced = (0.0, 0.0)
        if explored:
            tokens = sum(1.0 + e for e, _, _ in picks_of[self._current])
            displaced = (tokens, seconds(self._current))
        picks = picks_of[chosen]
        taken = tuple(p for _, p, _ in picks)
        trees = tuple(tree for _, _, tree in picks) if chosen.tree_dflash else ()
        any_tree = any(trees)
        return StepPlan(
            width=chosen.width,
            run_draft=chosen.run_draft and (any_tree or not all(p is not None for p in taken)),
            suffix=taken,
            predicted_seconds=seconds(chosen),
            explored=explored,
            displaced=displaced,
            proposals=tuple(proposals),
            tree_dflash=chosen.tree_dflash if any_tree else 0,
            trees=trees if any_tree else (),
            expected=tuple(e for e, _, _ in picks),
        )

    def _choose(
        self, scores: dict[_Option, float], seconds: Callable[[_Option], float]
    ) -> tuple[_Option, bool]:
        """Best option, kept sticky by hysteresis; every `explore_every` picks a neighbour, and
        an explored option that beat its prediction again — each only while the exploration
        budget covers its extra time (a drafting step at a large batch costs several plain
        ones, and measuring must not eat the speed it is there to find)."""
        self._picks += 1
        current = self._current if self._current in scores else None
        best = max(scores, key=lambda o: (scores[o], -o.width))
        if current is None or scores[best] > scores[current] * (1.0 + self.hysteresis):
            self._current = current = best
        again, self._explore_again = self._explore_again, None
        candidate = None
        if again in scores and again != current:
            candidate = again
        elif self.explore_every and self._picks - self._last_explored >= self.explore_every:
            candidate = self._neighbour(current, scores)
        if candidate is not None and candidate in scores and candidate != current:
            extra = max(seconds(candidate) - seconds(current), 0.0)
            if extra <= self._credit:
                self._credit -= extra
                self._last_explored = self._picks
                self._explore_turns += candidate != again
                return candidate, True
        self._credit += self.explore_budget * seconds(current)
        return current, False

    def _neighbour(self, opt: _Option, scores: dict[_Option, float]) -> _Option:
        """In turn: up (drafting: the only way to see the drafter again once plain decoding
        or suffix-only steps won), plain decoding (the only way to measure what the drafter
        costs: at a fixed batch size a step that always drafts cannot tell the drafter's
        time from the step's own), and the next width down.

        Up from a step without the drafter is the better-scoring of the next two drafting
        chains (from suffix proposals alone at width w: w and the next width): the draft
        forward costs the same at every width, so at one request verifying a little more of
        the block measures more slots for little more time. (Exploring width 2 from plain
        decoding saw slot 0 alone: the bundled drafter, 1.14-1.16x plain decoding at a fixed
        width of 4, was measured on ~2% of steps one slot at a time and never taken,
        0.88-0.98x.) Not any width: under load a wide step costs far more than the fit,
        which has not seen it, predicts (the whole block at four requests: 87 ms, predicted
        47), and explored steps stay out of the fit."""
        i = self.widths.index(opt.width)
        turn = self._explore_turns % 3
        if not opt.run_draft and (i == 0 or turn == 0):
            j = max(i, 1)  # suffix proposals alone at width w: w itself with the drafter is up
            up = [_Option(w, True) for w in self.widths[j : j + 2]]
            up = [o for o in up if o in scores]
            if up:
                return max(up, key=lambda o: (scores[o], -o.width))
        if i == 0 or turn == 0:
            w = self.widths[min(i + 1, len(self.widths) - 1)]
        elif turn == 1 and self.widths[0] == 1:
            w = 1
        else:
            w = self.widths[i - 1]
        return _Option(w, w > 1)

    def observe(
        self,
        plan: StepPlan,
        accepted: Sequence[int],
        branches: Sequence[Branches] | None = None,
    ) -> None:
        """Per-request accepted proposal tokens of a step planned by `plan`; a tree request's
        from `branches[r]`, each branch to its own source's statistics."""
        surprise = 0.0  # accepted minus predicted, by the stats before this step
        for r, n in enumerate(accepted):
            seen = branches[r] if branches is not None and plan.is_tree(r) else None
            if seen is not None:
                d_acc, d_off, s_acc, s_off = seen
                observations = [(self.dflash, d_acc, d_off)]
                observations += [(self.suffix_stats(plan.suffix[r]), s_acc, s_off)]
            else:
                offered = plan.offered(r)
                proposal = plan.suffix[r]
                stats = self.suffix_stats(proposal) if proposal else self.dflash
                observations = [(stats, min(n, offered), offered)]
            for stats, n_acc, offered in observations:
                if offered == 0:
                    continue
                surprise += n_acc - stats.expected_accepted(offered)
                stats.observe(n_acc, offered)
        if plan.explored:
            # Settle the budget on what the step emitted: it was charged its extra time, and
            # emitting more than the option it displaced buys that time back (a drafter
            # hitting again pays for its own measurement, so its burst is not cut short).
            tokens, seconds = plan.displaced
            emitted = sum(n + 1 for n in accepted)
            self._credit += (emitted - tokens) * seconds / tokens
        if plan.explored and surprise > 0.0:
            self._explore_again = _Option(plan.width, plan.width > 1)  # as `_neighbour` made it

    def suffix_stats(self, proposal: SuffixProposal) -> AcceptanceStats:
        return (self.shared if proposal.shared else self.suffix)[proposal.match_len - 1]

    def observe_seconds(
        self, plan: StepPlan, bs: int, seconds: float, draft_seconds: float = 0.0
    ) -> None:
        """A step of `plan` took `seconds`, `draft_seconds` of them the draft forward."""
        drafted = bs * self.block_size if plan.run_draft else 0
        if plan.explored:  # charged its predicted extra time: settle on the measured one
            self._credit -= seconds - plan.predicted_seconds
        if plan.run_draft != self._last_drafted:  # cold caches for a few steps (module doc)
            self._last_drafted, self._settling = plan.run_draft, SETTLE_STEPS
        if self._settling:
            self._settling -= 1
            return
        if plan.trees:  # priced apart: its verify is not a chain's (module docstring)
            ratio = seconds / self.cost.predict(bs, bs * plan.width, drafted)
            ratio = min(max(ratio, TREE_COST_RANGE[0]), TREE_COST_RANGE[1])
            self.tree_cost += TREE_COST_EMA * (ratio - self.tree_cost)
            return
        self.cost.observe(bs, bs * plan.width, drafted, seconds, draft_seconds)


class _Expectations:
    """One plan's E_r - 1 per request and option (module docstring), with the gain curves
    computed once per statistics object and the best suffix chain once per (request, n)."""

    def __init__(self, planner: Planner, proposals: list[tuple[SuffixProposal, ...]]) -> None:
        self.planner = planner
        self.survival_dflash = planner.dflash.survival()
        self.gain_dflash = [0.0, *accumulate(self.survival_dflash)]  # gain[n] = sum S[:n]
        self._curves: dict[int, tuple[list[float], list[float]]] = {}  # id(stats) -> (gain, both)
        self.suffix_curves = [[self._curve(p) for p in cands] for cands in proposals]
        self._chains: dict[tuple[int, int], tuple[float, SuffixProposal]] = {}

    def _curve(self, p: SuffixProposal) -> tuple[list[float], list[float], int, SuffixProposal]:
        """p's source's gain[n], the prefix sums of S_dflash * S_src (a tree's overlap), p's
        length and p."""
        stats = self.planner.suffix_stats(p)
        if id(stats) not in self._curves:
            survival = stats.survival()
            both = (d * q for d, q in zip(self.survival_dflash, survival, strict=True))
            self._curves[id(stats)] = ([0.0, *accumulate(survival)], [0.0, *accumulate(both)])
        return (*self._curves[id(stats)], len(p.tokens), p)

    def _best_chain(self, r: int, n: int) -> tuple[float, SuffixProposal]:
        """Request r's best suffix chain of up to n tokens, (E_r - 1, proposal), the first of
        equals; drafting and lookup-only options of a width share it."""
        if (r, n) not in self._chains:
            scored = [(gain[min(n, length)], p) for gain, _, length, p in self.suffix_curves[r]]
            self._chains[r, n] = max(scored, key=lambda s: s[0])
        return self._chains[r, n]

    def expected(self, opt: _Option, r: int) -> tuple[float, SuffixProposal | None, bool]:
        """(E_r - 1, the suffix proposal taken or None, verified as a tree); ties go to the
        earlier candidate (own text before shared), then to the drafter's chain."""
        n = opt.width - 1
        best = self.gain_dflash[n] if opt.run_draft else 0.0
        taken, tree = None, False
        if self.suffix_curves[r]:
            chain, p = self._best_chain(r, n)
            if self.planner.prefer_suffix or chain > best:
                best, taken = chain, p
        a = opt.tree_dflash
        for gain, both, length, p in self.suffix_curves[r] if a else ():
            m = min(n - a, length)
            value = self.gain_dflash[a] + gain[m] - both[min(a, m)]
            if value > best or (self.planner.tree == "always" and not tree):
                best, taken, tree = value, p, True
        return best, taken, tree
