"""DFlash speculative-decoding metrics, each defined once (vLLM `spec_decode` conventions).

Exported by every scheduler process through SGLang's Prometheus multiprocess registry, so
they appear on SGLang's own `/metrics` next to `sglang:*`:

  dflash_num_drafts_total{source}                  request-steps that verified a proposal
                                                   (source "dflash": the drafter's block;
                                                   "suffix": a lookup in the request's own
                                                   text; "shared": in recent requests' outputs;
                                                   "tree": the block and a lookup's proposal
                                                   verified as two branches of one tree)
  dflash_num_draft_tokens_total{source}            proposed tokens offered for verification
  dflash_num_accepted_tokens_total{source}         proposed tokens the target accepted
  dflash_predicted_accepted_tokens_total{source}   proposed tokens the adaptive planner
                                                   expected accepted when it chose them
  dflash_num_accepted_tokens_per_pos_total{position="k"}  accepted at draft slot k (0-based)
  dflash_num_request_steps_total                   decode request-steps, speculating or not
  dflash_num_steps_total, dflash_num_plain_steps_total  decode steps; of them, width 1
                                                   (speculation off: plain decoding)
  dflash_acceptance_length                         histogram: tokens emitted per request-step
  dflash_draft_seconds, dflash_verify_seconds      histograms: per step
  dflash_step_verify_width                         histogram: verify width per step
  dflash_step_seconds{width,drafter},              histograms: a decode step, start to
  dflash_predicted_step_seconds{width,drafter}     next start, measured / as the adaptive
                                                   planner predicted it, per option the
                                                   planner took (verify width; drafter
                                                   "on" or "off")
  dflash_verify_width                              gauge: tokens verified per request (last step)
  dflash_draft_kv_rows                             gauge: draft-KV rows holding injected features
                                                   (requests and radix cache)
  dflash_radix_reused_draft_kv_tokens_total        prompt tokens whose draft KV came from the
                                                   radix cache instead of being injected again
  dflash_held_draft_kv_rows                        gauge: committed rows held, not written yet
                                                   (CPU, `--dflash-defer-injection`)
  dflash_dropped_draft_kv_rows_total               held rows of finished requests dropped
                                                   unread when the holder filled: a later
                                                   prefix match on them drafts without them
                                                   (rising under multi-turn traffic: raise
                                                   `--dflash-defer-injection`)
  dflash_suffix_shared_tokens                      gauge: tokens the shared suffix lookup holds
                                                   (warm-start corpus and finished outputs)

Ratios are not exported; compute them over any window w (the bonus token is included in τ;
sum over `source` for both sources together, or keep it for τ per source):
  τ (mean acceptance length) = 1 + rate(accepted[w]) / rate(drafts[w])
  acceptance rate            = rate(accepted[w]) / rate(draft_tokens[w])
  acceptance at position k   = rate(accepted_per_pos{position="k"}[w]) / rate(drafts[w])
  output tokens              = request_steps + accepted (each request-step emits a bonus)
  speculation off            = rate(plain_steps[w]) / rate(steps[w])
  τ the planner expected     = 1 + rate(predicted_accepted[w]) / rate(drafts[w])
                               (by source: its acceptance estimates against the τ above)
  cost model error by option = sum by (width, drafter) (rate(step_seconds_sum[w]))
                               / sum by (width, drafter) (rate(predicted_step_seconds_sum[w]))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from dflash_sglang.proposals import SOURCES, StepPlan

PREFIX = "dflash_"
# Exported sample names, for every reader (`server/stats.py`, `loadtest/`, benchmarks).
DRAFTS = PREFIX + "num_drafts_total"
DRAFT_TOKENS = PREFIX + "num_draft_tokens_total"
ACCEPTED = PREFIX + "num_accepted_tokens_total"
ACCEPTED_PER_POS = PREFIX + "num_accepted_tokens_per_pos_total"
PREDICTED_ACCEPTED = PREFIX + "predicted_accepted_tokens_total"
REQUEST_STEPS = PREFIX + "num_request_steps_total"
STEPS = PREFIX + "num_steps_total"
PLAIN_STEPS = PREFIX + "num_plain_steps_total"
STEP_WIDTH = PREFIX + "step_verify_width"
VERIFY_WIDTH = PREFIX + "verify_width"
SHARED_TOKENS = PREFIX + "suffix_shared_tokens"
STEP_SECONDS = PREFIX + "step_seconds"
PREDICTED_STEP_SECONDS = PREFIX + "predicted_step_seconds"
TIME_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


def tau(accepted: float, drafts: float) -> float | None:
    """Mean acceptance length, bonus included: 1 + accepted / drafts (None without drafts)."""
    return 1.0 + accepted / drafts if drafts else None


def step_time_sums(samples: Iterable[tuple[str, Mapping[str, str], float]]) -> dict[str, dict]:
    """Per option ("w4+draft": width 4 with the drafter; "w1": plain decoding): steps and
    summed measured and predicted seconds, from the step-time histograms' `_count` and `_sum`
    samples (name, labels, value), summed over processes, ordered by width. Differences of
    two such totals are totals over the interval between them."""
    fields = {
        STEP_SECONDS + "_count": "steps",
        STEP_SECONDS + "_sum": "measured",
        PREDICTED_STEP_SECONDS + "_sum": "predicted",
    }
    sums: dict[tuple[int, bool], dict] = {}
    for name, labels, value in samples:
        if name in fields and "width" in labels:
            option = (int(labels["width"]), labels.get("drafter") == "on")
            row = sums.setdefault(option, dict.fromkeys(fields.values(), 0.0))
            row[fields[name]] += value
    return {f"w{w}" + ("+draft" if on else ""): sums[w, on] for w, on in sorted(sums)}


def step_time_means(sums: Mapping[str, Mapping[str, float]]) -> dict[str, dict]:
    """{option: {"steps", "measured_ms", "predicted_ms"}}: mean step times, in `sums`' order
    (options without steps left out)."""
    return {
        option: {
            "steps": row["steps"],
            "measured_ms": 1e3 * row["measured"] / row["steps"],
            "predicted_ms": 1e3 * row["predicted"] / row["steps"],
        }
        for option, row in sums.items()
        if row["steps"] > 0
    }


@dataclass(frozen=True)
class StepStats:
    """One decode step, counted the way the exported counters count."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]  # index k: requests that accepted draft slot k

    @property
    def mean_acceptance_length(self) -> float:
        """τ for this step (1.0 when nothing was drafted)."""
        return tau(self.num_accepted_tokens, self.num_drafts) or 1.0


