"""The OpenAI-compatible face of a station: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize
and /tokenizer_info.

The host side does the text work (tokenizing, chat templating, stop strings, incremental detokenizing, SSE); the
station stays token-in, token-out: every choice is one `Job` on the station's own scheduler, in the same batch as
`/generate`. Each job's `on_token` callback runs on the decode thread and hands its `Sample` to the request's event
loop with `loop.call_soon_threadsafe` into an `asyncio.Queue`; the job's Future does the same when it resolves.
Non-streaming and streaming replies are built from the same events, so their text is the same.

Supported request fields (anything else is a 400 naming the field):

- both: `model` (any string; the reply names the served model), `max_tokens`, `temperature` (0..2, default 1 as in
  OpenAI; 0 is greedy), `top_p` (0 < p <= 1), `seed` (any integer, taken modulo 2**32; choice j of a prompt uses
  seed + j), `stop` (a string or up to 16 strings, matched on the detokenized text across token boundaries and trimmed
  from the output), `n` (1..8, one lane each), `user` (accepted, ignored), `stream`, `stream_options.include_usage`,
  and the vLLM extras `top_k` (0 or -1 is off), `min_p` and `stop_token_ids`.
- /v1/completions: `prompt` (a string, a list of strings, a list of token ids or a list of such lists), `logprobs`
  (0..5: the sampled token's logprob plus that many alternatives), `echo`, `best_of` equal to 1 or n.
  `echo: true` (not with `stream`) puts the prompt before the completion in `text`; with `logprobs` the logprobs cover
  the prompt's tokens and then the generated ones, the first prompt token null (as vLLM and OpenAI's legacy API), each
  position's `top_logprobs` holding its own token and the top max(logprobs, 1): the model's top-1 is always there.
  The prompt's logprobs are computed in prefill on the device (`Job.prompt_logprobs`). `max_tokens: 0` is accepted
  with echo only: score the prompt, generate nothing.
- /v1/chat/completions: `messages` (roles system/developer/user/assistant/tool; content a string or text parts),
  `max_completion_tokens`, `logprobs` (bool), `top_logprobs` (0..5).
- `presence_penalty` / `frequency_penalty` are accepted only as 0; `logit_bias` only empty; unsupported fields sent
  as null are treated as absent.

Logprobs are the model's (log-softmax of the raw logits), before temperature and filters, computed on the device.
A choice that ends on a stop token (EOS or `stop_token_ids`) lists that token last in its logprobs, as vLLM does (so
echo with `max_tokens: 1` always has one entry past the prompt); its text is not in the reply nor in completion_tokens.
Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 validation, 401 a missing or wrong
key, 503 (with Retry-After) a full queue or a station not ready or draining, 500 a failed step.
With `MOONSHINE_API_KEY` set, every route except /health and /ready needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxstation.engine.engine import SEED_LIMIT, Sample, SamplingParams
from jaxstation.engine.sampling import TOP_LOGPROBS
from jaxstation.engine.scheduler import Cancelled, Job, QueueFull, Result, ShuttingDown, StepFailed
from jaxstation.model.default_model import DEFAULT_GGUF_NAME
from jaxstation.model.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxstation.serving.http_common import RETRY_AFTER_S, BodyError, is_int, is_number, read_json, until_disconnect

if TYPE_CHECKING:
    from jaxstation.serving.server import Station

log = logging.getLogger(__name__)

MAX_N = 8
MAX_STOPS = 16
OPEN_PATHS = frozenset({"/health", "/ready"})  # never need the API key

_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "user", "stream",
                     "stream_options", "top_k", "min_p", "stop_token_ids", "presence_penalty", "frequency_penalty",
                     "logit_bias"})
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class OpenAIError(Exception):
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


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param, "invalid_value")


def _busy(message: str) -> OpenAIError:
    return OpenAIError(503, message, None, "overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})


# ---- auth --------------------------------------------------------------------------------------------------------
class ApiKeyMiddleware:
    """Pure ASGI: with the station's api_key set, every HTTP route but /health and /ready needs the bearer key."""

    def __init__(self, app: ASGIApp, station: Station) -> None:
        self.app, self.station = app, station

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.station.config.api_key
        if scope["type"] != "http" or not key or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), key.encode()):
            return await self.app(scope, receive, send)
        err = OpenAIError(401, "a valid API key is required: send 'Authorization: Bearer <MOONSHINE_API_KEY>'",
                          None, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await err.response()(scope, receive, send)


def openai_middleware(station: Station) -> list[Middleware]:
    """The middleware the station app needs for the OpenAI routes: the optional bearer key."""
    return [Middleware(ApiKeyMiddleware, station=station)]


# ---- validation helpers ------------------------------------------------------------------------------------------
def _neutral(key: str, value: Any, body: dict) -> bool:
    """Whether an otherwise unsupported field holds a value that asks for nothing (so accepting it ignores nothing)."""
    if value is None:
        return True
    if key in ("presence_penalty", "frequency_penalty"):
        return is_number(value) and value == 0
    if key == "logit_bias":
        return value == {}
    if key == "best_of":
        return is_int(value) and value in (1, body.get("n") or 1)
    return False


def _check_fields(body: Any, allowed: frozenset[str]) -> dict:
    if not isinstance(body, dict):
        raise _bad("body", "the body must be a JSON object")
    for key, value in body.items():
        if key not in allowed and value is not None:
            raise OpenAIError(400, f"unsupported field {key!r}", key, "unsupported_parameter")
        if key in ("presence_penalty", "frequency_penalty", "logit_bias", "best_of") \
                and not _neutral(key, value, body):
            raise OpenAIError(400, f"{key}={value!r} is not supported (only the neutral value is accepted)", key,
                              "unsupported_parameter")
    return body


def _opt_int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise _bad(key, f"{key} must be an integer {rng}, got {v!r}")
    return v


def _opt_number(body: dict, key: str, default: float, ok: Callable[[float], bool], rng: str) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not is_number(v) or not ok(v):
        raise _bad(key, f"{key} must be a number in {rng}, got {v!r}")
    return float(v)


def _opt_bool(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(key, f"{key} must be a boolean, got {v!r}")
    return v


def _token_ids(value: Any, vocab: int, param: str) -> list[int]:
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise _bad(param, f"{param} must be a list of token ids")
    for t in value:
        if not 0 <= t < vocab:
            raise _bad(param, f"{param} holds token id {t}, outside the vocabulary [0, {vocab})")
    return value


@dataclasses.dataclass(frozen=True)
class _Request:
    """A validated request: what to run, and how to shape the reply."""

    chat: bool
    prompts: list[list[int]]
    n: int
    max_tokens: list[int]  # per prompt
    sampling: SamplingParams
    seed: int | None
    stops: tuple[str, ...]
    stop_ids: frozenset[int]
    logprobs: int | None  # None: off; k: the sampled token plus k alternatives
    stream: bool
    include_usage: bool
    echo_texts: list[str] | None = None  # per prompt, with echo: the prompt's text, put before the completion


def _parse_common(body: dict, chat: bool, prompts: list[list[int]], logprobs: int | None,
                  max_tokens: int | None, max_request_tokens: int, vocab: int, eos_ids: frozenset[int],
                  echo_texts: list[str] | None = None) -> _Request:
    for i, p in enumerate(prompts):
        if not p:
            raise _bad("messages" if chat else "prompt", f"prompt {i} is empty")
    lengths = []
    for p in prompts:
        room = max_request_tokens - len(p)
        if max_tokens is None:
            want = room if chat else min(16, room)  # OpenAI's defaults: the rest of the context / 16
        else:
            want = max_tokens
        if want < (0 if echo_texts is not None else 1) or len(p) + want > max_request_tokens:
            param = "max_tokens" if max_tokens is not None else ("messages" if chat else "prompt")
            raise _bad(param, f"the prompt ({len(p)} tokens) plus max_tokens ({want}) exceeds the station's "
                              f"context of {max_request_tokens} tokens")
        lengths.append(want)

    n = _opt_int(body, "n", 1, MAX_N) or 1
    temperature = _opt_number(body, "temperature", 1.0, lambda v: 0 <= v <= 2, "[0, 2]")
    top_p = _opt_number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "(0, 1]")
    min_p = _opt_number(body, "min_p", 0.0, lambda v: 0 <= v <= 1, "[0, 1]")
    top_k = body.get("top_k")
    if top_k is None or top_k == -1:
        top_k = 0
    elif not is_int(top_k) or top_k < 0:
        raise _bad("top_k", f"top_k must be an integer >= 0 (0 or -1 is off), got {top_k!r}")
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not -(1 << 63) <= seed < (1 << 64)):
        raise _bad("seed", f"seed must be a 64-bit integer, got {seed!r}")

    stop = body.get("stop")
    stops: list[str] = []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
        stops = list(stop)
    elif stop is not None:
        raise _bad("stop", f"stop must be a string or a list of at most {MAX_STOPS} strings")
    if any(not s for s in stops):
        raise _bad("stop", "stop strings must not be empty")
    stop_ids = body.get("stop_token_ids")
    stop_ids = frozenset(_token_ids(stop_ids, vocab, "stop_token_ids")) if stop_ids is not None else frozenset()

    stream = _opt_bool(body, "stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise _bad("stream_options", "stream_options is only allowed with stream=true")
        if not isinstance(opts, dict):
            raise _bad("stream_options", "stream_options must be an object")
        for key in opts:
            if key != "include_usage":
                raise OpenAIError(400, f"unsupported field 'stream_options.{key}'", f"stream_options.{key}",
                                  "unsupported_parameter")
        include_usage = _opt_bool(opts, "include_usage")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise _bad("model", "model must be a string")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user", "user must be a string")
    return _Request(chat=chat, prompts=prompts, n=n, max_tokens=lengths,
                    sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
                    seed=seed, stops=tuple(stops), stop_ids=eos_ids | stop_ids, logprobs=logprobs, stream=stream,
                    include_usage=include_usage, echo_texts=echo_texts)


def parse_completion(body: Any, tok: Tokenizer, vocab: int, max_request_tokens: int,
                     eos_ids: frozenset[int]) -> _Request:
    body = _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    texts: list[str] | None = None
    if isinstance(prompt, str):
        texts = [prompt]
        prompts = [tok.encode(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = list(prompt)
        prompts = [tok.encode(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        prompts = [_token_ids(prompt, vocab, "prompt")]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [_token_ids(p, vocab, "prompt") for p in prompt]
    else:
        raise _bad("prompt", "prompt must be a string, a list of strings, a list of token ids or a list of lists "
                             "of token ids")
    logprobs = _opt_int(body, "logprobs", 0, TOP_LOGPROBS)
    echo = _opt_bool(body, "echo")
    if echo and _opt_bool(body, "stream"):
        raise OpenAIError(400, "echo=true is not supported with stream=true", "echo", "unsupported_parameter")
    max_tokens = _opt_int(body, "max_tokens", 0)
    if max_tokens == 0 and not echo:
        raise _bad("max_tokens", "max_tokens must be >= 1 (0 is allowed only with echo=true, to score the prompt)")
    echo_texts = None
    if echo:  # the prompt as sent; token ids are decoded
        echo_texts = texts if texts is not None else [tok.decode(p) for p in prompts]
    return _parse_common(body, False, prompts, logprobs, max_tokens, max_request_tokens, vocab, eos_ids, echo_texts)


def _chat_messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "messages must be a non-empty list")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "each message must be an object")
        for key in m:
            if key not in ("role", "content", "name") and m[key] is not None:
                raise OpenAIError(400, f"unsupported field 'messages[{i}].{key}'", f"messages[{i}].{key}",
                                  "unsupported_parameter")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"role must be one of {', '.join(_ROLES)}, got {role!r}")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content[{j}]", "only text content parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "content must be a string or a list of text parts")
        msg = {"role": _ROLES[role], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def render_chat(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The chat template's text for `messages`, tokenized (the template writes its own special tokens)."""
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # the template's raise_exception, or no template at all
        raise _bad("messages", f"the chat template failed: {e}") from None
    return tok.encode(text, add_special_tokens=False)


def parse_chat(body: Any, tok: Tokenizer, vocab: int, max_request_tokens: int, eos_ids: frozenset[int]) -> _Request:
    body = _check_fields(body, CHAT_FIELDS)
    prompt = render_chat(tok, _chat_messages(body.get("messages")))
    want_lp = _opt_bool(body, "logprobs")
    top = _opt_int(body, "top_logprobs", 0, TOP_LOGPROBS)
    if top is not None and not want_lp:
        raise _bad("top_logprobs", "top_logprobs needs logprobs=true")
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    return _parse_common(body, True, [prompt], (top or 0) if want_lp else None, max_tokens, max_request_tokens,
                         vocab, eos_ids)


# ---- running the choices -----------------------------------------------------------------------------------------
def _holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


@dataclasses.dataclass
class _Choice:
    index: int
    prompt: int  # which prompt it continues
    job: Job
    detok: IncrementalDetokenizer
    held: str = ""  # detokenized text held back: it could be the start of a stop string
    text: list[str] = dataclasses.field(default_factory=list)
    tokens: int = 0
    finish: str | None = None
    logprobs: list[tuple[Sample, int]] = dataclasses.field(default_factory=list)  # (sample, text offset)
    lp_sent: int = 0  # how many logprob entries a stream has sent
    prompt_logprobs: list[Sample] = dataclasses.field(default_factory=list)  # with echo: prompt tokens 1..


@dataclasses.dataclass
class _Update:
    choice: _Choice
    text: str
    finished: bool


class _Run:
    """The jobs of one request and the host-side text work on their tokens, driven by the request's event loop."""

    def __init__(self, station: Station, req: _Request) -> None:
        self.station, self.req = station, req
        self.scheduler = station.scheduler
        self.tok: Tokenizer = station.model.tokenizer
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[_Choice] = []
        self.error: OpenAIError | None = None

    def submit(self) -> None:
        req = self.req
        for p, (prompt, max_tokens) in enumerate(zip(req.prompts, req.max_tokens, strict=True)):
            for j in range(req.n):
                seed = (req.seed + j) % SEED_LIMIT if req.seed is not None else secrets.randbelow(SEED_LIMIT)
                index = len(self.choices)
                job = Job(tokens=prompt, max_new_tokens=max_tokens,
                          sampling=dataclasses.replace(req.sampling, seed=seed), stop_ids=req.stop_ids,
                          prompt_logprobs=req.echo_texts is not None and req.logprobs is not None,
                          reuse_prefix=self.station.config.reuse_prefix(False), on_token=self._on_token(index))
                self.choices.append(_Choice(index, p, job, IncrementalDetokenizer(self.tok)))
        try:
            for choice in self.choices:
                future = self.scheduler.submit(choice.job)
                future.add_done_callback(self._on_done(choice.index))
        except (QueueFull, ShuttingDown) as e:
            self.cancel_all()
            raise _busy(str(e)) from None

    def _on_token(self, index: int) -> Callable[[Sample], None]:
        def on_token(sample: Sample) -> None:  # the decode thread
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, sample))
        return on_token

    def _on_done(self, index: int) -> Callable[[Future], None]:
        def on_done(future: Future) -> None:  # the decode thread (or here, if already done)
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, future))
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass
        return on_done

    @property
    def done(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    def cancel_all(self) -> None:
        """Cancel the jobs still running. A choice that already ended on a stop string is left to `finish_early`,
        which retires it as "stop"."""
        for c in self.choices:
            if c.finish is None and not c.job.future.done():
                self.scheduler.cancel(c.job)

    def _advance(self, c: _Choice, piece: str, final: bool) -> str:
        """Fold new text into the choice; return what may be shown now (stop strings trimmed, their starts held)."""
        pending = c.held + piece
        if final:
            pending += c.detok.flush()
        stops = self.req.stops
        cut = min((i for i in (pending.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            out, c.held, c.finish = pending[:cut], "", "stop"
            self.scheduler.finish_early(c.job)  # the station retires it as "stop" within one wave
        elif final:
            out, c.held = pending, ""
        else:
            keep = _holdback(pending, stops) if stops else 0
            out, c.held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        if out:
            c.text.append(out)
        return out

    async def next(self, disconnected: asyncio.Future | None = None) -> _Update | None:
        """Wait for the next event and return what it changes (None when it changes nothing visible)."""
        get = asyncio.ensure_future(self.queue.get())
        try:
            while True:
                waits = {get} if disconnected is None else {get, disconnected}
                done, _ = await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    break
                if disconnected is not None and disconnected in done:
                    raise _Disconnected
                if not self.scheduler.alive and not all(c.job.future.done() for c in self.choices):
                    raise OpenAIError(500, "the decode thread has died", None, "internal_error")
        finally:
            if not get.done():
                get.cancel()
        index, event = get.result()
        c = self.choices[index]
        if c.finish is not None:  # already ended by a stop string; late tokens and its result are dropped
            return None
        if isinstance(event, Sample):
            c.tokens += 1
            offset = len(c.detok.text)
            if self.req.logprobs is not None:
                c.logprobs.append((event, offset))
            return _Update(c, self._advance(c, c.detok.push(event.token), final=False), c.finish is not None)
        try:
            result: Result = event.result()
        except StepFailed as e:
            raise OpenAIError(e.status, str(e), None, "internal_error") from None
        except ShuttingDown as e:
            raise OpenAIError(503, str(e), None, "shutting_down") from None
        except Cancelled as e:
            raise OpenAIError(500, str(e), None, "internal_error") from None
        c.prompt_logprobs = result.prompt_logprobs
        text = self._advance(c, "", final=True)
        if result.stop_sample is not None and self.req.logprobs is not None:  # listed, as vLLM does; not in text
            c.logprobs.append((result.stop_sample, len(c.detok.text)))
        if c.finish is None:
            c.finish = "length" if result.finish_reason == "length" else "stop"
        return _Update(c, text, True)

    def usage(self) -> dict:
        """OpenAI's usage. Each prompt counts once; its cached tokens are the most any of its choices reused."""
        prompt = sum(len(p) for p in self.req.prompts)
        completion = sum(c.tokens for c in self.choices)
        cached = sum(max(c.job.cached_tokens for c in self.choices if c.prompt == p)
                     for p in range(len(self.req.prompts)))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ---- logprobs in OpenAI's two shapes ----
    def _token_text(self, token: int) -> str:
        return self.tok.token_bytes(token).decode("utf-8", errors="replace")

    def chat_logprobs(self, entries: list[tuple[Sample, int]]) -> dict:
        k = self.req.logprobs or 0

        def one(token: int, lp: float) -> dict:
            raw = self.tok.token_bytes(token)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": _finite(lp), "bytes": list(raw)}

        return {"content": [{**one(s.token, s.logprob), "top_logprobs": [one(t, lp) for t, lp in s.top[:k]]}
                            for s, _ in entries]}

    def completion_logprobs(self, entries: list[tuple[Sample | None, int]], tokens: list[int] | None = None) -> dict:
        """OpenAI's legacy shape. An entry without a Sample (echo's first prompt token) has null logprobs.

        With echo, each position's top_logprobs holds its own token, then the top max(k, 1) (so the model's top-1 is
        always there and a duplicate text keeps the top one's logprob)."""
        k = self.req.logprobs or 0
        echo = self.req.echo_texts is not None
        tokens = tokens if tokens is not None else [s.token for s, _ in entries]

        def top(s: Sample | None) -> dict | None:
            if s is None:
                return None
            alternatives = s.top[:max(k, 1)] if echo else s.top[:k]
            head = [(s.token, s.logprob)] if echo else []
            return {self._token_text(t): _finite(lp) for t, lp in head + list(alternatives)}

        return {
            "tokens": [self._token_text(t) for t in tokens],
            "token_logprobs": [None if s is None else _finite(s.logprob) for s, _ in entries],
            "top_logprobs": [top(s) for s, _ in entries],
            "text_offset": [off for _, off in entries],
        }

    def echo(self, c: _Choice) -> tuple[str, dict | None]:
        """With echo: the prompt's text and, with logprobs, the logprobs of its tokens then the generated ones.

        A prompt token's text_offset is where it starts in the prompt's decoded text (the prompt as sent, when it
        decodes back to itself, as byte-level BPE does)."""
        text = self.req.echo_texts[c.prompt]
        if self.req.logprobs is None:
            return text, None
        prompt = self.req.prompts[c.prompt]
        detok = IncrementalDetokenizer(self.tok, skip_special_tokens=False)
        offsets = []
        for t in prompt:
            offsets.append(len(detok.text))
            detok.push(t)
        shift = len(text)  # generated offsets count from the end of the echoed prompt
        entries: list[tuple[Sample | None, int]] = list(zip([None, *c.prompt_logprobs], offsets, strict=True))
        entries += [(s, off + shift) for s, off in c.logprobs]
        return text, self.completion_logprobs(entries, list(prompt) + [s.token for s, _ in c.logprobs])

    def logprobs_since(self, c: _Choice, streaming: bool = False) -> dict | None:
        """The logprobs of the tokens not reported yet (a stream's chunk without new tokens gets null)."""
        if self.req.logprobs is None or (streaming and c.lp_sent == len(c.logprobs)):
            return None
        entries, c.lp_sent = c.logprobs[c.lp_sent:], len(c.logprobs)
        return self.chat_logprobs(entries) if self.req.chat else self.completion_logprobs(entries)


class _Disconnected(Exception):
    pass


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


# ---- routes ------------------------------------------------------------------------------------------------------
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


def openai_routes(station: Station) -> list[Route]:
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
            raise _busy(msg)

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
            req = parse(body, tok, station.model.cfg.vocab_size, station.config.max_request_tokens, station.eos_ids)
            run = _Run(station, req)
            run.submit()
        except OpenAIError as e:
            return rejected(e)
        request.state.token_counts = lambda: (run.usage()["prompt_tokens"], run.usage()["completion_tokens"])
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": ident, "object": "", "created": int(time.time()), "model": served_model_name(station)}
        if req.stream:
            return _SSEResponse(_stream(run, head), run.cancel_all)
        return await _complete(request, run, head)

    async def _complete(request: Request, run: _Run, head: dict) -> Response:
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            while not run.done:
                await run.next(gone)
        except _Disconnected:
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
                choices.append({"index": c.index, "message": {"role": "assistant", "content": "".join(c.text)},
                                "logprobs": lp, "finish_reason": c.finish})
            else:
                choices.append({"index": c.index, "text": "".join(c.text), "logprobs": lp,
                                "finish_reason": c.finish})
        obj = "chat.completion" if run.req.chat else "text_completion"
        return JSONResponse({**head, "object": obj, "choices": choices, "usage": run.usage()})

    async def _stream(run: _Run, head: dict) -> AsyncIterator[str]:
        chat = run.req.chat
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        usage_null = {"usage": None} if run.req.include_usage else {}

        def chunk(c: _Choice, text: str, finish: str | None, first: bool = False) -> str:
            lp = run.logprobs_since(c, streaming=True)
            if chat:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}
            return _sse({**head, "choices": [choice], **usage_null})

        try:
            if chat:
                for c in run.choices:
                    yield chunk(c, "", None, first=True)
            while not run.done:
                update = await run.next()
                if update is None:
                    continue
                if update.finished:
                    yield chunk(update.choice, update.text, update.choice.finish)
                elif update.text:
                    yield chunk(update.choice, update.text, None)
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
            raise _busy("the model is not loaded yet")
        return station.model.tokenizer

    async def tokenize(request: Request) -> Response:
        try:
            tok = tokenizer()
            body = await read_body(request)
            if isinstance(body, dict) and "messages" in body:
                body = _check_fields(body, frozenset({"model", "messages", "add_generation_prompt",
                                                      "add_special_tokens"}))
                gen = body.get("add_generation_prompt")
                tokens = render_chat(tok, _chat_messages(body["messages"]), True if gen is None else bool(gen))
            else:
                body = _check_fields(body, frozenset({"model", "prompt", "add_special_tokens"}))
                if not isinstance(body.get("prompt"), str):
                    raise _bad("prompt", "prompt must be a string")
                special = body.get("add_special_tokens")
                tokens = tok.encode(body["prompt"], add_special_tokens=True if special is None else bool(special))
        except OpenAIError as e:
            return rejected(e)
        return JSONResponse({"count": len(tokens), "max_model_len": station.config.max_request_tokens,
                             "tokens": tokens})

    async def detokenize(request: Request) -> Response:
        try:
            tok = tokenizer()
            body = _check_fields(await read_body(request), frozenset({"model", "tokens"}))
            tokens = _token_ids(body.get("tokens"), station.model.cfg.vocab_size, "tokens")
        except OpenAIError as e:
            return rejected(e)
        return JSONResponse({"prompt": tok.decode(tokens)})

    async def tokenizer_info(request: Request) -> Response:
        try:
            tok = tokenizer()
        except OpenAIError as e:
            return rejected(e)
        return JSONResponse(tokenizer_config(tok, station.config.max_request_tokens))

    return [
        Route("/v1/completions", text_completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    ]
