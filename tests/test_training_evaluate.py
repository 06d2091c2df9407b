"""`evaluate --server-url --baseline-url`: τ, histogram and the interleaved single-stream
speedup measured through a DFLASH_X server and a plain one on the same target."""

from __future__ import annotations

import pytest

from dflash_sglang.training.evaluate import through_server

pytestmark = pytest.mark.server


def test_server_pass_reports_tau_histogram_and_baseline(live_dflash, live_ar):
    prompts = [[5, 9, 13, 2], [7, 7, 1], [3, 30, 31, 32, 8], [11, 4]]
    entry = through_server(live_dflash.url, prompts, 24, 8, baseline_url=live_ar.url)
    hist = entry["histogram"]
    assert len(hist) == 8 and sum(hist) == entry["steps"] > 0
    assert entry["tau"] == pytest.approx(sum((n + 1) * c for n, c in enumerate(hist)) / sum(hist))
    assert entry["same_output_as_baseline"] == len(prompts)  # fp32: speculation is lossless
    assert entry["speedup"] == pytest.approx(entry["tokens_per_s"] / entry["baseline_tokens_per_s"])
    assert 0 < entry["output_tokens"] <= 24 * len(prompts)


def test_server_pass_without_baseline_has_no_speedup(live_dflash):
    entry = through_server(live_dflash.url, [[5, 9, 13, 2]], 8, 8)
    assert "speedup" not in entry and 0 < entry["output_tokens"] <= 8
