"""Before a sweep: is an OpenAI-compatible server there, which model does it serve, warm it."""

from __future__ import annotations

import requests

from .chat_stream import CHAT_PATH

PROBE_TIMEOUT_S = 10.0


class ServerUnreachable(RuntimeError):
    pass


def served_model(base_url: str) -> str:
    """The first model id of GET /v1/models."""
    try:
        r = requests.get(base_url.rstrip("/") + "/v1/models", timeout=PROBE_TIMEOUT_S)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (requests.RequestException, ValueError, KeyError, IndexError) as e:
        raise ServerUnreachable(f"no OpenAI-compatible server answers GET /v1/models: {e}") from e


def warm_up(base_url: str, model: str, requests_count: int, timeout_s: float) -> None:
    """Unmeasured requests first, so one-time costs (lazy init, first allocation) stay out of
    the first level."""
    for i in range(requests_count):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Warm-up request {i}: say hello."}],
            "max_tokens": 8,
            "temperature": 0,
        }
        r = requests.post(base_url.rstrip("/") + CHAT_PATH, json=body, timeout=timeout_s)
        if r.status_code != 200:
            raise RuntimeError(
                f"warm-up request to {base_url} failed: HTTP {r.status_code}: {r.text[:300]}"
            )
