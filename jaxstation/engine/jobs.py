"""What a request is to the engine: a `Job` goes into `Scheduler.submit`, its Future answers with a `Result` or one of
the errors below. Request handlers (server/, chat/) build Jobs and read Results; only the scheduler moves them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from jaxstation.engine.constraints import Constraint
from jaxstation.engine.rows import Sample, SamplingParams


class QueueFull(Exception):
    """The pending queue is at its bound."""


class ShuttingDown(Exception):
    """The station is draining or stopped and takes no new work."""


class UpstreamFailed(Exception):
    """A part of a step that runs elsewhere (a mesh station) failed or stopped answering."""


class StepFailed(Exception):
    """A compiled step raised; the jobs in flight are failed with its message. `cause` is what the step raised."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class Cancelled(Exception):
    """The job was cancelled (its client went away)."""


@dataclasses.dataclass
class Job:
    """One request. `on_token`, if given, is called from the decode thread with each generated Sample.

    `prompt_logprobs` asks for the log-probability of every prompt token after the first (prefill scores each chunk
    on the device; the Result carries them). `max_new_tokens` 0 is allowed with it: score the prompt, generate nothing.
    `reuse_prefix`: may start on a lane's cached KV (the tokens are the same either way); False always prefills all,
    and so does a `prompt_logprobs` job (every prompt row must be scored).
    `cached_tokens` is set when the job takes a lane: how many prompt tokens it reuses from cached KV (the lane's, or
    the host tier's copied into it).
    `constraint`: the grammar its output follows (engine/constraints.py), compiled before the job is submitted.
    """

    tokens: list[int]
    max_new_tokens: int
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    stop_at_sentence_end: bool = False  # end after the first token that closes a sentence (`terminal_ids`)
    reuse_prefix: bool = True
    prompt_logprobs: bool = False
    on_token: Callable[[Sample], None] | None = None
    future: Future = dataclasses.field(default_factory=Future, repr=False)
    submitted_at: float = 0.0
    cancelled: bool = False  # written under Scheduler.cond (Scheduler.cancel)
    stop_requested: bool = False  # written under Scheduler.cond (Scheduler.finish_early)
    cached_tokens: int = 0
    constraint: Constraint | None = None
    speculate: bool = True  # may draft tokens where the station speculates (the tokens are the same either way)
    lora: int = 0  # the LoRA slot its rows read (engine/engine.py); 0: the base model
    lora_load: int = 0  # which load of an adapter that slot holds: prefix reuse keys on it (0: the base model)


@dataclasses.dataclass(frozen=True)
class Result:
    generated: list[int]
    finish_reason: str  # "stop" | "length" | "sentence_end"
    prompt_tokens: int
    samples: list[Sample]
    timing: dict[str, float]  # queue_s, ttft_s, total_s, and cached_tokens (prompt tokens not prefilled)
    prompt_logprobs: list[Sample] = dataclasses.field(default_factory=list)  # prompt tokens 1.., if the job asked
    stop_sample: Sample | None = None  # the stop id that ended it, if one did (not in `generated`)


def answer(future: Future, result: object = None, error: Exception | None = None) -> None:
    """Resolve a job's (or a reset's) Future with `result` or `error`. One already resolved, or cancelled by its caller
    (an awaiting task cancelled through asyncio.wrap_future), is left as it is: that must never fail the decode
    thread."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass
