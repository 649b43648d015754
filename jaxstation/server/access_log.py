"""Request logging: one access line per HTTP request, as plain text or as one JSON object per line.

A station's own log should show what it served and what it refused, not only the client. The line holds the method,
the path (never the query), the status, the duration, the prompt and generated token counts a route reports, and on a
4xx the field the error names. Never a body, a prompt's text or a header (so never the API key).

Routes report token counts by setting `request.state.token_counts` to a callable returning (prompt, generated): it is
called when the response has been sent, so a stream reports what it streamed.

JSON mode (`MOONSHINE_LOG_FORMAT=json`) formats every log record, the station's and uvicorn's, as one JSON object
per line with the fields Cloud Run's logging reads: `severity`, `message`, and for access lines `httpRequest`.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("jaxstation.access")

PROBES = frozenset({"/health", "/ready"})
_ERROR_BODY_LIMIT = 8192  # bytes of a 4xx body kept to find the refused field


def _refused_field(body: bytes) -> str | None:
    """The field a 4xx names: OpenAI's `error.param` or /generate's `error.field`."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict):
        return None
    field = error.get("param") or error.get("field")
    return field if isinstance(field, str) else None


class AccessLogMiddleware:
    """Pure ASGI, outermost of the station's middleware, so that 401s and the routes' replies are all logged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering
        error_body = bytearray()
        state = scope.setdefault("state", {})  # Starlette's request.state

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and 400 <= status < 500:
                error_body.extend(message.get("body", b"")[:_ERROR_BODY_LIMIT - len(error_body)])
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            counts: Callable[[], tuple[int, int]] | None = state.get("token_counts")
            prompt, generated = counts() if counts is not None else (None, None)
            refused = _refused_field(bytes(error_body)) if 400 <= status < 500 else None
            access_line(scope, status, time.perf_counter() - t0, prompt, generated, refused)


def access_line(scope: Scope, status: int, duration_s: float, prompt_tokens: int | None,
                generated_tokens: int | None, refused: str | None) -> None:
    """Log one request: INFO for 1xx-3xx, WARNING for 4xx and 503 (loading, full or draining: the station works as
    designed), ERROR for other 5xx; DEBUG for the probes (GET /health and /ready), which a load balancer polls and
    which answer 503 as designed while the station loads or drains."""
    method, path = scope["method"], scope["path"]
    parts = [f"{method} {path} {status} {duration_s * 1000:.1f} ms"]
    if prompt_tokens is not None:
        parts.append(f"prompt_tokens={prompt_tokens} generated_tokens={generated_tokens}")
    if refused is not None:
        parts.append(f"refused={refused}")
    client = scope.get("client")
    http_request = {
        "requestMethod": method, "requestUrl": path, "status": status, "latency": f"{duration_s:.6f}s",
        "protocol": f"HTTP/{scope.get('http_version', '1.1')}",
        **({"remoteIp": client[0]} if client else {}),
    }
    fields = {"prompt_tokens": prompt_tokens, "generated_tokens": generated_tokens, "refused": refused}
    if method == "GET" and path in PROBES:
        level = logging.DEBUG
    else:
        level = logging.ERROR if status >= 500 and status != 503 else logging.WARNING if status >= 400 else logging.INFO
    log.log(level, " ".join(parts), extra={"http_request": http_request,
                                           "access": {k: v for k, v in fields.items() if v is not None}})


class JsonFormatter(logging.Formatter):
    """One JSON object per record: Cloud Run's `severity` and `message`, plus `httpRequest` on access lines."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        entry: dict[str, Any] = {
            "severity": record.levelname,
            "message": message,
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "logger": record.name,
        }
        http_request = getattr(record, "http_request", None)
        if http_request is not None:
            entry["httpRequest"] = http_request
            entry.update(getattr(record, "access", {}))
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(log_format: str) -> None:
    """In JSON mode, format every handler of the root logger (adding one on stderr if it has none) as JSON."""
    if log_format != "json":
        return
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    for handler in root.handlers:
        handler.setFormatter(JsonFormatter())
