"""DFlash speculative-decoding metrics, each defined once (vLLM `spec_decode` conventions).

Exported by every scheduler process through SGLang's Prometheus multiprocess registry, so
they appear on SGLang's own `/metrics` next to `sglang:*`:

  dflash_num_drafts_total                          request-steps that verified a draft
  dflash_num_draft_tokens_total                    drafted tokens offered for verification
  dflash_num_accepted_tokens_total                 drafted tokens the target accepted
  dflash_num_accepted_tokens_per_pos_total{position="k"}  accepted at draft slot k (0-based)
  dflash_acceptance_length                         histogram: tokens emitted per request-step
  dflash_draft_seconds, dflash_verify_seconds      histograms: per step
  dflash_verify_width                              gauge: tokens verified per request (last step)
  dflash_draft_kv_rows                             gauge: draft-KV rows holding injected features
  dflash_radix_reused_draft_kv_tokens_total        prompt tokens whose draft KV came from the
                                                   radix cache instead of being injected again

Ratios are not exported; compute them over any window w (the bonus token is included in τ):
  τ (mean acceptance length) = 1 + rate(accepted[w]) / rate(drafts[w])
  acceptance rate            = rate(accepted[w]) / rate(draft_tokens[w])
  acceptance at position k   = rate(accepted_per_pos{position="k"}[w]) / rate(drafts[w])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PREFIX = "dflash_"
TIME_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


@dataclass(frozen=True)
class StepStats:
    """One decode step, counted the way the exported counters count."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]  # index k: requests that accepted draft slot k

    @property
    def mean_acceptance_length(self) -> float:
        """τ for this step: 1 + accepted / drafts (1.0 when nothing was drafted)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


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


class PrometheusMetrics:
    """The metrics above in one process; create after PROMETHEUS_MULTIPROC_DIR is set."""

    def __init__(self, max_verify_width: int) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.drafts = Counter(PREFIX + "num_drafts", "Request-steps that verified a draft.")
        self.draft_tokens = Counter(
            PREFIX + "num_draft_tokens", "Drafted tokens offered for verification."
        )
        self.accepted = Counter(
            PREFIX + "num_accepted_tokens", "Drafted tokens accepted by the target."
        )
        self.accepted_per_pos = Counter(
            PREFIX + "num_accepted_tokens_per_pos",
            "Drafted tokens accepted at each draft position (0-based).",
            ["position"],
        )
        self.acceptance_length = Histogram(
            PREFIX + "acceptance_length",
            "Tokens emitted per request per step (accepted drafts + bonus).",
            buckets=[float(n) for n in range(1, max_verify_width + 1)],
        )
        self.draft_seconds = Histogram(
            PREFIX + "draft_seconds", "Draft forward time per step.", buckets=TIME_BUCKETS
        )
        self.verify_seconds = Histogram(
            PREFIX + "verify_seconds",
            "Target verify forward + acceptance time per step.",
            buckets=TIME_BUCKETS,
        )
        self.verify_width = Gauge(
            PREFIX + "verify_width",
            "Tokens verified per request in the last step (anchor included).",
            multiprocess_mode="mostrecent",
        )
        self.draft_kv_rows = Gauge(
            PREFIX + "draft_kv_rows",
            "Draft-KV rows holding injected target features (running and radix-cached).",
            multiprocess_mode="mostrecent",
        )
        self.radix_reused = Counter(
            PREFIX + "radix_reused_draft_kv_tokens",
            "Prompt tokens whose draft KV was reused from the radix cache, not re-injected.",
        )
        # Touch each position so dashboards see every series from the first scrape.
        self._positions = [
            self.accepted_per_pos.labels(str(k)) for k in range(max_verify_width - 1)
        ]

    def observe_step(
        self,
        accept_lens: torch.Tensor,
        verify_width: int,
        draft_seconds: float,
        verify_seconds: float,
    ) -> None:
        lens = accept_lens.tolist()
        stats = step_stats(lens, verify_width)
        self.drafts.inc(stats.num_drafts)
        self.draft_tokens.inc(stats.num_draft_tokens)
        self.accepted.inc(stats.num_accepted_tokens)
        for k, count in enumerate(stats.accepted_per_pos):
            if count:
                self._positions[k].inc(count)
        for n in lens:
            self.acceptance_length.observe(n + 1)
        self.draft_seconds.observe(draft_seconds)
        self.verify_seconds.observe(verify_seconds)
        self.verify_width.set(verify_width)

    def observe_prefill(self, reused_prefix_tokens: int) -> None:
        if reused_prefix_tokens:
            self.radix_reused.inc(reused_prefix_tokens)

    def set_draft_kv_rows(self, rows: int) -> None:
        self.draft_kv_rows.set(rows)
