"""Request plumbing shared by the station's /generate route and the OpenAI routes: bounded JSON bodies and
disconnect detection. Each API maps `BodyError` into its own error shape."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

RETRY_AFTER_S = 1  # Retry-After on a 503 for a full queue or a station still loading


class BodyError(Exception):
    """A body that cannot be read as JSON (400) or is over the size limit (413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) past `limit` bytes by Content-Length or by the bytes actually received."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BodyError(400, f"invalid Content-Length {declared!r}")
        if int(declared) > limit:
            raise BodyError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int) -> Any:
    """The parsed body (see `read_body` for the limit), refusing (400) anything that is not strict JSON (NaN and
    Infinity included)."""
    body = await read_body(request, limit)
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except ValueError as e:  # JSONDecodeError and bad UTF-8 alike
        raise BodyError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise BodyError(400, "the body is nested too deeply") from None


async def until_disconnect(request: Request) -> None:
    """Return when the client goes away (the body is already read, so receive() only reports a disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
