"""The OpenAI routes of a station: /v1/completions, /v1/chat/completions, /v1/models, and vLLM's /tokenize,
/detokenize and /tokenizer_info, declared as `Endpoint`s with their `openai.protocol` models.

The host side does the text work (tokenizing, chat templating, stop strings, incremental detokenizing, SSE); the
station stays token-in, token-out: every choice is one `Job` on the station's own scheduler, in the same batch as
`/generate`. Errors use OpenAI's shape: 400 validation, 401 a missing or wrong key, 503 (with Retry-After) a full
queue or a station not ready or draining, 500 a failed step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxstation.model.default_model import DEFAULT_GGUF_NAME
from jaxstation.model.tokenizer import Tokenizer
from jaxstation.openai import protocol as p
from jaxstation.openai.parse import RunRequest, parse_chat, parse_completion, parse_detokenize, parse_tokenize
from jaxstation.openai.reasoning import pick_parser
from jaxstation.openai.run import Choice, Run
from jaxstation.serving.errors import OpenAIError
from jaxstation.serving.http_common import read_json, until_disconnect
from jaxstation.serving.openapi import Endpoint
from jaxstation.serving.outcomes import OPENAI_INVALID, OUTCOMES, Disconnected, NotReady, check_ready, failure
from jaxstation.serving.routes import rejected
from jaxstation.serving.station import Station

KEEPALIVE_S = 5.0  # the longest a stream stays silent: a long prompt's prefill must not look like a dead peer
COMMENT = ": keep-alive\n\n"  # an SSE comment, which clients skip


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


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def tokenizer_config(tok: Tokenizer, max_model_len: int) -> p.TokenizerInfo:
    """What vLLM's /tokenizer_info returns (tokenizer_config.json's fields) and lm-eval's RemoteTokenizer reads:
    the special tokens' texts and ids, whether a BOS is prepended, the chat template and the vocabulary size."""
    info = p.TokenizerInfo(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token=tok.bos_token, eos_token=tok.eos_token, pad_token=tok.pad_token, unk_token=tok.unk_token,
        bos_token_id=tok.bos_id, eos_token_id=tok.eos_ids[0] if tok.eos_ids else None,
        pad_token_id=tok.pad_id, unk_token_id=tok.unk_id,
        add_bos_token=tok.add_bos, add_eos_token=False, model_max_length=max_model_len, vocab_size=tok.vocab_size)
    if tok.chat_template:
        info.chat_template = tok.chat_template
    return info


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


def wire(reply: BaseModel) -> dict[str, Any]:
    """A reply model as sent: every field that was set, nulls included, and nothing else."""
    return reply.model_dump(mode="json", exclude_unset=True)


def chat_request(station: Station, body: Any, cap: bool = False) -> RunRequest:
    """A chat completions body as the station runs it, with the station's reasoning parser. cap: a max_tokens past
    the context left is cut to it (the agents' APIs), not refused."""
    tok = station.model.tokenizer
    return parse_chat(body, tok, station.model.cfg.vocab_size, station.config.max_request_tokens, station.eos_ids,
                      station.engine.token_controls, pick_parser(station.config.reasoning_parser, tok.chat_template),
                      cap)


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
        return failure(e, OPENAI_INVALID).response(request.url.path)
    finally:
        gone.cancel()
    return None


