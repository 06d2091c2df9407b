"""DFlash metrics on a live server whose acceptance is known exactly (the echo pair)."""

from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.prompts import SHORT
from tests.server import PURE_DFLASH, Server

pytestmark = pytest.mark.server
BLOCK = 4
MAX_NEW = 1 + 5 * BLOCK  # first token from prefill, then five full blocks
CHUNK = 64  # chunked prefill: a long prompt's later chunks have a prefix that is no radix hit


def scrape(server: Server) -> dict[tuple[str, tuple], float]:
    text = requests.get(server.url + "/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("dflash_")
    }


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def echo_server(echo_models, tmp_path_factory):
    server = Server(
        [
            "--model-path",
            str(echo_models["target"]),
            "--dtype",
            "float32",
            "--max-total-tokens",
            "4096",
            "--chunked-prefill-size",
            str(CHUNK),
            "--speculative-draft-model-path",
            str(echo_models["draft"]),
            *PURE_DFLASH,
        ],
        tmp_path_factory.mktemp("echo_logs") / "echo.log",
    )
    yield server
    server.stop()


def test_counters_match_known_full_acceptance(echo_server):
    before = scrape(echo_server)
    metas = [
        echo_server.generate(t, max_new_tokens=MAX_NEW, ignore_eos=True)["meta_info"]
        for t in SHORT[:4]
    ]
    after = scrape(echo_server)
    steps = sum(m["spec_verify_ct"] for m in metas)
    assert steps == 4 * 5
    dflash = {"source": "dflash"}
    assert delta(after, before, "dflash_num_drafts_total", **dflash) == steps
    assert delta(after, before, "dflash_num_draft_tokens_total", **dflash) == steps * (BLOCK - 1)
    assert delta(after, before, "dflash_num_accepted_tokens_total", **dflash) == steps * (BLOCK - 1)
    assert delta(after, before, "dflash_num_drafts_total", source="suffix") == 0
    # The planner's acceptance estimate rises towards the echo drafter's 100% from its prior.
    expected = delta(after, before, "dflash_predicted_accepted_tokens_total", **dflash)
    assert 0 < expected < steps * (BLOCK - 1)
    assert delta(after, before, "dflash_num_request_steps_total") == steps
    assert delta(after, before, "dflash_num_plain_steps_total") == 0
    # One request at a time: a decode step per request-step, each verifying the whole block.
    assert delta(after, before, "dflash_num_steps_total") == steps
    assert delta(after, before, "dflash_step_verify_width_sum") == steps * BLOCK
    for k in range(BLOCK - 1):
        assert (
            delta(after, before, "dflash_num_accepted_tokens_per_pos_total", position=str(k))
            == steps
        )
    assert all(m["spec_accept_length"] == pytest.approx(MAX_NEW / 5) for m in metas)
    assert delta(after, before, "dflash_acceptance_length_bucket", le=str(float(BLOCK))) == steps
    assert delta(after, before, "dflash_acceptance_length_bucket", le="3.0") == 0
    assert after[("dflash_verify_width", ())] == BLOCK
    assert delta(after, before, "dflash_draft_seconds_count") == 5 * 4
    # Step time per option taken: a step is timed at the next one's start, so each request's
    # last one (a prefill follows) is not; the planner's prediction beside each.
    option = {"width": str(BLOCK), "drafter": "on"}
    assert delta(after, before, "dflash_step_seconds_count", **option) == 4 * 4
    assert delta(after, before, "dflash_predicted_step_seconds_count", **option) == 4 * 4
    assert delta(after, before, "dflash_predicted_step_seconds_sum", **option) > 0
    assert delta(after, before, "dflash_verify_seconds_sum") > 0


def test_radix_reuse_and_draft_kv_rows(echo_server):
    prompt = SHORT[7] + " " + SHORT[8]
    echo_server.generate(prompt, max_new_tokens=4, ignore_eos=True)
    before = scrape(echo_server)
    meta = echo_server.generate(prompt, max_new_tokens=4, ignore_eos=True)["meta_info"]
    after = scrape(echo_server)
    assert meta["cached_tokens"] > 0
    assert (
        delta(after, before, "dflash_radix_reused_draft_kv_tokens_total") == meta["cached_tokens"]
    )
    assert after[("dflash_draft_kv_rows", ())] > 0
    # The last step's committed rows wait for a reader (CPU); none were dropped unread.
    assert after[("dflash_held_draft_kv_rows", ())] > 0
    assert after[("dflash_dropped_draft_kv_rows_total", ())] == 0


def test_radix_reuse_counts_no_chunked_prefill_prefix(echo_server):
    """Later chunks of a long prompt extend a prefix the cache did not provide."""
    prompt = " ".join(SHORT[10:16]) * 3
    before = scrape(echo_server)
    meta = echo_server.generate(prompt, max_new_tokens=4, ignore_eos=True)["meta_info"]
    after = scrape(echo_server)
    assert meta["prompt_tokens"] > 2 * CHUNK and meta["cached_tokens"] < CHUNK
    assert (
        delta(after, before, "dflash_radix_reused_draft_kv_tokens_total") == meta["cached_tokens"]
    )


def test_stats_endpoint_agrees_with_known_acceptance(echo_server):
    echo_server.generate(SHORT[9], max_new_tokens=MAX_NEW, ignore_eos=True)
    stats = requests.get(echo_server.url + "/dflash/stats", timeout=30).json()
    start = stats["since_start"]
    assert start["tau"] == pytest.approx(BLOCK)
    assert start["acceptance_rate"] == pytest.approx(1.0)
    assert start["acceptance_by_position"] == pytest.approx([1.0] * (BLOCK - 1))
    assert start["verify_width"] == BLOCK and start["output_tokens"] > 0
    times = start["step_time_by_option"]
    assert list(times) == [f"w{BLOCK}+draft"] and times[f"w{BLOCK}+draft"]["measured_ms"] > 0
    windowed = requests.get(echo_server.url + "/dflash/stats?window_steps=5", timeout=30).json()
    assert windowed["window"]["requested_steps"] == 5
    bad = requests.get(echo_server.url + "/dflash/stats?window_steps=0", timeout=30)
    assert 400 <= bad.status_code < 500 and "window_steps" in bad.text


def test_streamed_generation_reports_tokens_as_they_arrive(echo_server):
    """`Server.generate_stream` (the benchmarks' steady-window counts): a chunk once at least
    `stream_interval` tokens are unsent, each with the running token count."""
    prompt = list(range(10, 40))
    timeline = echo_server.generate_stream(prompt, 8, max_new_tokens=MAX_NEW, ignore_eos=True)
    times, counts = zip(*timeline, strict=True)
    assert list(times) == sorted(times) and list(counts) == sorted(counts)
    assert counts[-1] == MAX_NEW and len(timeline) >= MAX_NEW // 8
