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

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxstation.engine.constraints import ConstraintError
from jaxstation.model.default_model import DEFAULT_GGUF_NAME
from jaxstation.model.tokenizer import Tokenizer
from jaxstation.openai import protocol as p
from jaxstation.openai.parse import parse_chat, parse_completion, parse_detokenize, parse_tokenize
from jaxstation.openai.run import Choice, Disconnected, Run, busy
from jaxstation.serving.errors import OpenAIError
from jaxstation.serving.http_common import BodyError, read_json, until_disconnect
from jaxstation.serving.openapi import Endpoint
from jaxstation.serving.station import Station


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the stream ends (finished, failed or the client gone)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def tokenizer_config(tok: Tokenizer, max_model_len: int) -> dict:
    """What vLLM's /tokenizer_info returns (tokenizer_config.json's fields) and lm-eval's RemoteTokenizer reads:
    the special tokens' texts and ids, whether a BOS is prepended, the chat template and the vocabulary size."""
    info = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token, "unk_token": tok.unk_token,
        "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_ids[0] if tok.eos_ids else None,
        "pad_token_id": tok.pad_id, "unk_token_id": tok.unk_id,
        "add_bos_token": tok.add_bos, "add_eos_token": False, "model_max_length": max_model_len,
        "vocab_size": tok.vocab_size,
    }
    if tok.chat_template:
        info["chat_template"] = tok.chat_template
    return info


def served_model_name(station: Station) -> str:
    """The name /v1/models lists and replies carry: the checkpoint's file stem or directory name."""
    if station.model is not None:
        source = Path(station.model.source)
    elif station.config.model:
        source = Path(station.config.model)
    else:
        source = Path(DEFAULT_GGUF_NAME)
    return source.name if source.is_dir() else source.stem