class OpenAIRoutes:
    """The OpenAI-compatible routes on one station, sharing its scheduler with /generate."""

    def __init__(self, station: Station) -> None:
        self.station = station

    async def _body(self, request: Request) -> Any:
        return await read_json(request, self.station.config.max_body_bytes)

    def _tokenizer(self) -> Tokenizer:
        if self.station.model is None or self.station.model.tokenizer is None:
            raise NotReady("the model is not loaded yet")
        return self.station.model.tokenizer

    def _rejected(self, request: Request, error: Exception) -> Response:
        return rejected(self.station, request, error, OPENAI_INVALID)

    async def _start(self, request: Request, chat: bool) -> Run:
        """Parse the body and start its run."""
        station = self.station
        check_ready(station)
        body = await self._body(request)
        if chat:
            return await start_run(station, chat_request(station, body))
        return await start_run(station, parse_completion(
            body, station.model.tokenizer, station.model.cfg.vocab_size, station.config.max_request_tokens,
            station.eos_ids, station.engine.token_controls))

    async def completions(self, request: Request, chat: bool) -> Response:
        try:
            run = await self._start(request, chat)
        except OUTCOMES as e:
            return self._rejected(request, e)
        request.state.token_counts = lambda: (run.usage().prompt_tokens, run.usage().completion_tokens)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": served_model_name(self.station)}
        if run.req.stream:
            return SSEResponse(stream_events(run, head), run.cancel_all)
        return await run_whole(run, request) or JSONResponse(wire(whole_reply(run, head)))

    async def chat_completions(self, request: Request) -> Response:
        return await self.completions(request, chat=True)

    async def text_completions(self, request: Request) -> Response:
        return await self.completions(request, chat=False)

    async def models(self, request: Request) -> Response:
        now, limit = int(time.time()), self.station.config.max_request_tokens
        cards = [p.ModelCard(id=name, object="model", created=now, owned_by="jaxstation", max_model_len=limit)
                 for name in served_model_names(self.station)]
        adapters = self.station.adapters.residents() if self.station.adapters else []
        cards += [p.ModelCard(id=a.name, object="model", created=now, owned_by="jaxstation", max_model_len=limit,
                              root=a.path, parent=served_model_name(self.station)) for a in adapters]
        return JSONResponse(wire(p.ModelList(object="list", data=cards)))

    async def tokenize(self, request: Request) -> Response:
        try:
            tokens = parse_tokenize(await self._body(request), self._tokenizer())
        except OUTCOMES as e:
            return self._rejected(request, e)
        return JSONResponse(wire(p.TokenizeResponse(count=len(tokens), tokens=tokens,
                                                    max_model_len=self.station.config.max_request_tokens)))

    async def detokenize(self, request: Request) -> Response:
        try:
            tok = self._tokenizer()
            tokens = parse_detokenize(await self._body(request), self.station.model.cfg.vocab_size)
        except OUTCOMES as e:
            return self._rejected(request, e)
        return JSONResponse(wire(p.DetokenizeResponse(prompt=tok.decode(tokens))))

    async def tokenizer_info(self, request: Request) -> Response:
        try:
            tok = self._tokenizer()
        except OUTCOMES as e:
            return self._rejected(request, e)
        return JSONResponse(wire(tokenizer_config(tok, self.station.config.max_request_tokens)))

    def endpoints(self) -> list[Endpoint]:
        err = p.OpenAIErrorResponse
        limits = (400, 413, 500, 503)
        return [
            Endpoint("/v1/completions", "POST", self.text_completions, "OpenAI's completions", p.CompletionResponse,
                     err, request=p.CompletionRequest, statuses=limits, stream=True,
                     stream_chunk=p.CompletionResponse),
            Endpoint("/v1/chat/completions", "POST", self.chat_completions, "OpenAI's chat completions",
                     p.ChatCompletionResponse, err, request=p.ChatCompletionRequest, statuses=limits, stream=True,
                     stream_chunk=p.ChatCompletionChunk),
            Endpoint("/v1/models", "GET", self.models, "The served model", p.ModelList, err, statuses=()),
            Endpoint("/tokenize", "POST", self.tokenize, "vLLM's: a prompt or chat messages to token ids",
                     p.TokenizeResponse, err, request=p.TokenizeCompletionRequest | p.TokenizeChatRequest,
                     statuses=(400, 413, 503)),
            Endpoint("/detokenize", "POST", self.detokenize, "vLLM's: token ids to text", p.DetokenizeResponse, err,
                     request=p.DetokenizeRequest, statuses=(400, 413, 503)),
            Endpoint("/tokenizer_info", "GET", self.tokenizer_info, "vLLM's: the tokenizer's config", p.TokenizerInfo,
                     err, statuses=(503,)),
        ]


def openai_endpoints(station: Station) -> list[Endpoint]:
    """The OpenAI-compatible routes on `station`, sharing its scheduler with /generate."""
    return OpenAIRoutes(station).endpoints()


