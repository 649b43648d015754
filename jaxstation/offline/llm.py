"""The Python API: `LLM` runs a station in this process and `generate`s (or `chat`s) many prompts at once, batched
continuously over its lanes, with no HTTP; `SamplingParams` says how, in the fields of the OpenAI routes, named as
vLLM names them (docs/python.md).

Each prompt is built as the OpenAI routes build a request (`openai.routes.parse_request`: completions for
`generate`, chat completions for `chat`, the same defaults and checks), and its jobs run on the station's scheduler
as a served request's do: a prompt's tokens are the same bits as the same request sent to `jaxstation serve` alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from jaxstation.chat.request import validate
from jaxstation.chat.run import Choice
from jaxstation.model.tokenizer import Tokenizer
from jaxstation.offline.runs import Outcome, Progress, run_all
from jaxstation.offline.station import offline_config, open_station
from jaxstation.openai.protocol import REFUSED_FIELDS, CompletionRequest
from jaxstation.openai.routes import parse_request
from jaxstation.server.errors import ApiError
from jaxstation.server.outcomes import API_INVALID, failure
from jaxstation.server.station import Station

T = TypeVar("T")
Prompt = str | list[int]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How each prompt is continued: the OpenAI routes' fields, under vLLM's names and defaults. temperature 0 is
    greedy; a seed makes sampling repeatable (choice j samples with seed + j); `logprobs` k returns, for each token,
    its log-probability and the k most likely tokens'. Checked when built, by the routes' own rules: a bad value
    raises ValueError naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: as many as the context leaves (chat), 16 (generate)
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        try:
            validate(CompletionRequest, {"prompt": [0], **self.body(chat=False)}, REFUSED_FIELDS)
        except ApiError as e:
            raise ValueError(f"SamplingParams: {e.message}") from None

    def body(self, chat: bool) -> dict[str, Any]:
        """The fields of a chat completions (`chat`) or completions body."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "logprobs"}
        body = {k: v for k, v in fields.items() if v is not None}
        if self.logprobs is not None:
            body.update({"logprobs": True, "top_logprobs": self.logprobs} if chat else {"logprobs": self.logprobs})
        return body


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One continuation: its text (without the stop string that ended it, unless asked), its token ids (without the
    stop or EOS id that ended it: as `/generate` returns them), why it ended ("stop" or "length"), and with
    `logprobs`, each token's {token id: log-probability}, the chosen token first, then the most likely."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A prompt's continuations: its text (None for token ids), its token ids, and `n` outputs."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class LLM:
    """A station in this process on `model` (a checkpoint's path, a Hub name `org/name` or `org/name:QUANT`, or None
    for the embedded default), with any setting of `jaxstation serve` but those of HTTP as a keyword
    (`lanes=16`, `max_seq=4096`, `dtype="float32"`, `revision="main"`), over the `MOONSHINE_*` variables; it batches
    continuously. It loads and compiles here; `close()` (or `with LLM(...) as llm:`) stops it."""

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        self.station: Station = open_station(offline_config({**settings, **({"model": model} if model else {})}))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.station.model.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
                 = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Continue each prompt (a string, tokenized with the model's special tokens as /v1/completions does, or
        token ids), all at once; the outputs in the prompts' order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        bodies = [{"prompt": p, **sp.body(chat=False)} for p, sp in zip(prompts, self._each(params, len(prompts)),
                                                                          strict=True)]
        return self._run(bodies, False, [p if isinstance(p, str) else None for p in prompts], use_tqdm)

    def chat(self, conversations: list[dict] | Sequence[list[dict]], params: SamplingParams |
             Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Continue each conversation (OpenAI's messages: {"role", "content"}), rendered by the model's chat
        template as /v1/chat/completions renders it, all at once; the outputs in the conversations' order."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        extra = {"chat_template_kwargs": chat_template_kwargs} if chat_template_kwargs else {}
        bodies = [{"messages": list(c), **sp.body(chat=True), **extra}
                  for c, sp in zip(conversations, self._each(params, len(conversations)), strict=True)]
        return self._run(bodies, True, [None] * len(bodies), use_tqdm)

    def close(self) -> None:
        """Stop the station (its decode thread); the LLM takes no more prompts."""
        self.station.shutdown(0)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _each(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> Sequence[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} SamplingParams for {n} prompts: give one, or one a prompt")
        return params

    def _run(self, bodies: list[dict], chat: bool, texts: list[str | None], use_tqdm: bool) -> list[RequestOutput]:
        """Run `bodies` (each refused at once, before any runs, naming its index and field), batched."""
        reqs = []
        for i, body in enumerate(bodies):
            try:
                reqs.append(parse_request(self.station, body, chat))
            except ApiError as e:
                raise ValueError(f"prompt {i}: {e.message}") from None
        outputs: list[RequestOutput | None] = [None] * len(bodies)
        failed: list[str] = []

        def done(outcome: Outcome) -> None:
            if outcome.error is not None:
                failed.append(f"prompt {outcome.key}: {failure(outcome.error, API_INVALID).message}")
            else:
                req = outcome.run.req
                outputs[outcome.key] = RequestOutput(texts[outcome.key], req.prompts[0],
                                                     [_output(c, req.logprobs) for c in outcome.run.choices])

        progress = Progress(len(bodies), use_tqdm, "generating")
        try:
            _run_coroutine(lambda: run_all(self.station, enumerate(reqs), done, progress))
        finally:
            progress.close()
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(bodies)} prompts failed; {failed[0]}")
        return outputs  # type: ignore[return-value]


def _output(c: Choice, k: int | None) -> CompletionOutput:
    logprobs = None
    if k is not None:  # each generated token's entry (a stop id's, listed after them, is left out with its id)
        logprobs = [{s.token: s.logprob, **{t: lp for t, lp in s.top[:k] if t != s.token}}
                    for s, _ in c.logprobs[:len(c.ids)]]
    return CompletionOutput(c.index, "".join(c.text), list(c.ids), c.finish, logprobs)


def _run_coroutine(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to its end from synchronous code: on this thread, or on a thread of its own where this one
    runs an event loop already (a notebook's)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    result: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(make()))
        except BaseException as e:  # handed to the caller's thread
            errors.append(e)

    thread = threading.Thread(target=target, name="jaxstation-llm")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]
