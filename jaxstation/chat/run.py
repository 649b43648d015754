"""Running one request's choices, for every face: each choice is one `Job` on the station's scheduler, and the host
does the text work on its tokens (incremental detokenizing, stop strings across token boundaries, the thinking split
from the answer, tool calls parsed out of it); the faces shape the replies (and OpenAI's logprobs) from its choices.

Each job's `on_token` callback runs on the decode thread and hands its `Sample` to the request's event loop with
`loop.call_soon_threadsafe` into an `asyncio.Queue`; the job's Future does the same when it resolves. Everything else
here runs on the request's event loop. Non-streaming and streaming replies are built from the same events, so their
text is the same. A job's failure is raised as the engine's own exception (`server.outcomes` maps it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Callable
from concurrent.futures import Future

from jaxstation.chat.reasoning import ReasoningStream
from jaxstation.chat.request import RunRequest, bad
from jaxstation.chat.stops import scan_stops
from jaxstation.chat.tools import ToolStream
from jaxstation.engine.constraints import Constraint
from jaxstation.engine.jobs import Job, QueueFull, Result, ShuttingDown
from jaxstation.engine.rows import SEED_LIMIT, Sample, SamplingParams
from jaxstation.model.detokenizer import IncrementalDetokenizer
from jaxstation.model.tokenizer import Tokenizer
from jaxstation.server.outcomes import wait_for
from jaxstation.server.station import Station


@dataclasses.dataclass
class Choice:
    index: int
    prompt: int  # which prompt it continues
    job: Job
    detok: IncrementalDetokenizer
    held: str = ""  # detokenized text held back: it could be the start of a stop string
    text: list[str] = dataclasses.field(default_factory=list)
    ids: list[int] = dataclasses.field(default_factory=list)  # the tokens generated, as they arrived
    finish: str | None = None
    logprobs: list[tuple[Sample, int]] = dataclasses.field(default_factory=list)  # (sample, text offset)
    lp_sent: int = 0  # how many logprob entries a stream has sent
    prompt_logprobs: list[Sample] = dataclasses.field(default_factory=list)  # with echo: prompt tokens 1..
    tool: ToolStream | None = None  # with tools: the text split into content and calls
    reasoning: ReasoningStream | None = None  # with a reasoning parser: the thinking split from the answer
    answer: list[str] = dataclasses.field(default_factory=list)  # the text less the thinking
    stop: str | None = None  # the stop string that ended it
    thinking_tokens: int = 0  # tokens generated in the thinking (its tags included)

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def content(self) -> str | None:
        """The answer's text: the text less the thinking, or with tools the content before the calls (None for
        none)."""
        return "".join(self.answer) if self.tool is None else self.tool.content

    @property
    def calls(self) -> list[dict]:
        """The tool calls the choice ended with, as OpenAI's tool_calls entries."""
        return self.tool.calls if self.tool is not None else []

    @property
    def thinking(self) -> str:
        return self.reasoning.text if self.reasoning is not None else ""


@dataclasses.dataclass(frozen=True)
class Counts:
    """A run's tokens: its prompts' (each once), how many of those were read from the prefix cache (for each prompt,
    the most any of its choices reused), the generated ones and those of them in the thinking."""

    prompt: int
    cached: int
    generated: int
    thinking: int


@dataclasses.dataclass
class Update:
    choice: Choice
    text: str
    finished: bool
    tool_deltas: list[dict] = dataclasses.field(default_factory=list)
    thinking: str = ""


