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


class StationError(Exception):
    """An error in the station's shape: `{"error": {"message", "field"}}`."""

    def __init__(self, status: int, message: str, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field, self.headers = status, message, field, headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "field": self.field}}, self.status,
                            headers=self.headers)


class ApiError(Exception):
    """An error of the API faces (OpenAI's, Responses' and Anthropic's Messages), with OpenAI's fields: its own body
    is OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`; a route's `Failure` renders it in the shape of
    the route's API."""

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
        return ApiError(status, message, field, code, headers=headers).response()
    return StationError(status, message, field, headers=headers).response()


_NO_BODY = object()


def _parts(loc: tuple[int | str, ...], body: Any, missing: bool = False) -> list[int | str]:
    """The parts of an error's location that are fields or indices, less the union tags pydantic puts in it (`str`,
    `list[...]`, a discriminator's tag): walked along `body` (the request as sent), a part that names no key or index
    of the value there is a tag, and so is a key the next part names too (a tag that is also a field's name, as
    `text` in `{"type": "text", "text": ...}`). `missing`: the last part is a field the body lacks. Without the body,
    a part with a space is a tag (`hosted_tools`' tags)."""
    if body is _NO_BODY:
        return [part for part in loc if not (isinstance(part, str) and " " in part)]
    out, value = [], body
    for k, part in enumerate(loc):
        last = k == len(loc) - 1
        if isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        elif isinstance(value, dict) and part in value and (last or loc[k + 1] not in value):
            value = value[part]
        elif part != "[key]" and not (last and missing and isinstance(value, dict)):  # [key]: the key at fault
            continue
        out.append(part)
    return out


def field_path(loc: tuple[int | str, ...], body: Any = _NO_BODY, missing: bool = False) -> str:
    """('messages', 0, 'role') -> 'messages[0].role', less union tags (`_parts`)."""
    out = ""
    for part in _parts(loc, body, missing):
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[:_REPR_LIMIT] + "..."


def describe(error: ValidationError, body: Any = _NO_BODY) -> tuple[str, str, str]:
    """The first problem in `error` as (field, message, kind), kind being 'unknown', 'missing' or 'invalid'; `body`
    is the request as sent, for naming fields past unions.

    A union reports one error per member, each under the member's tag. When one member alone took the value (its type
    fits: a list, an object) and failed only inside it, its errors are what the client meant, and the field named is
    the one inside at fault, such as `input[2].content`. Otherwise (or for an element of no known kind) it is the
    union's own (the common prefix of the errors), and the message lists why each form was refused.
    """
    return _describe(error.errors(include_url=False), body)


def _describe(errors: list[dict], body: Any) -> tuple[str, str, str]:
    first = errors[0]
    loc = tuple(first["loc"])
    if not loc:
        return "body", "the body must be a JSON object", "invalid"
    if first["type"] in ("extra_forbidden", "missing"):
        field = field_path(loc, body, missing=True)
        if first["type"] == "missing":
            return field, f"missing required field {field!r}", "missing"
        return field, f"unsupported field {field!r}", "unknown"
    siblings = [e for e in errors if e["loc"][:1] == loc[:1]]
    common = loc
    for other in siblings[1:]:
        n = 0
        while n < min(len(common), len(other["loc"])) and common[n] == other["loc"][n]:
            n += 1
        common = common[:n]
    at = len(common)
    depth = len(_parts(common, body))
    if len(siblings) > 1 and at < len(loc) and (body is _NO_BODY or len(_parts(loc[:at + 1], body)) == depth):
        members = [e for e in siblings if len(e["loc"]) > at]  # a union: every form was refused
        inside = [e for e in members if len(_parts(tuple(e["loc"]), body, e["type"] == "missing")) > depth
                  and not e["type"].startswith("union_tag")]  # an element of no known kind: the union is named
        took = {e["loc"][at] for e in members if e in inside or not (
            e["type"].endswith("_type") or e["type"] in ("literal_error", "union_tag_invalid"))}  # e.g. too_long
        if len(took) == 1 and len(inside) == sum(e["loc"][at] in took for e in members):
            return _describe(inside, body)  # one member took the value: its own errors say what is wrong
        field = field_path(common, body)
        reasons = "; ".join(f"as {e['loc'][at]}: {e['msg'].lower()}" for e in members)
        return field, f"{field} has no accepted form, got {_shown(first['input'])} ({reasons})", "invalid"
    field = field_path(loc, body)
    return field, f"{field}: {first['msg'].lower()}, got {_shown(first['input'])}", "invalid"