def openai_endpoints(station: Station) -> list[Endpoint]:
    """The OpenAI-compatible routes on `station`, sharing its scheduler with /generate."""
    metrics = station.metrics

    def rejected(err: OpenAIError) -> JSONResponse:
        metrics.requests.labels("invalid" if err.status < 500 else "rejected").inc()
        return err.response()

    def check_ready() -> None:
        if station.draining:
            raise OpenAIError(503, "the station is shutting down", None, "shutting_down")
        if station.scheduler is None or not station.ready.is_set():
            msg = f"the station failed to start: {station.load_error}" if station.load_error else "not ready yet"
            raise busy(msg)

    async def read_body(request: Request) -> Any:
        try:
            return await read_json(request, station.config.max_body_bytes)
        except BodyError as e:
            code = "too_large" if e.status == 413 else "invalid_value"
            raise OpenAIError(e.status, e.message, "body", code) from None

    async def completions(request: Request, chat: bool) -> Response:
        try:
            check_ready()
            body = await read_body(request)
            tok = station.model.tokenizer
            parse = parse_chat if chat else parse_completion
            req = parse(body, tok, station.model.cfg.vocab_size, station.config.max_request_tokens, station.eos_ids,
                        station.engine.token_controls)
            constraint = None
            if req.constraint is not None:
                constraint = await asyncio.to_thread(station.compile_constraint, req.constraint)
            run = Run(station, req, constraint)
            run.submit()
        except ConstraintError as e:
            return rejected(OpenAIError(400, e.message, e.field.split(".")[0], "invalid_value"))
        except OpenAIError as e:
            return rejected(e)
        request.state.token_counts = lambda: (run.usage()["prompt_tokens"], run.usage()["completion_tokens"])
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": ident, "object": "", "created": int(time.time()), "model": served_model_name(station)}
        if req.stream:
            return _SSEResponse(_stream(run, head), run.cancel_all)
        return await _complete(request, run, head)

    async def _complete(request: Request, run: Run, head: dict) -> Response:
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            while not run.done:
                await run.next(gone)
        except Disconnected:
            run.cancel_all()
            return Response(status_code=499)
        except OpenAIError as e:
            run.cancel_all()
            return e.response()
        finally:
            gone.cancel()
        choices = []
        for c in run.choices:
            if run.req.echo_texts is not None:
                prefix, lp = run.echo(c)
                c.text.insert(0, prefix)
            else:
                lp = run.logprobs_since(c)
            if run.req.chat:
                message: dict[str, Any] = {"role": "assistant", "content": "".join(c.text)}
                if c.tool is not None:
                    message["content"] = c.tool.content
                    if c.tool.calls:
                        message["tool_calls"] = c.tool.calls
                choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": c.finish})
            else:
                choices.append({"index": c.index, "text": "".join(c.text), "logprobs": lp,
                                "finish_reason": c.finish})
        obj = "chat.completion" if run.req.chat else "text_completion"
        return JSONResponse({**head, "object": obj, "choices": choices, "usage": run.usage()})

    async def _stream(run: Run, head: dict) -> AsyncIterator[str]:
        chat = run.req.chat
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        usage_null = {"usage": None} if run.req.include_usage else {}

        def chunk(c: Choice, text: str, finish: str | None, first: bool = False, calls: list[dict] | None = None
                  ) -> str:
            lp = run.logprobs_since(c, streaming=True)
            if chat:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                if calls:
                    delta["tool_calls"] = calls
                choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}
            usage = {"usage": run.usage()} if run.req.continuous_usage else usage_null
            return _sse({**head, "choices": [choice], **usage})

        try:
            if chat:
                for c in run.choices:
                    yield chunk(c, "", None, first=True)
            while not run.done:
                update = await run.next()
                if update is None:
                    continue
                # the text, then each tool-call delta in a chunk of its own; the last chunk carries the finish
                pieces = ([(update.text, None)] if update.text else []) + [("", [d]) for d in update.tool_deltas]
                if update.finished and not pieces:
                    pieces = [("", None)]
                for k, (text, calls) in enumerate(pieces):
                    last = update.finished and k == len(pieces) - 1
                    yield chunk(update.choice, text, update.choice.finish if last else None, calls=calls)
            if run.req.include_usage:
                yield _sse({**head, "choices": [], "usage": run.usage()})
        except OpenAIError as e:
            run.cancel_all()
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": served_model_name(station), "object": "model", "created": int(time.time()),
            "owned_by": "jaxstation", "max_model_len": station.config.max_request_tokens}]})

    def tokenizer() -> Tokenizer:
        if station.model is None or station.model.tokenizer is None:
            raise busy("the model is not loaded yet")
        return station.model.tokenizer

    async def tokenize(request: Request) -> Response:
        try:
            tokens = parse_tokenize(await read_body(request), tokenizer())
        except OpenAIError as e:
            return rejected(e)
        return JSONResponse({"count": len(tokens), "max_model_len": station.config.max_request_tokens,
                             "tokens": tokens})

    async def detokenize(request: Request) -> Response:
        try:
            tok = tokenizer()
            tokens = parse_detokenize(await read_body(request), station.model.cfg.vocab_size)
        except OpenAIError as e:
            return rejected(e)
        return JSONResponse({"prompt": tok.decode(tokens)})

    async def tokenizer_info(request: Request) -> Response:
        try:
            tok = tokenizer()
        except OpenAIError as e:
            return rejected(e)
        return JSONResponse(tokenizer_config(tok, station.config.max_request_tokens))

    err = p.OpenAIErrorResponse
    limits = (400, 413, 500, 503)
    return [
        Endpoint("/v1/completions", "POST", text_completions, "OpenAI's completions", p.CompletionResponse, err,
                 request=p.CompletionRequest, statuses=limits, stream=True, stream_chunk=p.CompletionResponse),
        Endpoint("/v1/chat/completions", "POST", chat_completions, "OpenAI's chat completions",
                 p.ChatCompletionResponse, err, request=p.ChatCompletionRequest, statuses=limits, stream=True,
                 stream_chunk=p.ChatCompletionChunk),
        Endpoint("/v1/models", "GET", models, "The served model", p.ModelList, err, statuses=()),
        Endpoint("/tokenize", "POST", tokenize, "vLLM's: a prompt or chat messages to token ids", p.TokenizeResponse,
                 err, request=p.TokenizeCompletionRequest | p.TokenizeChatRequest, statuses=(400, 413, 503)),
        Endpoint("/detokenize", "POST", detokenize, "vLLM's: token ids to text", p.DetokenizeResponse, err,
                 request=p.DetokenizeRequest, statuses=(400, 413, 503)),
        Endpoint("/tokenizer_info", "GET", tokenizer_info, "vLLM's: the tokenizer's config", p.TokenizerInfo, err,
                 statuses=(503,)),
    ]
