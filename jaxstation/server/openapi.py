"""Routes declared once, with their bodies as pydantic models, and the OpenAPI document generated from them.

Each `Endpoint` names its path, method, handler, request model, reply model and error shape. The app's routes and
`GET /openapi.json` are both made from the same list, so the document cannot drift from what the station serves.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pydantic import BaseModel, TypeAdapter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

_REF = "#/components/schemas/{model}"
OPEN_PATHS = frozenset({"/health", "/ready", "/api/hello"})  # never need the API key
_STATUS_TEXT = {400: "Bad request: the error names the field", 401: "A missing or wrong API key",
                404: "No such resource", 409: "A conflict: a name already taken, or no room left",
                413: "The body is over the size limit",
                422: "A field is invalid: the error names it",
                500: "A step failed", 502: "A mesh station stayed down",
                503: "Not ready, draining, or the queue is full"}


@dataclasses.dataclass(frozen=True)
class Endpoint:
    path: str
    method: str
    handler: Callable[[Request], Awaitable[Response]]
    summary: str
    response: Any  # the 200 JSON body's type; None for a non-JSON reply (media_type)
    errors: type[BaseModel]  # the error shape of this route's 4xx and 5xx replies
    request: Any = None  # the JSON body's type (a model or a union of models); None: no body
    statuses: tuple[int, ...] = (400, 413, 503)  # the error statuses it may answer, beside 401 with a key set
    media_type: str = "application/json"
    stream: bool = False  # with "stream": true, the reply is server-sent events of `stream_chunk`
    stream_chunk: Any = None
    stream_done: bool = True  # a stream ends with a "[DONE]" event (OpenAI's chunks; not its named events)
    ok_statuses: tuple[int, ...] = (200,)  # the statuses whose body is `response` (/ready's 503 is a status too)

    def route(self) -> Route:
        return Route(self.path, self.handler, methods=[self.method])


def routes(endpoints: Sequence[Endpoint]) -> list[Route]:
    """One route per path: endpoints that share a path (GET and DELETE of one resource) are one route that
    dispatches on the method, so a 405 lists every method the path serves."""
    by_path: dict[str, dict[str, Endpoint]] = {}
    for e in endpoints:
        by_path.setdefault(e.path, {})[e.method] = e
    out = []
    for path, methods in by_path.items():
        if len(methods) == 1:
            out.append(next(iter(methods.values())).route())
            continue

        async def dispatch(request: Request, methods: dict[str, Endpoint] = methods) -> Response:
            return await methods["GET" if request.method == "HEAD" else request.method].handler(request)
        out.append(Route(path, dispatch, methods=list(methods)))
    return out


class _Schemas:
    """JSON schemas of the types the endpoints name, with their definitions gathered as components."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {}

    def ref(self, t: Any, mode: str) -> dict[str, Any]:
        schema = TypeAdapter(t).json_schema(ref_template=_REF, mode=mode)
        self.components.update(schema.pop("$defs", {}))
        if isinstance(t, type) and issubclass(t, BaseModel):
            self.components[t.__name__] = schema
            return {"$ref": _REF.format(model=t.__name__)}
        return schema


def openapi_document(endpoints: Sequence[Endpoint], *, title: str, version: str, api_key: bool) -> dict[str, Any]:
    """OpenAPI 3.1 for `endpoints`. api_key: whether the routes other than OPEN_PATHS need a bearer key."""
    schemas = _Schemas()
    paths: dict[str, Any] = {}
    for e in endpoints:
        ok: dict[str, Any] = {"schema": schemas.ref(e.response, "serialization")} if e.response is not None else {
            "schema": {"type": "string"}}
        content = {e.media_type: ok}
        error_ref = schemas.ref(e.errors, "serialization")
        if e.stream:  # each event's data is a chunk (or an error that ends the stream), then "[DONE]" if it has one
            chunk = {"contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [schemas.ref(e.stream_chunk, "serialization"), error_ref]}}
            data = {"type": "string", "anyOf": [chunk, {"const": "[DONE]"}],
                    "description": 'one JSON chunk per event; the last event is "[DONE]"'} if e.stream_done else {
                "type": "string", "anyOf": [chunk], "description": "one JSON event per server-sent event, named by "
                "its type"}
            content["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                                       "properties": {"event": {"type": "string"}, "data": data}}}
        error = {"application/json": {"schema": error_ref}}
        statuses = e.statuses + ((401,) if api_key and e.path not in OPEN_PATHS else ())
        op: dict[str, Any] = {
            "summary": e.summary,
            "operationId": e.method.lower() + e.path.replace("/", "_"),
            "responses": {**{str(s): {"description": "OK" if s == 200 else _STATUS_TEXT[s], "content": content}
                             for s in e.ok_statuses},
                          **{str(s): {"description": _STATUS_TEXT[s], "content": error} for s in sorted(statuses)}},
        }
        if api_key and e.path in OPEN_PATHS:
            op["security"] = []
        if names := re.findall(r"{(\w+)}", e.path):
            op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                for n in names]
        if e.request is not None:
            op["requestBody"] = {"required": True,
                                 "content": {"application/json": {"schema": schemas.ref(e.request, "validation")}}}
        paths.setdefault(e.path, {})[e.method.lower()] = op
    doc: dict[str, Any] = {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
                           "components": {"schemas": schemas.components}}
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


def openapi_endpoint(endpoints: Sequence[Endpoint], errors: type[BaseModel], **info: Any
                     ) -> tuple[Endpoint, Callable[[], dict[str, Any]]]:
    """`GET /openapi.json`, the document of `endpoints` and of itself, and the function that builds it (once)."""
    cached: list[dict[str, Any]] = []

    def document() -> dict[str, Any]:
        if not cached:
            cached.append(openapi_document([*endpoints, me], **info))
        return cached[0]

    async def handler(request: Request) -> Response:
        return JSONResponse(document())

    me = Endpoint("/openapi.json", "GET", handler, "This document", response=dict[str, Any], errors=errors,
                  statuses=())
    return me, document