class Run:
    """The jobs of one request and the host-side text work on their tokens, driven by the request's event loop."""

    def __init__(self, station: Station, req: RunRequest, constraint: Constraint | None = None) -> None:
        """constraint: `req.constraint` compiled, at its start (each choice advances a copy)."""
        self.station, self.req, self.constraint = station, req, constraint
        self.scheduler = station.scheduler
        self.tok: Tokenizer = station.model.tokenizer
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[Choice] = []

    def submit(self) -> None:
        req = self.req
        for i, (prompt, max_tokens) in enumerate(zip(req.prompts, req.max_tokens, strict=True)):
            for j in range(req.n):
                seed = (req.seed + j) % SEED_LIMIT if req.seed is not None else secrets.randbelow(SEED_LIMIT)
                index = len(self.choices)
                job = Job(tokens=prompt, max_new_tokens=max_tokens,
                          sampling=SamplingParams.bounded(req.sampling, seed=seed), stop_ids=req.stop_ids,
                          prompt_logprobs=req.echo_texts is not None and req.logprobs is not None,
                          reuse_prefix=self.station.config.reuse_prefix(False), on_token=self._on_token(index),
                          constraint=self.constraint.copy() if self.constraint else None, speculate=req.speculate)
                self.station.use_adapter(job, req.model)  # an adapter's name runs it; any other name, the base
                detok = IncrementalDetokenizer(self.tok, skip_special_tokens=req.skip_special)
                tool = ToolStream(req.tools) if req.tools else None
                reasoning = ReasoningStream(req.reasoning, req.prompt_opens) if req.reasoning else None
                self.choices.append(Choice(index, i, job, detok, tool=tool, reasoning=reasoning))
        if len(self.choices) > self.scheduler.max_queue:  # it could never be queued: not a 503 to retry
            raise bad(req.param("prompt") if len(req.prompts) > 1 else req.param("n"),
                      f"the request needs {len(self.choices)} jobs (prompts x n: {len(req.prompts)} x {req.n}), more "
                      f"than the station's queue holds (max_queue={self.scheduler.max_queue})")
        try:
            for choice in self.choices:
                future = self.scheduler.submit(choice.job)
                future.add_done_callback(self._on_done(choice.index))
        except (QueueFull, ShuttingDown):
            self.cancel_all()
            raise

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

    def _advance(self, c: Choice, piece: str, final: bool) -> str:
        """Fold new text into the choice; return what may be shown now (`scan_stops`). A stop string ends the
        choice here and its job within one wave."""
        pending = c.held + piece + (c.detok.flush() if final else "")
        armed = c.tokens >= self.req.sampling.min_tokens
        out, c.held, stopped = scan_stops(pending, self.req.stops, self.req.include_stop, armed, final)
        if stopped:
            c.finish, c.stop = "stop", stopped
            self.scheduler.finish_early(c.job)  # the station retires it as "stop" within one wave
        if out:
            c.text.append(out)
        return out

    async def next(self, disconnected: asyncio.Future | None = None) -> Update | None:
        """Wait for the next event and return what it changes (None when it changes nothing visible)."""
        get = asyncio.ensure_future(self.queue.get())
        try:
            await wait_for(get, self.scheduler, lambda: [c.job.future for c in self.choices], disconnected)
        finally:
            if not get.done():
                get.cancel()
        index, event = get.result()
        c = self.choices[index]
        if c.finish is not None:  # already ended by a stop string; late tokens and its result are dropped
            return None
        if isinstance(event, Sample):
            c.ids.append(event.token)
            offset = len(c.detok.text)
            if self.req.logprobs is not None:
                c.logprobs.append((event, offset))
            thinking = c.reasoning is not None and c.reasoning.in_thinking
            update = self._update(c, self._advance(c, c.detok.push(event.token), final=False), c.finish is not None)
            if thinking or (c.reasoning is not None and c.reasoning.in_thinking):  # a token in or into the thinking
                c.thinking_tokens += 1
            return update
        result: Result = event.result()  # raises the job's failure
        c.prompt_logprobs = result.prompt_logprobs
        text = self._advance(c, "", final=True)
        if result.stop_sample is not None and self.req.logprobs is not None:  # listed, as vLLM does; not in text
            c.logprobs.append((result.stop_sample, len(c.detok.text)))
        if c.finish is None:
            c.finish = "length" if result.finish_reason == "length" else "stop"
        return self._update(c, text, True)

    def _update(self, c: Choice, text: str, finished: bool) -> Update:
        """What a choice's new text shows: its thinking split out first, then the rest as is, or through its tool
        plan (content, and tool-call deltas; a choice that ends on calls finishes with "tool_calls")."""
        thinking = ""
        if c.reasoning is not None:
            thinking, text = c.reasoning.push(text, final=finished)
        c.answer.append(text)
        if c.tool is None:
            return Update(c, text, finished, thinking=thinking)
        shown, deltas = c.tool.push(text)
        if finished:
            rest, more = c.tool.finish()
            shown, deltas = shown + rest, deltas + more
            if c.tool.calls and c.finish == "stop":
                c.finish = "tool_calls"
        return Update(c, shown, finished, deltas, thinking)

    def counts(self) -> Counts:
        prompts = self.req.prompts
        cached = sum(max(c.job.cached_tokens for c in self.choices if c.prompt == i) for i in range(len(prompts)))
        return Counts(prompt=sum(len(t) for t in prompts), cached=cached,
                      generated=sum(c.tokens for c in self.choices),
                      thinking=sum(c.thinking_tokens for c in self.choices))
