"""The station's own API as types: `/generate`, `/health` and `/ready`, with the error shape they answer in.

Validation comes from these models (strict: no string for a number, no bool for an integer; unknown fields are
refused by name). What a type cannot say, `parse_generate` checks by hand: a token id below the vocabulary size,
and a prompt plus `max_new_tokens` that fits the station's context.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxstation.engine.engine import SEED_LIMIT, SamplingParams
from jaxstation.engine.scheduler import Job
from jaxstation.serving.errors import ApiError, describe

TokenId = Annotated[int, Field(ge=0)]


class Strict(BaseModel):
    """A request body: strict types, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class GenerateRequest(Strict):
    tokens: list[TokenId] = Field(min_length=1, description="the prompt's token ids")
    max_new_tokens: int = Field(ge=1, description="at most this many tokens are generated")
    temperature: float | None = Field(None, ge=0, description="0 (the default) is greedy")
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT, description="null draws a random seed")
    top_k: int | None = Field(None, ge=0, description="0 or null is off")
    top_p: float | None = Field(None, gt=0, le=1)
    stop_token_ids: list[TokenId] | None = Field(None, description="more ids that end the request, beside EOS")
    terminal_prosody: bool = Field(False, description="end at the first token that closes a sentence")
    resume: bool = Field(False, description="the prompt continues an earlier request: its cached KV may be reused")


class GenerateTiming(BaseModel):
    queue_s: float
    ttft_s: float
    total_s: float
    cached_tokens: int


class GenerateResponse(BaseModel):
    generated: list[int]
    finish_reason: Literal["stop", "length", "terminal_prosody"]
    prompt_tokens: int
    timing: GenerateTiming


class HealthResponse(BaseModel):
    status: str
    error: str | None = None


class ReadyResponse(BaseModel):
    status: Literal["ready", "loading", "draining", "failed"]


class ErrorDetail(BaseModel):
    message: str
    field: str | None


class ErrorResponse(BaseModel):
    """The station's error shape."""

    error: ErrorDetail


def parse_generate(body: Any, vocab: int, max_request_tokens: int, eos_ids: frozenset[int],
                   reuse_prefix: Callable[[bool], bool]) -> Job:
    """Validate a /generate body into a Job, or raise ApiError naming the offending field.

    reuse_prefix: whether a request with this `resume` flag may start on cached KV (`StationConfig.reuse_prefix`).
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", "body")
    try:
        req = GenerateRequest.model_validate(body)
    except ValidationError as e:
        field, message, kind = describe(e)
        if kind == "unknown":
            message = f"unknown field {field!r}; fields are {', '.join(GenerateRequest.model_fields)}"
        raise ApiError(422, message, field.split("[")[0].split(".")[0]) from None
    for field in ("tokens", "stop_token_ids"):
        for t in getattr(req, field) or ():
            if t >= vocab:
                raise ApiError(422, f"{field} holds token id {t}, outside the vocabulary [0, {vocab})", field)
    if len(req.tokens) + req.max_new_tokens > max_request_tokens:
        raise ApiError(422, f"prompt ({len(req.tokens)} tokens) + max_new_tokens ({req.max_new_tokens}) exceeds the "
                            f"station's max_seq of {max_request_tokens}", "max_new_tokens")
    seed = secrets.randbelow(SEED_LIMIT) if req.seed is None else req.seed
    sampling = SamplingParams(temperature=float(req.temperature or 0.0), top_k=req.top_k or 0,
                              top_p=float(1.0 if req.top_p is None else req.top_p), seed=seed)
    return Job(tokens=req.tokens, max_new_tokens=req.max_new_tokens, sampling=sampling,
               stop_ids=eos_ids | frozenset(req.stop_token_ids or ()), terminal_prosody=req.terminal_prosody,
               reuse_prefix=reuse_prefix(req.resume))
