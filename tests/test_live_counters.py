"""DFlash counters on a live server with partial acceptance agree with per-request meta_info."""

from __future__ import annotations

import pytest

from tests.prompts import SHORT
from tests.test_server_metrics import delta, scrape

pytestmark = pytest.mark.server
BLOCK = 8  # the `half_models` draft


def test_counters_are_consistent_with_meta_info(live_dflash):
    before = scrape(live_dflash)
    metas = [
        live_dflash.generate(p, max_new_tokens=40, ignore_eos=True)["meta_info"] for p in SHORT[:6]
    ]
    after = scrape(live_dflash)

    drafts = delta(after, before, "dflash_num_drafts_total", source="dflash")
    drafted = delta(after, before, "dflash_num_draft_tokens_total", source="dflash")
    accepted = delta(after, before, "dflash_num_accepted_tokens_total", source="dflash")
    per_pos = [
        delta(after, before, "dflash_num_accepted_tokens_per_pos_total", position=str(k))
        for k in range(BLOCK - 1)
    ]
    steps = sum(m["spec_verify_ct"] for m in metas)
    assert drafts == steps
    assert drafted == drafts * (BLOCK - 1)
    assert accepted <= drafted and sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    assert per_pos[0] <= drafts

    tau = 1 + accepted / drafts
    assert 1.2 < tau < BLOCK, "the pair should accept partially"
    hist_sum = delta(after, before, "dflash_acceptance_length_sum")
    assert hist_sum / delta(after, before, "dflash_acceptance_length_count") == pytest.approx(tau)

    # meta_info counts the prefill token and truncates a final step at max_new_tokens, so
    # per request the counters may exceed it by at most one block.
    completion = sum(m["completion_tokens"] for m in metas)
    tau_meta = sum(m["spec_accept_length"] * m["spec_verify_ct"] for m in metas) / steps
    assert tau_meta == pytest.approx(completion / steps)
    assert (completion - len(metas)) / steps <= tau + 1e-9
    assert tau == pytest.approx(tau_meta, abs=len(metas) * BLOCK / steps)
