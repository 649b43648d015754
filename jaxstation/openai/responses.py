"""`/v1/responses`: OpenAI's Responses API, for Codex CLI, the Agents SDK and `client.responses`.

A request is translated into the station's chat request (`responses_input`) and runs as one `Run` on the station's
scheduler, sharing the template, the prefix cache, constraints, tool parsing, stop logic and the streaming loop with
the other APIs. The output's
items are built by one `Output` from the run's pieces, as they stream or at once, so a streamed response ends with
the same items a whole one has. Its events, each with a `sequence_number`: `response.created`,
`response.in_progress`; per item `response.output_item.added`, then for a message `response.content_part.added`,
`response.output_text.delta`s, `response.output_text.done`, `response.content_part.done`, for reasoning the same with
`response.reasoning_text.*`, for a function call `response.function_call_arguments.delta`s and `.done`; then
`response.output_item.done`; last `response.completed`, `response.incomplete` (max_output_tokens reached) or
`response.failed`. `GET` and `DELETE /v1/responses/{id}` read and drop stored responses; `POST .../cancel` answers
400, as only background responses can be cancelled and `background` is not served.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxstation.chat import hosted_tools
from jaxstation.chat.request import validate
from jaxstation.chat.run import Run, Update
from jaxstation.chat.stream import (
    Events,
    plan_on_station,
    reply_body,
    run_whole,
    served_model_name,
    sse,
    start_run,
    stream_response,
)
from jaxstation.openai import responses_protocol as r
from jaxstation.openai.protocol import REFUSED_FIELDS, OpenAIErrorResponse
from jaxstation.openai.responses_input import ResponseStore, chat_request, output_turn, turns
from jaxstation.server.errors import ApiError
from jaxstation.server.http_common import read_json
from jaxstation.server.openapi import Endpoint
from jaxstation.server.outcomes import API_INVALID, OUTCOMES, Failure, check_ready
from jaxstation.server.protocol import IgnoredFields
from jaxstation.server.routes import rejected
from jaxstation.server.station import Station


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Output:
    """A response's output items, built from a run's pieces (thinking, text, tool-call deltas), and the events that
    stream them. The open item's text is kept beside it, not in it, so `items` always validates as output items."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.open: dict | None = None
        self.open_text = ""  # the open message's or reasoning item's text so far
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict, part: dict | None) -> list[dict]:
        events = self.close()
        self.items.append(item)
        self.open = item
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        if part is not None:
            events.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def _append(self, kind: str, text: str, delta_event: str, **extra: Any) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress",
                        "content": []}
            else:
                part = {"type": "reasoning_text", "text": ""}
                item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
            events = self._start(item, part)
            self.open_text = ""
        self.open_text += text
        return events + [self.event(delta_event, **self._where(), content_index=0, delta=text, **extra)]

    def thinking(self, text: str) -> list[dict]:
        return self._append("reasoning", text, "response.reasoning_text.delta")

    def text(self, text: str) -> list[dict]:
        return self._append("message", text, "response.output_text.delta", logprobs=[])

    def call(self, delta: dict) -> list[dict]:
        """A chat tool-call delta: one with an id starts a function_call item; arguments extend it."""
        events = []
        if "id" in delta:
            events = self._start({"type": "function_call", "id": _id("fc"), "call_id": delta["id"],
                                  "name": delta["function"]["name"], "arguments": "", "status": "in_progress"}, None)
        if arguments := delta["function"].get("arguments"):
            self.open["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def close(self, status: str = "completed") -> list[dict]:
        """End the open item: its closing events, the item done."""
        item, events = self.open, []
        if item is None:
            return events
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", **self._where(), name=item["name"],
                                     arguments=item["arguments"]))
        else:
            text = self.open_text
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            part = ({"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                    if item["type"] == "message" else {"type": "reasoning_text", "text": text})
            events.append(self.event(done, **self._where(), content_index=0, text=text,
                                     **({"logprobs": []} if item["type"] == "message" else {})))
            events.append(self.event("response.content_part.done", **self._where(), content_index=0, part=part))
            item["content"] = [part]
        item["status"] = status if item["type"] == "message" else "completed"
        events.append(self.event("response.output_item.done", output_index=len(self.items) - 1, item=dict(item)))
        self.open = None
        return events

    def feed(self, thinking: str, text: str, deltas: list[dict]) -> list[dict]:
        return ((self.thinking(thinking) if thinking else []) + (self.text(text) if text else [])
                + [e for d in deltas for e in self.call(d)])


def _usage(run: Run) -> r.ResponseUsage:
    n = run.counts()
    return r.ResponseUsage(input_tokens=n.prompt, input_tokens_details=r.InputTokensDetails(cached_tokens=n.cached),
                           output_tokens=n.generated, output_tokens_details=r.OutputTokensDetails(
                               reasoning_tokens=n.thinking), total_tokens=n.prompt + n.generated)


class ResponsesRoutes:
    """The Responses API on one station, with its store."""

    def __init__(self, station: Station) -> None:
        self.station = station
        self.store = ResponseStore(station.config.responses_store_size, station.config.responses_store_age_s)
        self.ignored = IgnoredFields("/v1/responses")

    def _head(self, req: r.ResponsesRequest) -> dict[str, Any]:
        """The response object's fields that echo the request."""
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {
            "type": "text"}
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, r.FunctionChoice) else (
            req.tool_choice or "auto")
        return {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "error": None,
                "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "model": served_model_name(self.station),
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id,
                "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
                "store": req.store is not False, "temperature": req.temperature, "text": {"format": fmt},
                "tool_choice": choice, "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
                "top_p": req.top_p, "truncation": "disabled", "user": req.user, "metadata": req.metadata or {}}

    def response_object(self, head: dict, run: Run, out: Output, status: str | None = None) -> r.ResponseObject:
        finish = run.choices[0].finish
        if status is None:
            status = "incomplete" if finish == "length" else "completed"
        details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return r.ResponseObject.model_validate({**head, "status": status, "incomplete_details": details,
                                                "output": out.items, "usage": _usage(run) if finish else None})

    async def create(self, request: Request) -> Response:
        station = self.station
        try:
            check_ready(station)
            req = validate(r.ResponsesRequest, await read_json(request, station.config.max_body_bytes), REFUSED_FIELDS,
                           self.ignored)
            history: list[dict] = []
            if req.previous_response_id is not None:
                stored = self.store.get(req.previous_response_id)
                if stored is None:
                    raise ApiError(404, f"no stored response {req.previous_response_id!r} (stored responses "
                                   "are kept in memory, bounded, and lost on restart)", "previous_response_id",
                                   "not_found")
                history = stored.conversation
            run = await start_run(station, plan_on_station(station, chat_request(req, history)))
        except OUTCOMES as e:
            return rejected(station, request, e, API_INVALID)
        request.state.token_counts = lambda: (run.counts().prompt, run.counts().generated)
        head, extra = self._head(req), hosted_tools.headers(hosted_tools.skipped(req.tools))
        if req.stream:
            return stream_response(run, ResponseEvents(self, run, head, history, req), extra)
        if (stopped := await run_whole(run, request)) is not None:
            return stopped
        c, out = run.choices[0], Output()
        deltas = [{"id": k["id"], "function": {"name": k["function"]["name"], "arguments": k["function"]["arguments"]}}
                  for k in c.calls]
        out.feed(c.thinking, c.content or "", deltas)
        return JSONResponse(reply_body(self.finish(head, run, out, history, req)[0]), headers=extra)

    def finish(self, head: dict, run: Run, out: Output, history: list[dict], req: r.ResponsesRequest
                ) -> tuple[r.ResponseObject, list[dict]]:
        """A finished run's response, its open item closed (and the events closing it), kept if stored."""
        status = "incomplete" if run.choices[0].finish == "length" else "completed"
        events = out.close(status)
        response = self.response_object(head, run, out, status)
        if head["store"]:
            self.store.put(response, history + turns(req.input) + [output_turn(reply_body(response)["output"])])
        return response, events

    def _stored(self, request: Request) -> r.ResponseObject:
        response_id = request.path_params["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise ApiError(404, f"no stored response {response_id!r}", "response_id", "not_found")
        return stored.response

    async def retrieve(self, request: Request) -> Response:
        try:
            return JSONResponse(reply_body(self._stored(request)))
        except ApiError as e:
            return e.response()

    async def delete(self, request: Request) -> Response:
        try:
            response = self._stored(request)
        except ApiError as e:
            return e.response()
        self.store.delete(response.id)
        return JSONResponse(reply_body(r.DeletedResponse(id=response.id, object="response", deleted=True)))

    async def cancel(self, request: Request) -> Response:
        try:
            self._stored(request)
        except ApiError as e:
            return e.response()
        return ApiError(400, "only background responses can be cancelled, and background is not served",
                        "response_id", "invalid_value").response()

    def endpoints(self) -> list[Endpoint]:
        err = OpenAIErrorResponse
        one = "/v1/responses/{response_id}"
        return [
            Endpoint("/v1/responses", "POST", self.create, "OpenAI's Responses API", r.ResponseObject, err,
                     request=r.ResponsesRequest, statuses=(400, 404, 413, 500, 503), stream=True,
                     stream_chunk=r.StreamEvent, stream_done=False),
            Endpoint(one, "GET", self.retrieve, "A stored response", r.ResponseObject, err, statuses=(404,)),
            Endpoint(one, "DELETE", self.delete, "Forget a stored response", r.DeletedResponse, err,
                     statuses=(404,)),
            Endpoint(one + "/cancel", "POST", self.cancel, "Cancel a background response (not served)",
                     r.ResponseObject, err, statuses=(400, 404)),
        ]


def _sse(event: dict) -> str:
    return sse(event, event["type"])


class ResponseEvents(Events):
    """A streamed response's events: created and in_progress, each output item's, then completed or incomplete (the
    response stored), or failed."""

    def __init__(self, routes: ResponsesRoutes, run: Run, head: dict, history: list[dict],
                 req: r.ResponsesRequest) -> None:
        self.routes, self.run, self.head, self.history, self.req = routes, run, head, history, req
        self.out = Output()

    def opening(self) -> list[str]:
        response = reply_body(self.routes.response_object(self.head, self.run, self.out, "in_progress"))
        return [_sse(self.out.event(kind, response=response)) for kind in ("response.created", "response.in_progress")]

    def update(self, update: Update) -> list[str]:
        return [_sse(e) for e in self.out.feed(update.thinking, update.text, update.tool_deltas)]

    def closing(self) -> list[str]:
        response, events = self.routes.finish(self.head, self.run, self.out, self.history, self.req)
        done = self.out.event(f"response.{response.status}", response=reply_body(response))
        return [_sse(e) for e in events + [done]]

    def failed(self, failed: Failure) -> list[str]:
        response = {**reply_body(self.routes.response_object(self.head, self.run, self.out, "failed")),
                    "error": {"code": failed.code or "server_error", "message": failed.message}}
        return [_sse(self.out.event("response.failed", response=response))]


def responses_endpoints(station: Station) -> list[Endpoint]:
    """The Responses routes on `station`."""
    return ResponsesRoutes(station).endpoints()