def step_stats(accept_lens: Sequence[int], verify_width: int) -> StepStats:
    """Counts for one step from per-request accepted-draft counts (bonus excluded)."""
    drafts_per_req = verify_width - 1
    for n in accept_lens:
        if not 0 <= n <= drafts_per_req:
            raise ValueError(f"accepted {n} drafts of {drafts_per_req}")
    per_pos = [sum(1 for n in accept_lens if n > k) for k in range(drafts_per_req)]
    return StepStats(
        num_drafts=len(accept_lens),
        num_draft_tokens=len(accept_lens) * drafts_per_req,
        num_accepted_tokens=sum(accept_lens),
        accepted_per_pos=per_pos,
    )


def _last_value_gauge(name: str, documentation: str):
    """A gauge whose value is the last one set by any process (a scheduler's state)."""
    from prometheus_client import Gauge

    return Gauge(name, documentation, multiprocess_mode="mostrecent")


class PrometheusMetrics:
    """The metrics above in one process; create after PROMETHEUS_MULTIPROC_DIR is set."""

    def __init__(self, max_verify_width: int) -> None:
        widths = [float(n) for n in range(1, max_verify_width + 1)]  # histogram buckets
        self._acceptance_series(widths)
        self._step_series(widths)
        self._held_state_series()
        self._dropped_seen = 0
        # Touch every series so dashboards see them from the first scrape.
        self._positions = [
            self.accepted_per_pos.labels(str(k)) for k in range(max_verify_width - 1)
        ]
        for source in SOURCES:
            for counter in (self.drafts, self.draft_tokens, self.accepted, self.predicted_accepted):
                counter.labels(source)

    def _acceptance_series(self, widths: list[float]) -> None:
        """What was proposed, accepted and expected, per source and per draft position."""
        from prometheus_client import Counter, Histogram

        by_source = ["source"]
        self.drafts = Counter(
            PREFIX + "num_drafts", "Request-steps that verified a proposal.", by_source
        )
        self.draft_tokens = Counter(
            PREFIX + "num_draft_tokens", "Proposed tokens offered for verification.", by_source
        )
        self.accepted = Counter(
            PREFIX + "num_accepted_tokens", "Proposed tokens accepted by the target.", by_source
        )
        self.predicted_accepted = Counter(
            PREDICTED_ACCEPTED.removesuffix("_total"),
            "Proposed tokens the adaptive planner expected the target to accept.",
            by_source,
        )
        self.accepted_per_pos = Counter(
            PREFIX + "num_accepted_tokens_per_pos",
            "Drafted tokens accepted at each draft position (0-based).",
            ["position"],
        )
        self.acceptance_length = Histogram(
            PREFIX + "acceptance_length",
            "Tokens emitted per request per step (accepted drafts + bonus).",
            buckets=widths,
        )

    def _step_series(self, widths: list[float]) -> None:
        """Steps: how many, how wide, how long, and what the planner predicted."""
        from prometheus_client import Counter, Histogram

        self.request_steps = Counter(
            PREFIX + "num_request_steps", "Decode request-steps, speculating or not."
        )
        self.steps = Counter(PREFIX + "num_steps", "Decode steps.")
        self.plain_steps = Counter(
            PREFIX + "num_plain_steps", "Decode steps at verify width 1 (speculation off)."
        )
        self.step_width = Histogram(
            PREFIX + "step_verify_width",
            "Verify width per decode step.",
            buckets=widths,
        )
        self.verify_width = _last_value_gauge(
            PREFIX + "verify_width",
            "Tokens verified per request in the last step (anchor included).",
        )
        self.draft_seconds = Histogram(
            PREFIX + "draft_seconds", "Proposal time per step.", buckets=TIME_BUCKETS
        )
        self.verify_seconds = Histogram(
            PREFIX + "verify_seconds",
            "Target verify forward + acceptance time per step.",
            buckets=TIME_BUCKETS,
        )
        by_option = ["width", "drafter"]
        self.step_seconds = Histogram(
            STEP_SECONDS,
            "Decode step, start to next start (scheduler included), per option taken.",
            by_option,
            buckets=TIME_BUCKETS,
        )
        self.predicted_step_seconds = Histogram(
            PREDICTED_STEP_SECONDS,
            "Decode step time the adaptive planner predicted, per option taken.",
            by_option,
            buckets=TIME_BUCKETS,
        )

    def _held_state_series(self) -> None:
        """What the server holds between steps: draft-KV rows (written, held until read,
        reused from the radix cache, dropped unread) and the shared lookup's tokens."""
        from prometheus_client import Counter

        self.draft_kv_rows = _last_value_gauge(
            PREFIX + "draft_kv_rows",
            "Draft-KV rows holding injected target features (running and radix-cached).",
        )
        self.radix_reused = Counter(
            PREFIX + "radix_reused_draft_kv_tokens",
            "Prompt tokens whose draft KV was reused from the radix cache, not re-injected.",
        )
        self.held_rows = _last_value_gauge(
            PREFIX + "held_draft_kv_rows",
            "Committed draft-KV rows held until read, not written yet.",
        )
        self.dropped_rows = Counter(
            PREFIX + "dropped_draft_kv_rows",
            "Held draft-KV rows of finished requests dropped unread when the holder filled.",
        )
        self.shared_tokens = _last_value_gauge(
            SHARED_TOKENS,
            "Tokens the shared suffix lookup holds (warm-start corpus and finished outputs).",
        )

    def observe_step(
        self,
        plan: StepPlan,
        accept_lens: torch.Tensor,
        draft_seconds: float,
        verify_seconds: float,
    ) -> None:
        lens = accept_lens.tolist()
        self.steps.inc()
        self.request_steps.inc(len(lens))
        self.step_width.observe(plan.width)
        self.verify_width.set(plan.width)
        if plan.width == 1:
            self.plain_steps.inc()
        else:
            self._observe_drafts(plan, lens)
            self.draft_seconds.observe(draft_seconds)
        for n in lens:
            self.acceptance_length.observe(n + 1)
        self.verify_seconds.observe(verify_seconds)

    def _observe_drafts(self, plan: StepPlan, lens: list[int]) -> None:
        for source in SOURCES:
            rows = [r for r in range(len(lens)) if plan.source(r) == source]
            if not rows:
                continue
            stats = step_stats([lens[r] for r in rows], plan.width)
            self.drafts.labels(source).inc(stats.num_drafts)
            self.draft_tokens.labels(source).inc(stats.num_draft_tokens)
            self.accepted.labels(source).inc(stats.num_accepted_tokens)
            if plan.expected:
                self.predicted_accepted.labels(source).inc(sum(plan.expected[r] for r in rows))
            for k, count in enumerate(stats.accepted_per_pos):
                if count:
                    self._positions[k].inc(count)

    def observe_step_seconds(self, plan: StepPlan, measured: float) -> None:
        labels = (str(plan.width), "on" if plan.run_draft else "off")
        self.step_seconds.labels(*labels).observe(measured)
        self.predicted_step_seconds.labels(*labels).observe(plan.predicted_seconds)

    def observe_prefill(self, reused_prefix_tokens: int) -> None:
        if reused_prefix_tokens:
            self.radix_reused.inc(reused_prefix_tokens)

    def set_draft_kv_rows(self, rows: int) -> None:
        self.draft_kv_rows.set(rows)

    def set_held_rows(self, held: int, dropped_ever: int) -> None:
        """`dropped_ever`: the holder's running total (`HeldRows.dropped`)."""
        self.held_rows.set(held)
        if dropped_ever > self._dropped_seen:
            self.dropped_rows.inc(dropped_ever - self._dropped_seen)
            self._dropped_seen = dropped_ever

    def set_shared_tokens(self, tokens: int) -> None:
        self.shared_tokens.set(tokens)
