"""One streamed OpenAI chat completion: its request body, and what its SSE stream measures.

Pure (no I/O): the locust user feeds it `(arrival time, line)` pairs, tests feed it a fake
stream. Output tokens come from the final usage chunk, never from counting chunks: a
speculative step emits several tokens in one chunk, so per-chunk latency (ITL) overstates
the time per token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

CHAT_PATH = "/v1/chat/completions"


def chat_body(
    prompt: str, *, model: str, max_tokens: int, ignore_eos: bool, extra: dict[str, Any]
) -> dict[str, Any]:
    """Greedy, streamed, with usage in the last chunk (`stream_options.include_usage`)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # SGLang extension: every request emits max_tokens
    return body | extra


@dataclass(frozen=True)
class StreamResult:
    """One request as measured by the client; times in seconds.

    `ttft_s`: request sent → first chunk carrying generated text. `latency_s`: request sent →
    end of stream (`[DONE]`). `tpot_s`: (latency − TTFT) / (output tokens − 1), the mean time
    per output token after the first, as in `sglang.bench_serving`; None below 2 tokens.
    """

    output_tokens: int
    prompt_tokens: int
    ttft_s: float | None
    latency_s: float
    content_chunks: int
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.error or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def as_record(self) -> dict[str, Any]:
        return asdict(self) | {"tpot_s": self.tpot_s}


def failed(error: str, latency_s: float) -> StreamResult:
    return StreamResult(0, 0, None, latency_s, 0, error)


def measure_stream(lines: Iterable[tuple[float, str]], start: float) -> StreamResult:
    """Read SSE `data:` lines (each with its arrival time) until `[DONE]`."""
    first_token_at: float | None = None
    usage: dict[str, Any] | None = None
    content_chunks = 0
    now = start
    for now, line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, SSE comments, `event:` lines
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            break
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            return failed(f"malformed stream: not JSON: {payload[:200]!r}", now - start)
        if "error" in chunk:
            return failed(f"error in stream: {str(chunk['error'])[:200]}", now - start)
        usage = chunk.get("usage") or usage
        if any(_has_text(c) for c in chunk.get("choices") or []):
            content_chunks += 1
            first_token_at = now if first_token_at is None else first_token_at
    else:
        return failed("malformed stream: ended without [DONE]", now - start)
    if usage is None or "completion_tokens" not in usage:
        return failed("malformed stream: no usage chunk (stream_options ignored?)", now - start)
    ttft = None if first_token_at is None else first_token_at - start
    return StreamResult(
        int(usage["completion_tokens"]),
        int(usage.get("prompt_tokens") or 0),
        ttft,
        now - start,
        content_chunks,
    )


def _has_text(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content"))
