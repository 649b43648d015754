"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, for Claude Code and the
Anthropic SDKs; and `GET /api/hello`, which Claude Code's connection check asks for.

A request is translated into the station's chat request (`anthropic.translate`) and runs as one `Run` on the
station's scheduler, so it shares the template, the prefix cache, constraints, tool parsing, stop strings and the
streaming loop with the OpenAI routes. A `max_tokens` past the context left is cut to it (the stop reason then says
`max_tokens`); a prompt that alone fills the context is a 400. Errors take Anthropic's shape (`server.errors`). The
stream is Anthropic's named events: `message_start`, `ping`, then per content block `content_block_start`,
`content_block_delta`s (`thinking_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`, then
`message_delta` (the stop reason and the usage) and `message_stop`; a failure ends it with an `error` event. With
`thinking.display: "omitted"` a thinking block comes without its text, streamed or not.
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxstation.anthropic import protocol as a
from jaxstation.anthropic.translate import chat_request, reply, shows_thinking, stop_reason, usage
from jaxstation.chat import hosted_tools
from jaxstation.chat.request import chat_prompt, validate
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
from jaxstation.server.errors import anthropic_body
from jaxstation.server.http_common import read_json
from jaxstation.server.openapi import Endpoint
from jaxstation.server.outcomes import API_INVALID, OUTCOMES, Failure, check_ready
from jaxstation.server.protocol import IgnoredFields
from jaxstation.server.routes import rejected
from jaxstation.server.station import Station


def _event(event: a.Reply | dict) -> str:
    data = event if isinstance(event, dict) else reply_body(event)
    return sse(data, data["type"])


class _Blocks:
    """A stream's content blocks: which one is open, and the events that open, extend and close them; a thinking
    block without its text unless `show_thinking`."""

    def __init__(self, show_thinking: bool) -> None:
        self.index, self.kind, self.show_thinking = -1, "", show_thinking

    def open(self, kind: str, block: a.ContentBlock) -> list[str]:
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        return out + [_event(a.BlockStart(type="content_block_start", index=self.index, content_block=block))]

    def close(self) -> list[str]:
        if not self.kind:
            return []
        self.kind = ""
        return [_event(a.BlockStop(type="content_block_stop", index=self.index))]

    def delta(self, delta: a.TextDelta | a.ThinkingDelta | a.InputJsonDelta) -> str:
        return _event(a.BlockDelta(type="content_block_delta", index=self.index, delta=delta))

    def thinking(self, text: str) -> list[str]:
        head = [] if self.kind == "thinking" else self.open("thinking", a.ThinkingOut(
            type="thinking", thinking="", signature=""))
        shown = [self.delta(a.ThinkingDelta(type="thinking_delta", thinking=text))] if self.show_thinking else []
        return head + shown

    def text(self, text: str) -> list[str]:
        head = [] if self.kind == "text" else self.open("text", a.TextOut(type="text", text=""))
        return head + [self.delta(a.TextDelta(type="text_delta", text=text))]

    def call(self, delta: dict) -> list[str]:
        """A chat tool-call delta: one with an id opens a tool_use block; arguments extend it."""
        out = []
        if "id" in delta:
            out = self.open("tool_use", a.ToolUseOut(type="tool_use", id=delta["id"],
                                                     name=delta["function"]["name"], input={}))
        if arguments := delta["function"].get("arguments"):
            out.append(self.delta(a.InputJsonDelta(type="input_json_delta", partial_json=arguments)))
        return out


class MessageEvents(Events):
    """A streamed run's events, in Anthropic's order; a failure ends them with an `error` event."""

    def __init__(self, run: Run, head: dict, show_thinking: bool) -> None:
        self.run, self.head, self.blocks = run, head, _Blocks(show_thinking)

    def opening(self) -> list[str]:
        start = a.MessageReply(**self.head, type="message", role="assistant", content=[], stop_reason=None,
                               stop_sequence=None, usage=usage(self.run))
        return [_event(a.MessageStart(type="message_start", message=start)), _event(a.Ping(type="ping"))]

    def update(self, update: Update) -> list[str]:
        blocks = self.blocks
        return ((blocks.thinking(update.thinking) if update.thinking else [])
                + (blocks.text(update.text) if update.text else [])
                + [e for d in update.tool_deltas for e in blocks.call(d)])

    def closing(self) -> list[str]:
        reason, sequence = stop_reason(self.run, self.run.choices[0])
        return self.blocks.close() + [
            _event(a.MessageDelta(type="message_delta", delta=a.MessageDeltaBody(
                stop_reason=reason, stop_sequence=sequence), usage=usage(self.run))),
            _event(a.MessageStop(type="message_stop"))]

    def failed(self, failed: Failure) -> list[str]:
        return [_event(anthropic_body(failed.status, failed.message, failed.field))]


class MessagesRoutes:
    """Anthropic's Messages API on one station."""

    def __init__(self, station: Station) -> None:
        self.station = station
        self.ignored = IgnoredFields("/v1/messages")

    async def _body(self, request: Request) -> Any:
        check_ready(self.station)
        return await read_json(request, self.station.config.max_body_bytes)

    async def messages(self, request: Request) -> Response:
        station = self.station
        try:
            req = validate(a.MessagesRequest, await self._body(request), ignored=self.ignored)
            run = await start_run(station, plan_on_station(station, chat_request(req)))
        except OUTCOMES as e:
            return rejected(station, request, e, API_INVALID)
        request.state.token_counts = lambda: (run.counts().prompt, run.counts().generated)
        head = {"id": f"msg_{uuid.uuid4().hex}", "model": served_model_name(station)}
        extra, shown = hosted_tools.headers(hosted_tools.skipped(req.tools)), shows_thinking(req)
        if run.req.stream:
            return stream_response(run, MessageEvents(run, head, shown), extra, beat=_event(a.Ping(type="ping")))
        return await run_whole(run, request) or JSONResponse(reply_body(reply(run, head, shown)), headers=extra)

    async def count_tokens(self, request: Request) -> Response:
        station = self.station
        try:
            req = validate(a.MessagesInput, await self._body(request), ignored=self.ignored)
            _, prompt = chat_prompt(chat_request(req), station.model.tokenizer)
        except OUTCOMES as e:
            return rejected(station, request, e, API_INVALID)
        return JSONResponse(reply_body(a.CountTokensReply(input_tokens=len(prompt))))

    async def hello(self, request: Request) -> Response:
        return JSONResponse(reply_body(a.HelloReply(status="ok")))

    def endpoints(self) -> list[Endpoint]:
        err = a.AnthropicErrorResponse
        return [
            Endpoint("/api/hello", "GET", self.hello, "Anthropic's: the server answers, with no key (Claude Code "
                     "opens its connection so)", a.HelloReply, err, statuses=()),
            Endpoint("/v1/messages", "POST", self.messages, "Anthropic's Messages API", a.MessageReply, err,
                     request=a.MessagesRequest, statuses=(400, 413, 500, 503), stream=True,
                     stream_chunk=a.StreamEvent, stream_done=False),
            Endpoint("/v1/messages/count_tokens", "POST", self.count_tokens, "Anthropic's: the prompt's tokens",
                     a.CountTokensReply, err, request=a.MessagesInput, statuses=(400, 413, 503)),
        ]


def anthropic_endpoints(station: Station) -> list[Endpoint]:
    """Anthropic's Messages routes on `station`."""
    return MessagesRoutes(station).endpoints()
