"""Serving a run, for every face: start it (its constraint compiled off the event loop), wait for a whole reply, or
stream it through the one loop here, the face supplying only its events' encoding (an `Events`).

The loop runs on the request's event loop: the opening events, each update's events, the closing ones; a request
that fails mid-stream (a failed step, a constraint that allows no token) has its jobs cancelled and the stream ends
with the face's failure event (chat's error chunk, Responses' `response.failed`, Messages' `error`). A stream sends a
beat (an SSE comment, or the API's own ping) through every silence of KEEPALIVE_S, such as a long prompt's prefill.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxstation.chat.reasoning import pick_parser
from jaxstation.chat.request import ChatRequest, RunRequest, plan_chat
from jaxstation.chat.run import Run, Update
from jaxstation.model.default_model import DEFAULT_GGUF_NAME
from jaxstation.server.http_common import until_disconnect
from jaxstation.server.outcomes import API_INVALID, OUTCOMES, Disconnected, Failure, failure
from jaxstation.server.station import Station

KEEPALIVE_S = 5.0  # the longest a stream stays silent: a long prompt's prefill must not look like a dead peer
COMMENT = ": keep-alive\n\n"  # an SSE comment, which clients skip


def sse(data: dict, event: str | None = None) -> str:
    """One server-sent event, `event:` named when given."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def reply_body(reply: BaseModel) -> dict[str, Any]:
    """A reply model as sent: every field that was set, nulls included, and nothing else."""
    return reply.model_dump(mode="json", exclude_unset=True)


def served_model_names(station: Station) -> tuple[str, ...]:
    """The names /v1/models lists: --served-model-name's, else the checkpoint's file stem or directory name."""
    if station.config.served_model_name:
        return station.config.served_model_name
    if station.model is not None:
        source = Path(station.model.source)
    elif station.config.model:
        source = Path(station.config.model)
    else:
        source = Path(DEFAULT_GGUF_NAME)
    return (source.name if source.is_dir() else source.stem,)


def served_model_name(station: Station) -> str:
    """The name replies carry."""
    return served_model_names(station)[0]


def station_reasoning(station: Station) -> str | None:
    """The reasoning parser `station` splits its model's thinking with (None: the thinking stays in the text)."""
    return pick_parser(station.config.reasoning_parser, station.model.tokenizer.chat_template)


def plan_on_station(station: Station, req: ChatRequest) -> RunRequest:
    """A chat request as `station` runs it, with the station's reasoning parser."""
    return plan_chat(req, station.model.tokenizer, station.model.cfg.vocab_size, station.config.max_request_tokens,
                     station.eos_ids, station.engine.token_controls, station_reasoning(station))


async def start_run(station: Station, req: RunRequest) -> Run:
    """Compile the request's constraint off the event loop and submit its run's jobs."""
    constraint = None
    if req.constraint is not None:
        constraint = await asyncio.to_thread(station.compile_constraint, req.constraint)
    run = Run(station, req, constraint)
    run.submit()
    return run


async def run_whole(run: Run, request: Request) -> Response | None:
    """Wait until a non-streamed run ends: None, or the reply instead (499 for a client gone, or the failure in the
    shape of the route's API)."""
    gone = asyncio.ensure_future(until_disconnect(request))
    try:
        while not run.done:
            await run.next(gone)
    except Disconnected:
        run.cancel_all()
        return Response(status_code=499)
    except OUTCOMES as e:
        run.cancel_all()
        return failure(e, API_INVALID).response(request.url.path)
    finally:
        gone.cancel()
    return None


class Events:
    """A face's encoding of a streamed run: each method returns the server-sent events to send."""

    def opening(self) -> list[str]:
        return []

    def update(self, update: Update) -> list[str]:
        raise NotImplementedError

    def closing(self) -> list[str]:
        """After the last update."""
        return []

    def failed(self, failed: Failure) -> list[str]:
        """The failure event that ends a stream whose run failed."""
        raise NotImplementedError

    def last(self) -> list[str]:
        """What ends every stream, whether it completed or failed."""
        return []


async def stream_events(run: Run, events: Events) -> AsyncIterator[str]:
    """A streamed run's server-sent events, in the face's encoding."""
    for event in events.opening():
        yield event
    try:
        while not run.done:
            update = await run.next()
            for event in events.update(update) if update is not None else ():
                yield event
        for event in events.closing():
            yield event
    except OUTCOMES as e:
        run.cancel_all()
        for event in events.failed(failure(e, API_INVALID)):
            yield event
    for event in events.last():
        yield event


async def keepalive(events: AsyncIterator[str], beat: str) -> AsyncIterator[str]:
    """`events`, with `beat` sent whenever they have been silent for KEEPALIVE_S seconds."""
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
            if not done:
                yield beat
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield event
    finally:
        if pending is not None:
            pending.cancel()


class SSEResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the stream ends (finished, failed or the client gone), and
    sends `beat` (an SSE comment, or the API's own ping) through silences such as a long prompt's prefill."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None, beat: str = COMMENT) -> None:
        super().__init__(keepalive(content, beat), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def stream_response(run: Run, events: Events, headers: dict[str, str] | None = None,
                    beat: str = COMMENT) -> SSEResponse:
    """The streamed reply of `run` in `events`' encoding; a client gone cancels its jobs."""
    return SSEResponse(stream_events(run, events), run.cancel_all, headers, beat)
