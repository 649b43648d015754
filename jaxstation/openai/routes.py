"""The OpenAI routes of a station: /v1/completions, /v1/chat/completions, /v1/models, and vLLM's /tokenize,
/detokenize and /tokenizer_info, declared as `Endpoint`s with their `openai.protocol` models.

The host side does the text work (tokenizing, chat templating, stop strings, incremental detokenizing, SSE); the
station stays token-in, token-out: every choice is one `Job` on the station's own scheduler, in the same batch as
`/generate`. Errors use OpenAI's shape: 400 validation, 401 a missing or wrong key, 503 (with Retry-After) a full
queue or a station not ready or draining, 500 a failed step.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxstation.chat.request import RunRequest
from jaxstation.chat.run import Choice, Run, Update
from jaxstation.chat.stream import (
    Events,
    reply_body,
    run_whole,
    served_model_name,
    served_model_names,
    sse,
    start_run,
    station_reasoning,
    stream_response,
)
from jaxstation.model.tokenizer import Tokenizer
from jaxstation.openai import protocol as p
from jaxstation.openai.logprobs import echo, logprobs_since, usage
from jaxstation.openai.parse import parse_chat, parse_completion, parse_detokenize, parse_tokenize
from jaxstation.server.errors import ApiError
from jaxstation.server.http_common import read_json
from jaxstation.server.openapi import Endpoint
from jaxstation.server.outcomes import API_INVALID, OUTCOMES, Failure, NotReady, check_ready
from jaxstation.server.protocol import IgnoredFields
from jaxstation.server.routes import rejected
from jaxstation.server.station import Station


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


class OpenAIRoutes:
    """The OpenAI-compatible routes on one station, sharing its scheduler with /generate."""

    def __init__(self, station: Station) -> None:
        self.station = station
        self.ignored = {True: IgnoredFields("/v1/chat/completions"), False: IgnoredFields("/v1/completions")}

    async def _body(self, request: Request) -> Any:
        return await read_json(request, self.station.config.max_body_bytes)

    def _tokenizer(self) -> Tokenizer:
        if self.station.model is None or self.station.model.tokenizer is None:
            raise NotReady("the model is not loaded yet")
        return self.station.model.tokenizer

    def _rejected(self, request: Request, error: Exception) -> Response:
        return rejected(self.station, request, error, API_INVALID)

    async def _start(self, request: Request, chat: bool) -> Run:
        """Parse the body and start its run."""
        check_ready(self.station)
        body = await self._body(request)
        return await start_run(self.station, parse_request(self.station, body, chat, self.ignored[chat]))

    async def completions(self, request: Request, chat: bool) -> Response:
        try:
            run = await self._start(request, chat)
        except OUTCOMES as e:
            return self._rejected(request, e)
        request.state.token_counts = lambda: (run.counts().prompt, run.counts().generated)
        head = reply_head(self.station, chat)
        if run.req.stream:
            return stream_response(run, Chunks(run, head))
        return await run_whole(run, request) or JSONResponse(reply_body(whole_reply(run, head)))

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
        return JSONResponse(reply_body(p.ModelList(object="list", data=cards)))

    async def tokenize(self, request: Request) -> Response:
        try:
            tokens = parse_tokenize(await self._body(request), self._tokenizer())
        except OUTCOMES as e:
            return self._rejected(request, e)
        return JSONResponse(reply_body(p.TokenizeResponse(count=len(tokens), tokens=tokens,
                                                          max_model_len=self.station.config.max_request_tokens)))

    async def detokenize(self, request: Request) -> Response:
        try:
            tok = self._tokenizer()
            tokens = parse_detokenize(await self._body(request), self.station.model.cfg.vocab_size)
        except OUTCOMES as e:
            return self._rejected(request, e)
        return JSONResponse(reply_body(p.DetokenizeResponse(prompt=tok.decode(tokens))))

    async def tokenizer_info(self, request: Request) -> Response:
        try:
            tok = self._tokenizer()
        except OUTCOMES as e:
            return self._rejected(request, e)
        return JSONResponse(reply_body(tokenizer_config(tok, self.station.config.max_request_tokens)))

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


def parse_request(station: Station, body: Any, chat: bool, ignored: IgnoredFields | None = None) -> RunRequest:
    """A chat completions (`chat`) or completions body as `station` runs it: how the routes, and a batch file's lines,
    are read; the ignored fields it sets are noted in `ignored`."""
    tok, vocab = station.model.tokenizer, station.model.cfg.vocab_size
    limits = (station.config.max_request_tokens, station.eos_ids, station.engine.token_controls)
    if chat:
        return parse_chat(body, tok, vocab, *limits, station_reasoning(station), ignored=ignored)
    return parse_completion(body, tok, vocab, *limits, ignored)


def reply_head(station: Station, chat: bool) -> dict[str, Any]:
    """A reply's id, creation time and model, as `whole_reply` and the chunks carry them."""
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": served_model_name(station)}


