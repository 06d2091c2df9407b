"""Request checks SGLang leaves out, answered with a 400 that names the field.

Found by trying the server as a client would and by fuzzing it: SGLang expands `n` into
that many copies of a request, so `"n": 0` became zero requests and a client waiting forever;
an empty prompt became an empty forward that killed the scheduler, and the server with it.
The checks run in a pure ASGI middleware before SGLang parses the body, and hand the body on
unchanged, so a request that passes is served exactly as before.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# SGLang answers larger bodies itself; we only look at what we can parse cheaply.
MAX_CHECKED_BODY_BYTES = 8 << 20
MAX_N = 128

Check = Callable[[dict[str, Any]], str | None]


def _bad_n(value: Any, field: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return f"`{field}` must be an integer, got {value!r}"
    if not 1 <= value <= MAX_N:
        return f"`{field}` must be between 1 and {MAX_N}, got {value}"
    return None


SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


def _bad_sampling(params: dict[str, Any], prefix: str) -> str | None:
    """Non-finite sampling numbers and an `n` SGLang cannot serve, in one parameter dict."""
    for field in SAMPLING_FIELDS:
        value = params.get(field)
        if isinstance(value, float) and not math.isfinite(value):
            return f"`{prefix}{field}` must be a finite number, got {value}"
    return _bad_n(params.get("n"), prefix + "n")


def _empty_prompt(body: dict[str, Any], field: str) -> str | None:
    """A prompt of zero tokens reaches the model as an empty forward and kills the scheduler
    (found by fuzzing): text "", ids [], or such an item of a batch."""
    value = body.get(field)
    batch = isinstance(value, list) and bool(value) and isinstance(value[0], list | str)
    for i, item in enumerate(value if batch else [value]):
        if isinstance(item, str | list) and not item:
            return f"`{field}[{i}]` must not be empty" if batch else f"`{field}` must not be empty"
    return None


def check_openai(body: dict[str, Any]) -> str | None:
    """`/v1/chat/completions` and `/v1/completions`: sampling fields at the top level."""
    return _empty_prompt(body, "prompt") or _bad_sampling(body, "")


def check_generate(body: dict[str, Any]) -> str | None:
    """`/generate`: sampling fields under `sampling_params` (one dict or one per prompt)."""
    if error := _empty_prompt(body, "text") or _empty_prompt(body, "input_ids"):
        return error
    params = body.get("sampling_params")
    batch = isinstance(params, list)
    for i, p in enumerate(params if batch else [params]):
        prefix = f"sampling_params[{i}]." if batch else "sampling_params."
        if isinstance(p, dict) and (error := _bad_sampling(p, prefix)):
            return error
    return None


CHECKS: dict[str, Check] = {
    "/v1/chat/completions": check_openai,
    "/v1/completions": check_openai,
    "/generate": check_generate,
}


def check(path: str, raw: bytes) -> str | None:
    """The reason to refuse a request body, or None to let SGLang handle it."""
    rule = CHECKS.get(path)
    if rule is None or len(raw) > MAX_CHECKED_BODY_BYTES:
        return None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None  # SGLang's own parser answers malformed JSON
    return rule(body) if isinstance(body, dict) else None


class RequestChecks:
    """Buffers a checked route's body, refuses it with 400 or replays it to the app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in CHECKS:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        raw = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        if (reason := check(scope["path"], raw)) is not None:
            response = JSONResponse(
                {"object": "error", "message": reason, "type": "BadRequestError", "code": 400},
                status_code=400,
            )
            await response(scope, receive, send)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def install(app) -> None:
    app.add_middleware(RequestChecks)