def whole_reply(run: Run, head: dict) -> p.ChatCompletionResponse | p.CompletionResponse:
    """The reply of a finished, non-streamed run."""
    choices = []
    for c in run.choices:
        if run.req.echo_texts is not None:
            prefix, lp = run.echo(c)
            c.text.insert(0, prefix)
        else:
            lp = run.logprobs_since(c)
        if not run.req.chat:
            choices.append(p.CompletionChoice(index=c.index, text="".join(c.text), logprobs=lp,
                                              finish_reason=c.finish))
            continue
        message = p.AssistantMessage(role="assistant", content="".join(c.answer))
        if c.tool is not None:
            message = p.AssistantMessage(role="assistant", content=c.tool.content,
                                         **({"tool_calls": c.tool.calls} if c.tool.calls else {}))
        if c.reasoning is not None and c.reasoning.text:
            message.reasoning_content = message.reasoning = c.reasoning.text
        choices.append(p.ChatChoice(index=c.index, message=message, logprobs=lp, finish_reason=c.finish))
    if run.req.chat:
        return p.ChatCompletionResponse(**head, object="chat.completion", choices=choices, usage=run.usage())
    return p.CompletionResponse(**head, object="text_completion", choices=choices, usage=run.usage())


def _chunk(run: Run, head: dict, c: Choice, text: str, finish: str | None, first: bool = False,
           calls: list[dict] | None = None, thinking: str = "") -> str:
    """One streamed chunk of choice `c`."""
    lp = run.logprobs_since(c, streaming=True)
    usage = {"usage": run.usage()} if run.req.continuous_usage else ({"usage": None} if run.req.include_usage else {})
    if not run.req.chat:
        choice = p.CompletionChoice(index=c.index, text=text, logprobs=lp, finish_reason=finish)
        return _sse(wire(p.CompletionResponse(**head, object="text_completion", choices=[choice], **usage)))
    delta = p.ChatDelta(role="assistant", content=text) if first else (
        p.ChatDelta(content=text) if text else p.ChatDelta())
    if calls:
        delta.tool_calls = [p.ToolCallDelta.model_validate(d) for d in calls]
    if thinking:
        delta.reasoning_content = delta.reasoning = thinking
    choice = p.ChatChunkChoice(index=c.index, delta=delta, logprobs=lp, finish_reason=finish)
    return _sse(wire(p.ChatCompletionChunk(**head, object="chat.completion.chunk", choices=[choice], **usage)))


def _usage_chunk(run: Run, head: dict) -> str:
    reply = p.ChatCompletionChunk if run.req.chat else p.CompletionResponse
    obj = "chat.completion.chunk" if run.req.chat else "text_completion"
    return _sse(wire(reply(**head, object=obj, choices=[], usage=run.usage())))


async def stream_events(run: Run, head: dict) -> AsyncIterator[str]:
    """A streamed run's server-sent events: the chat role first, then each update's text and each tool-call delta
    in a chunk of its own (the last chunk carries the finish), the usage if asked, and "[DONE]". A failure ends the
    stream with an error event."""
    try:
        if run.req.chat:
            for c in run.choices:
                yield _chunk(run, head, c, "", None, first=True)
        while not run.done:
            update = await run.next()
            if update is None:
                continue
            pieces = (([("", None, update.thinking)] if update.thinking else [])
                      + ([(update.text, None, "")] if update.text else [])
                      + [("", [d], "") for d in update.tool_deltas])
            if update.finished and not pieces:
                pieces = [("", None, "")]
            for k, (text, calls, thinking) in enumerate(pieces):
                last = update.finished and k == len(pieces) - 1
                yield _chunk(run, head, update.choice, text, update.choice.finish if last else None, calls=calls,
                             thinking=thinking)
        if run.req.include_usage:
            yield _usage_chunk(run, head)
    except OUTCOMES as e:
        run.cancel_all()
        f = failure(e, OPENAI_INVALID)
        yield _sse(OpenAIError(f.status, f.message, f.field, f.code).body())
    yield "data: [DONE]\n\n"