def openai_endpoints(station: Station) -> list[Endpoint]:
    """The OpenAI-compatible routes on `station`, sharing its scheduler with /generate."""
    return OpenAIRoutes(station).endpoints()


def whole_reply(run: Run, head: dict) -> p.ChatCompletionResponse | p.CompletionResponse:
    """The reply of a finished, non-streamed run."""
    choices = []
    for c in run.choices:
        if run.req.echo_texts is not None:
            prefix, lp = echo(run, c)
            c.text.insert(0, prefix)
        else:
            lp = logprobs_since(run, c)
        if not run.req.chat:
            choices.append(p.CompletionChoice(index=c.index, text="".join(c.text), logprobs=lp,
                                              finish_reason=c.finish))
            continue
        message = p.AssistantMessage(role="assistant", content=c.content,
                                     **({"tool_calls": c.calls} if c.calls else {}))
        if c.thinking:
            message.reasoning_content = message.reasoning = c.thinking
        choices.append(p.ChatChoice(index=c.index, message=message, logprobs=lp, finish_reason=c.finish))
    if run.req.chat:
        return p.ChatCompletionResponse(**head, object="chat.completion", choices=choices, usage=usage(run))
    return p.CompletionResponse(**head, object="text_completion", choices=choices, usage=usage(run))


class Chunks(Events):
    """A streamed run as chat (or completion) chunks: the chat role first, then each update's thinking, text and each
    tool-call delta in a chunk of its own (the last chunk carries the finish), the usage if asked, and "[DONE]"; a
    failure is an error chunk before it."""

    def __init__(self, run: Run, head: dict) -> None:
        self.run, self.head = run, head

    def opening(self) -> list[str]:
        return [self._chunk(c, "", None, first=True) for c in self.run.choices] if self.run.req.chat else []

    def update(self, update: Update) -> list[str]:
        pieces = (([("", None, update.thinking)] if update.thinking else [])
                  + ([(update.text, None, "")] if update.text else [])
                  + [("", [d], "") for d in update.tool_deltas])
        if update.finished and not pieces:
            pieces = [("", None, "")]
        return [self._chunk(update.choice, text, update.choice.finish if update.finished and k == len(pieces) - 1
                            else None, calls=calls, thinking=thinking)
                for k, (text, calls, thinking) in enumerate(pieces)]

    def closing(self) -> list[str]:
        if not self.run.req.include_usage:
            return []
        reply = p.ChatCompletionChunk if self.run.req.chat else p.CompletionResponse
        obj = "chat.completion.chunk" if self.run.req.chat else "text_completion"
        return [sse(reply_body(reply(**self.head, object=obj, choices=[], usage=usage(self.run))))]

    def failed(self, failed: Failure) -> list[str]:
        return [sse(ApiError(failed.status, failed.message, failed.field, failed.code).body())]

    def last(self) -> list[str]:
        return ["data: [DONE]\n\n"]

    def _chunk(self, c: Choice, text: str, finish: str | None, first: bool = False, calls: list[dict] | None = None,
               thinking: str = "") -> str:
        """One streamed chunk of choice `c`."""
        run, head = self.run, self.head
        lp = logprobs_since(run, c, streaming=True)
        usage_so_far = {"usage": usage(run)} if run.req.continuous_usage else (
            {"usage": None} if run.req.include_usage else {})
        if not run.req.chat:
            choice = p.CompletionChoice(index=c.index, text=text, logprobs=lp, finish_reason=finish)
            return sse(reply_body(p.CompletionResponse(**head, object="text_completion", choices=[choice],
                                                       **usage_so_far)))
        delta = p.ChatDelta(role="assistant", content=text) if first else (
            p.ChatDelta(content=text) if text else p.ChatDelta())
        if calls:
            delta.tool_calls = [p.ToolCallDelta.model_validate(d) for d in calls]
        if thinking:
            delta.reasoning_content = delta.reasoning = thinking
        choice = p.ChatChunkChoice(index=c.index, delta=delta, logprobs=lp, finish_reason=finish)
        return sse(reply_body(p.ChatCompletionChunk(**head, object="chat.completion.chunk", choices=[choice],
                                                    **usage_so_far)))
