"""The load-test sweep: its pure parts, then a real locust sweep against two live servers."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_sglang.loadtest import chat_stream, prompt_sets, server_metrics, sweep_args
from dflash_sglang.loadtest.level_stats import percentile, steady, steady_window, summarize
from dflash_sglang.loadtest.report import LevelRow, set_speedups
from tests.server import free_port

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sse(payload: dict | str) -> str:
    return "data: " + (payload if isinstance(payload, str) else json.dumps(payload))


def delta(text: str | None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 8}}


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([3.0, 1.0, 4.0, 2.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 99, 3.97),
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([7.0], 99, 7.0),
        ([], 50, None),
    ],
    ids=["median-even", "p99-interpolated", "p0-min", "single", "empty"],
)
def test_percentile_is_linear_between_ranks(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_rejects_q_outside_0_100():
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_tpot_is_per_token_not_per_chunk():
    """8 tokens in 2 text chunks (a speculative step sends several at once)."""
    stream = [
        (0.1, sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})),
        (0.1, ""),
        (0.3, sse(delta("Hello"))),  # first token
        (0.8, sse(delta(" there, how are you"))),  # seven more, one verify step
        (0.8, sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})),
        (0.9, sse(USAGE)),
        (1.0, sse("[DONE]")),
    ]
    result = chat_stream.measure_stream(stream, start=0.0)
    assert result.error is None
    assert result.ttft_s == pytest.approx(0.3)
    assert result.latency_s == pytest.approx(1.0)
    assert (result.output_tokens, result.prompt_tokens, result.content_chunks) == (8, 12, 2)
    assert result.tpot_s == pytest.approx((1.0 - 0.3) / 7)  # per chunk it would be 0.7 / 1


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        ([sse(delta("a")), sse(USAGE)], "ended without \\[DONE\\]"),
        ([sse(delta("a")), sse("[DONE]")], "no usage chunk"),
        ([sse("{not json"), sse("[DONE]")], "not JSON"),
        ([sse({"error": {"message": "boom"}}), sse("[DONE]")], "error in stream: .*boom"),
    ],
    ids=["truncated", "no-usage", "malformed", "server-error"],
)
def test_bad_streams_are_errors(lines, error):
    result = chat_stream.measure_stream([(0.5, line) for line in lines], start=0.0)
    assert result.error is not None and pytest.approx(0.5) == result.latency_s
    assert re.search(error, result.error), result.error
    assert result.tpot_s is None and result.output_tokens == 0


def test_single_token_has_no_tpot():
    stream = [(0.2, sse(delta("a"))), (0.3, sse(USAGE | {"usage": {"completion_tokens": 1}}))]
    result = chat_stream.measure_stream([*stream, (0.4, sse("[DONE]"))], start=0.0)
    assert result.error is None and result.ttft_s == pytest.approx(0.2) and result.tpot_s is None


def test_chat_body_is_greedy_streamed_with_usage():
    body = chat_stream.chat_body(
        "hi", model="m", max_tokens=5, ignore_eos=True, extra={"skip_special_tokens": False}
    )
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["max_tokens"], body["ignore_eos"]) == (0, 5, True)
    assert body["skip_special_tokens"] is False and body["messages"][0]["content"] == "hi"


METRICS_BEFORE = """\
# TYPE dflash_num_drafts_total counter
dflash_num_drafts_total{proc="0"} 10.0
dflash_num_drafts_total{proc="1"} 5.0
# TYPE dflash_num_accepted_tokens_total counter
dflash_num_accepted_tokens_total{proc="0"} 7.0
dflash_num_accepted_tokens_total{proc="1"} 0.0
# TYPE dflash_verify_width gauge
dflash_verify_width 8.0
"""
METRICS_AFTER = (
    METRICS_BEFORE.replace('proc="0"} 10.0', 'proc="0"} 12.0')
    .replace('proc="1"} 5.0', 'proc="1"} 7.0')
    .replace('proc="1"} 0.0', 'proc="1"} 6.0')
)


def test_tau_from_counter_deltas_summed_over_processes():
    deltas = server_metrics.counter_deltas(
        server_metrics.parse(METRICS_BEFORE), server_metrics.parse(METRICS_AFTER)
    )
    assert deltas == {
        'dflash_num_drafts_total{proc="0"}': 2.0,
        'dflash_num_drafts_total{proc="1"}': 2.0,
        'dflash_num_accepted_tokens_total{proc="1"}': 6.0,
    }
    assert server_metrics.tau(deltas) == pytest.approx(1 + 6 / 4)
    assert server_metrics.parse(METRICS_AFTER).gauges == {"dflash_verify_width": 8.0}


def test_step_time_from_counter_deltas():
    key = server_metrics.sample_key
    labels = {"drafter": "on", "proc": "0", "width": "4"}
    assert server_metrics.split_key(key("dflash_step_seconds_sum", labels)) == (
        "dflash_step_seconds_sum",
        labels,
    )
    deltas = {
        key("dflash_step_seconds_count", labels): 2.0,
        key("dflash_step_seconds_sum", labels): 0.07,
        key("dflash_predicted_step_seconds_sum", labels): 0.06,
        key("dflash_step_seconds_bucket", labels | {"le": "0.05"}): 2.0,
    }
    times = server_metrics.step_time(deltas)
    assert list(times) == ["w4+draft"]
    assert times["w4+draft"] == pytest.approx(
        {"steps": 2.0, "measured_ms": 35.0, "predicted_ms": 30.0}
    )


def test_tau_is_none_without_drafts():
    assert server_metrics.tau({}) is None
    assert server_metrics.tau({"sglang:generation_tokens_total": 64.0}) is None


def record(t_start, t_end, tokens=10, ttft=0.1, tpot=0.01, error=None) -> dict:
    return dict(
        t_start=t_start, t_end=t_end, output_tokens=tokens, ttft_s=ttft, tpot_s=tpot, error=error
    )


def test_level_summary_counts_errors_and_wall_time():
    records = [
        record(0.0, 1.0, ttft=0.1, tpot=0.01),
        record(0.5, 2.0, ttft=0.3, tpot=0.03),
        record(1.0, 1.1, tokens=0, ttft=None, tpot=None, error="HTTP 500"),
    ]
    stats = summarize(records, planned=4)
    assert (stats.requests, stats.errors, stats.unfinished, stats.no_text) == (3, 1, 1, 0)
    assert stats.duration_s == pytest.approx(2.0) and stats.output_tok_s == pytest.approx(10.0)
    assert stats.ttft_p50_ms == pytest.approx(200.0) and stats.tpot_p99_ms == pytest.approx(29.8)
    assert stats.mean_output_tokens == pytest.approx(10.0)


def test_steady_window_starts_at_the_first_refill_and_ends_at_the_last_send():
    # Two users: the opening burst is the first two sends; the third send is the first refill.
    assert steady_window([0.0, 0.1, 3.0, 4.5, 6.0], users=2) == (3.0, 6.0)
    # One wave (no user took a second prompt): an empty window.
    assert steady_window([0.0, 0.1], users=2) == (0.1, 0.1)


def test_steady_throughput_leaves_out_the_opening_and_the_drain():
    # Two users, three requests each, 11 tokens over 1 s after a 0.1-s TTFT; user b's
    # requests take twice as long, so a runs dry at 3 s and b drains alone until 6 s.
    a = [record(t, t + 1.0, tokens=11, ttft=0.0) for t in (0.0, 1.0, 2.0)]
    b = [record(t, t + 2.0, tokens=11, ttft=0.0) for t in (0.0, 2.0, 4.0)]
    # Sends 0, 0, 1, 2, 2, 4: the window is [1, 4]. By 1 s a had streamed 11 + 1 (its second
    # request's first token) and by 4 s 33; b 1 + 10 / 2 = 6 by 1 s and 11 + 11 + 1 by 4 s.
    tokens, seconds = steady(a + b, users=2)
    assert seconds == pytest.approx(3.0)
    assert tokens == pytest.approx((33 - 12) + (23 - 6))
    stats = summarize(a + b, planned=6, users=2)
    assert stats.steady_tok_s == pytest.approx(38 / 3)
    assert stats.output_tok_s == pytest.approx(66 / 6)  # the whole run, the drain included
    # Without users, or with a window under two seconds, no steady figure.
    assert summarize(a + b, planned=6).steady_tok_s is None
    assert summarize(a[:2] + b[:1], planned=3, users=2).steady_tok_s is None


def test_steady_tokens_skip_failed_requests_and_count_partial_streams():
    failed = record(0.5, 0.6, tokens=0, ttft=None, tpot=None, error="HTTP 500")
    ok = [record(0.0, 4.0, tokens=41, ttft=0.0), record(0.0, 1.0, tokens=11, ttft=0.0)]
    late = record(3.0, 7.0, tokens=9, ttft=1.0)  # first token at 4 s, after the window
    tokens, seconds = steady([*ok, failed, late], users=1)
    # Sends 0, 0, 0.5, 3: window [0, 3]. The first request had streamed its first token at
    # 0 s and 1 + 40 * 3/4 = 31 by 3 s, the second 1 and 11; the failed and late ones nothing.
    assert seconds == pytest.approx(3.0)
    assert tokens == pytest.approx((31 - 1) + (11 - 1))


def test_speedup_is_against_the_baseline_at_the_same_level():
    def row(server, concurrency, tok_s):
        stats = summarize([record(0.0, 1.0, tokens=tok_s)], planned=1)
        return LevelRow(server, "u", concurrency, 1, stats, None, None, None, "r")

    rows = [row("dflash", 1, 30), row("fixed", 1, 10), row("baseline", 1, 20)]
    rows += [row("dflash", 2, 50), row("fixed", 2, 5), row("baseline", 2, 25)]
    set_speedups(rows, "baseline")
    assert [r.speedup for r in rows] == [
        pytest.approx(1.5), pytest.approx(0.5), None, pytest.approx(2.0), pytest.approx(0.2), None
    ]  # fmt: skip


def test_level_prompts_wrap_and_mixed_alternates_sets():
    assert prompt_sets.level_prompts(["a", "b", "c"], offset=2, count=4) == ["c", "a", "b", "c"]
    mixed = prompt_sets.load_prompts("mixed", seed=0, max_chars=4000)
    assert mixed[1].startswith("Complete the following Python function:")
    assert all(len(p) <= 4000 for p in mixed)
    assert prompt_sets.load_prompts("mt_bench", seed=1, max_chars=4000) != prompt_sets.load_prompts(
        "mt_bench", seed=2, max_chars=4000
    )


def test_shared_prefix_prompts_come_in_groups_sharing_an_article():
    prompts = prompt_sets.shared_prefix()
    groups = prompt_sets.SHARED_PREFIX_GROUPS
    assert len(prompts) == groups * 80  # every MT-Bench question once per group
    articles = {p.split("\n\nThen answer briefly:")[0] for p in prompts}
    assert len(articles) == groups and all(len(a) > 1500 for a in articles)
    assert len(set(prompts[:groups])) == groups  # consecutive prompts change group
    mixed = prompt_sets.load_prompts("mixed", seed=0, max_chars=4000)
    assert not any("Then answer briefly:" in p for p in mixed)  # not part of `mixed`


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--concurrency", "1,0"], "argument --concurrency: expected distinct positive"),
        (["--concurrency", "2,2"], "argument --concurrency"),
        (["--requests-per-level", "x"], "argument --requests-per-level: expected N or Nx"),
        (["--max-tokens", "0"], "argument --max-tokens: expected an integer >= 1"),
        (["--max-seconds-per-level", "inf"], "argument --max-seconds-per-level"),
        (["--extra-body", "[1]"], "argument --extra-body: expected a JSON object"),
        (["--dataset", "random"], "argument --dataset: invalid choice"),
        (["--also", "http://127.0.0.1:8"], "argument --also: expected LABEL=http"),
        (["--also", "fixed=127.0.0.1:8"], "argument --also: expected http(s)://host:port"),
        (["--also", "x=http://127.0.0.1:9"], "--also must differ from --url"),
        (["--also", "dflash=http://127.0.0.1:8"], "--also: label 'dflash' is taken by --url"),
    ],
    ids=[
        "zero-users",
        "duplicate",
        "bad-count",
        "no-tokens",
        "unbounded",
        "not-object",
        "random",
        "also-no-label",
        "also-no-scheme",
        "also-same-url",
        "also-same-label",
    ],
)
def test_bad_arguments_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        sweep_args.parse_args(["--url", "http://127.0.0.1:9", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_fails_before_any_load(capsys, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as exc:
        sweep_args.parse_args(["--url", dead, "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert f"--url {dead}: no OpenAI-compatible server" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_baseline_must_be_another_server(capsys):
    with pytest.raises(SystemExit):
        sweep_args.parse_args(
            ["--url", "http://127.0.0.1:9", "--baseline-url", "http://127.0.0.1:9/"]
        )
    assert "--baseline-url must differ from --url" in capsys.readouterr().err


@pytest.mark.server
def test_sweep_writes_csv_json_and_plots(live_dflash, live_ar, tmp_path):
    out = tmp_path / "sweep"
    # `--also`: the same DFlash server under another name (another URL for it), measured too.
    alias = live_dflash.url.replace("127.0.0.1", "localhost")
    assert alias != live_dflash.url
    # The installed module, from another directory, with a relative --out.
    cmd = [
        sys.executable, "-m", "dflash_sglang.loadtest.sweep",
        "--url", live_dflash.url, "--baseline-url", live_ar.url, "--also", f"alias={alias}",
        "--concurrency", "1,2", "--requests-per-level", "4", "--max-tokens", "16",
        "--ignore-eos", "--extra-body", '{"skip_special_tokens": false}',
        "--max-seconds-per-level", "120", "--out", "sweep",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    for name in ("sweep", "throughput", "tpot", "ttft", "tau"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC, name
    with (out / "sweep.csv").open() as f:
        rows = {(r["server"], int(r["concurrency"])): r for r in csv.DictReader(f)}
    assert set(rows) == {(s, c) for s in ("dflash", "alias", "baseline") for c in (1, 2)}
    for (server, _), row in rows.items():
        assert (row["requests"], row["errors"], row["unfinished"], row["no_text"]) == (
            "4", "0", "0", "0",
        )  # fmt: skip
        assert float(row["output_tok_s"]) > 0 and float(row["mean_output_tokens"]) == 16
        for column in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
            assert float(row[column]) > 0, (server, column)
        if server in ("dflash", "alias"):
            assert float(row["tau"]) > 1 and float(row["speedup"]) > 0
        else:
            assert row["tau"] == "" and row["speedup"] == ""

    report = json.loads((out / "sweep.json").read_text())
    assert report["config"]["servers"]["baseline"]["url"] == live_ar.url
    for level in report["levels"]:
        generated = sum(
            v for k, v in level["metrics_delta"].items()
            if k.startswith("sglang:generation_tokens_total")
        )  # fmt: skip
        assert generated == level["output_tokens"] == 4 * 16, level["server"]
        records = [json.loads(line) for line in (out / level["records_file"]).open()]
        assert len(records) == 4 and all(r["status"] == 200 for r in records)
        if level["server"] != "baseline":  # several tokens per chunk: chunks are not tokens
            assert sum(r["content_chunks"] for r in records) < level["output_tokens"]
