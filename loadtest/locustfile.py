"""Locust users for the OpenAI chat API, streaming: per-request TTFT, TPOT, tokens, errors.

Run by `loadtest.sweep` (one headless locust process per level), or by hand:

    locust -f loadtest/locustfile.py --headless -u 4 -r 4 -t 120s -H http://127.0.0.1:30000
        --prompts-file prompts.json --results-file results.jsonl --num-requests 16 --model default

Each user takes the next request index from a shared budget, sends prompt
`prompts[index % len(prompts)]`, and appends one JSON line per request to
`--results-file`; the user that finishes the last request stops the test, so a run is
bounded by `--num-requests` (and by locust's `-t` as a safety limit). Each request also
fires a locust request event (response time = end-to-end latency, length = output tokens)
so locust's own stats and CSV stay meaningful.

Locust imports this file by path, so it imports the package absolutely.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any

import gevent
import requests
from locust import User, events, task
from locust.exception import StopUser

from dflash_sglang.loadtest.chat_stream import (
    CHAT_PATH,
    StreamResult,
    chat_body,
    failed,
    measure_stream,
)


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    group = parser.add_argument_group("dflash chat load test")
    group.add_argument("--prompts-file", required=True, help="JSON list of prompt strings")
    group.add_argument("--results-file", required=True, help="JSONL, one line per request")
    group.add_argument("--num-requests", type=int, required=True, help="requests, then stop")
    group.add_argument("--max-tokens", type=int, default=128)
    group.add_argument("--model", required=True, help="the `model` field of each request")
    group.add_argument("--ignore-eos", action="store_true", help="always emit max_tokens")
    group.add_argument("--extra-body", default="{}", help="JSON merged into each request")
    group.add_argument("--request-timeout", type=float, default=600.0, help="seconds")


class _Run:
    """One test run's shared state: every user of this process reads it (greenlets: no locks)."""

    def __init__(self, prompts: list[str], num_requests: int, results: IO[str]) -> None:
        self.prompts = prompts
        self.total = num_requests
        self.results = results
        self.claimed = self.finished = 0

    def claim(self) -> int | None:
        """The next request index, or None when the budget is spent."""
        if self.claimed >= self.total:
            return None
        self.claimed += 1
        return self.claimed - 1

    def finish(self, record: dict[str, Any]) -> bool:
        """Write one finished request; True when it was the last."""
        self.results.write(json.dumps(record) + "\n")
        self.results.flush()
        self.finished += 1
        return self.finished == self.total


_run: _Run | None = None


@events.test_start.add_listener
def _on_test_start(environment, **_kwargs) -> None:
    global _run
    options = environment.parsed_options
    prompts = json.loads(Path(options.prompts_file).read_text(encoding="utf-8"))
    results = open(options.results_file, "w", encoding="utf-8")  # closed when locust quits
    _run = _Run(prompts, options.num_requests, results)


@events.quitting.add_listener
def _on_quitting(**_kwargs) -> None:
    if _run is not None:
        _run.results.close()


class ChatStreamUser(User):
    """Sends streamed chat completions back to back until the budget is spent."""

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.session = requests.Session()
        self.url = self.host.rstrip("/") + CHAT_PATH
        self.timeout = (10.0, options.request_timeout)
        self.request_options: dict[str, Any] = {
            "model": options.model,
            "max_tokens": options.max_tokens,
            "ignore_eos": options.ignore_eos,
            "extra": json.loads(options.extra_body),
        }

    @task
    def chat(self) -> None:
        assert _run is not None, "test_start sets up the run before users start"
        index = _run.claim()
        if index is None:
            raise StopUser()
        prompt_index = index % len(_run.prompts)
        body = chat_body(_run.prompts[prompt_index], **self.request_options)
        t_start = time.perf_counter()
        result, status = self._send(body, t_start)
        self._report(result)
        record = {"index": index, "prompt_index": prompt_index, "status": status}
        record |= {"t_start": t_start, "t_end": t_start + result.latency_s}
        if _run.finish(record | result.as_record()):
            gevent.spawn(self.environment.runner.quit)  # not from this greenlet: quit kills it

    def _send(self, body: dict[str, Any], t_start: float) -> tuple[StreamResult, int | None]:
        try:
            with self.session.post(self.url, json=body, stream=True, timeout=self.timeout) as r:
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}: {r.text[:200]}"
                    return failed(error, time.perf_counter() - t_start), r.status_code
                lines = (
                    (time.perf_counter(), line.decode("utf-8", "replace"))
                    for line in r.iter_lines(chunk_size=None)
                )
                return measure_stream(lines, t_start), r.status_code
        except requests.RequestException as e:
            return failed(f"{type(e).__name__}: {e}", time.perf_counter() - t_start), None

    def _report(self, result: StreamResult) -> None:
        self.environment.events.request.fire(
            request_type="POST",
            name=CHAT_PATH + " (stream)",
            response_time=result.latency_s * 1000.0,
            response_length=result.output_tokens,
            exception=RuntimeError(result.error) if result.error else None,
            context={},
        )
