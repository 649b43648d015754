"""The suite's reply check (tests/reply_schema.py) finds a reply that strays from the document, JSON or streamed."""

from __future__ import annotations

import contextlib
import json

import pytest
from pydantic import BaseModel
from server_util import ServerThread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxstation.server.openapi import Endpoint, openapi_endpoint
from jaxstation.server.protocol import ErrorResponse


class Reply(BaseModel):
    count: int


def _app(body: dict, status: int = 200, stream: bool = False) -> Starlette:
    async def handler(request: Request) -> Response:
        if stream:
            async def events():
                yield "data: " + json.dumps(body) + "\n\ndata: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(body, status)

    endpoint = Endpoint("/count", "GET", handler, "a count", Reply, ErrorResponse, statuses=(400,), stream=True,
                        stream_chunk=Reply)
    doc, document = openapi_endpoint([endpoint], ErrorResponse, title="t", version="0", api_key=False)
    app = Starlette(routes=[endpoint.route(), doc.route()])
    app.state.openapi = document
    return app


@pytest.mark.parametrize("body, status, stream, problem", [
    ({"count": "three"}, 200, False, "GET /count 200: count: 'three' is not of type 'integer'"),
    ({"count": 3, "extra": 1}, 200, False, None),  # the document allows what pydantic's schema allows
    ({"count": 3}, 503, False, "GET /count: status 503 is not in the document"),
    ({"error": {"message": "m"}}, 400, False, "GET /count 400: error: 'field' is a required property"),
    ({"cnt": 3}, 200, True, "GET /count 200: the body: {'cnt': 3} is not valid under any of the given schemas"),
])
def test_a_reply_that_strays_from_the_document_fails_the_test(body, status, stream, problem) -> None:
    server = ServerThread(_app(body, status, stream))
    with pytest.raises(AssertionError, match="do not match") if problem else contextlib.nullcontext():
        with server, server.client() as http:  # the block ends cleanly: its exit raises on a stray reply
            assert http.get("/count").status_code == status
    assert server.replies.problems() == ([problem] if problem else [])
