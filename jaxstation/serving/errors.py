"""The station's three error shapes, and how a pydantic validation error becomes one that names the field.

Under `/v1/messages`, errors take Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, the field
named in the message; elsewhere under `/v1/` and on vLLM's tokenizer routes, OpenAI's, `{"error": {"message", "type",
"param", "code"}}`; the station's own routes answer `{"error": {"message", "field"}}`. Either way the field is a path
into the body, such as `messages[0].role`, and the message says what was wrong with the value that was sent.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

_REPR_LIMIT = 60


class ApiError(Exception):
    """An error in the station's shape: `{"error": {"message", "field"}}`."""

    def __init__(self, status: int, message: str, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field, self.headers = status, message, field, headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "field": self.field}}, self.status,
                            headers=self.headers)


class OpenAIError(Exception):
    """An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    @property
    def type(self) -> str:
        if self.status == 401:
            return "authentication_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


OPENAI_PATHS = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's tokenizer routes answer as OpenAI
ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}  # any other status: api_error


def anthropic_body(status: int, message: str, field: str | None = None) -> dict:
    """An error in Anthropic's shape; the field at fault leads the message unless the message names it."""
    if field and field not in message:
        message = f"{field}: {message}"
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def error_response(path: str, status: int, message: str, field: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the shape the route at `path` answers in: OpenAI's under /v1/ and on vLLM's tokenizer routes, the
    station's elsewhere (the station's shape has no code), Anthropic's under /v1/messages."""
    if path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(anthropic_body(status, message, field), status, headers=headers)
    if path.startswith(OPENAI_PATHS):
        return OpenAIError(status, message, field, code, headers=headers).response()
    return ApiError(status, message, field, headers=headers).response()


def field_path(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'. A part with a space is a union's tag, not a field: left out."""
    out = ""
    for part in loc:
        if isinstance(part, str) and " " in part:
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[:_REPR_LIMIT] + "..."


def describe(error: ValidationError) -> tuple[str, str, str]:
    """The first problem in `error` as (field, message, kind), kind being 'unknown', 'missing' or 'invalid'.

    A union reports one error per member, each under the member's tag; the field named is then the union's own
    (the common prefix of those errors), and the message lists why each form was refused.
    """
    errors = error.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    if not loc:
        return "body", "the body must be a JSON object", "invalid"
    if first["type"] == "extra_forbidden":
        return field_path(loc), f"unsupported field {field_path(loc)!r}", "unknown"
    if first["type"] == "missing":
        return field_path(loc), f"missing required field {field_path(loc)!r}", "missing"
    siblings = [tuple(e["loc"]) for e in errors if e["loc"][:1] == loc[:1]]
    common = loc
    for other in siblings[1:]:
        n = 0
        while n < min(len(common), len(other)) and common[n] == other[n]:
            n += 1
        common = common[:n]
    if len(siblings) > 1 and len(common) < len(loc):  # a union: every form was refused
        field = field_path(common)
        reasons = "; ".join(f"as {e['loc'][len(common)]}: {e['msg'].lower()}" for e in errors
                            if tuple(e["loc"][:len(common)]) == common and len(e["loc"]) > len(common))
        return field, f"{field} has no accepted form, got {_shown(first['input'])} ({reasons})", "invalid"
    field = field_path(loc)
    return field, f"{field}: {first['msg'].lower()}, got {_shown(first['input'])}", "invalid"
