"""The station's own API as types: `/generate`, `/health`, `/ready` and `/station/status`, with the error shape they
answer in.

Validation comes from these models (strict: no string for a number, no bool for an integer; unknown fields are
refused by name). What a type cannot say, `parse_generate` checks by hand: a token id below the vocabulary size,
and a prompt plus `max_new_tokens` that fits the station's context.

`TokenControls` are the penalties, logit bias and vLLM's length controls that `/generate` and the OpenAI routes
share; `token_controls` turns them into `SamplingParams` fields, checking what their types cannot.

Fields the station does not implement follow one rule (docs/api.md#fields-the-station-does-not-implement): a field
that cannot change the tokens the station returns is declared with `ignored`, accepted, and logged once by name
(`IgnoredFields`); any other field the station does not implement is refused by name.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from jaxstation.engine.constraints import ConstraintSpec
from jaxstation.engine.jobs import Job
from jaxstation.engine.penalties import MAX_LOGIT_BIAS
from jaxstation.engine.rows import FLOAT32_MAX, FLOAT32_TINY, SEED_LIMIT, SamplingParams
from jaxstation.server.errors import StationError, describe

log = logging.getLogger(__name__)

TokenId = Annotated[int, Field(ge=0)]
BiasKey = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,9})$")]  # a token id, in decimal
Bias = Annotated[float, Field(ge=-100, le=100)]
NO_TOKEN_STATE = "is not supported here: this station keeps no per-lane token state (a mesh host)"
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {},
           "allowed_token_ids": [], "min_tokens": 0}  # the device controls' values that ask for nothing


IGNORED = "x-jaxstation-ignored"  # the schema's mark of a field accepted and ignored


def ignored(why: str, **bounds: Any) -> Any:
    """A field the station accepts (within `bounds`) and ignores, since it cannot change the tokens the station
    returns; `why` says so in the schema, which marks the field with IGNORED."""
    return Field(None, description=f"accepted and ignored: {why}", json_schema_extra={IGNORED: True}, **bounds)


def ignored_fields(value: Any, path: str = "") -> set[str]:
    """The ignored fields a validated body sets, each named by its path with list indices left out
    (`messages[].output_config`)."""
    if isinstance(value, list):
        return set().union(*(ignored_fields(v, f"{path}[]") for v in value))
    if not isinstance(value, BaseModel):
        return set()
    out: set[str] = set()
    for name, info in type(value).model_fields.items():
        if (v := getattr(value, name)) is None:
            continue
        at = f"{path}.{info.alias or name}" if path else info.alias or name
        extra = info.json_schema_extra
        out |= {at} if isinstance(extra, dict) and extra.get(IGNORED) else ignored_fields(v, at)
    return out


class IgnoredFields:
    """The ignored fields one route of a station has been sent, each logged at INFO the first time. The names are
    the declared fields', so the set stays small."""

    def __init__(self, route: str) -> None:
        self.route = route
        self.logged: set[str] = set()

    def note(self, body: BaseModel) -> None:
        for name in sorted(ignored_fields(body) - self.logged):
            self.logged.add(name)
            log.info("%s: accepting and ignoring %s, which cannot change the tokens the station returns", self.route,
                     name)


class TokenControls(BaseModel):
    """Penalties, logit bias and vLLM's length controls (engine/penalties.py), on every generating route."""

    presence_penalty: float | None = Field(None, ge=-2, le=2, description="OpenAI's: a generated token's logits "
                                           "are lowered by this once it has appeared")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="OpenAI's: ... by this times how often it "
                                            "has been generated")
    repetition_penalty: float | None = Field(None, ge=FLOAT32_TINY, le=FLOAT32_MAX, description="vLLM's: a token "
                                             "of the prompt or the output has its positive logit divided by this, a "
                                             "negative one multiplied; 1 is off")
    logit_bias: dict[BiasKey, Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS, description="token id -> a bias "
                                                   "added to its logit before sampling")
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, description="vLLM's: only these tokens may "
                                                    "be generated")
    min_tokens: int | None = Field(None, ge=0, description="vLLM's: EOS and stop ids are masked until this many "
                                   "tokens are generated; at most the request's max tokens")
    ignore_eos: bool | None = Field(None, description="vLLM's: the model's EOS ids do not end the request")


def token_controls(req: TokenControls, vocab: int, on_device: bool, invalid: Callable[[str, str], Exception],
                   unsupported: Callable[[str, str], Exception]) -> dict[str, Any]:
    """The request's SamplingParams token controls, or `invalid(field, message)` / `unsupported(field, message)`
    raised: a logit_bias id past the vocabulary, or any control but a neutral one on a runner without the device
    state for them (`Runner.token_controls`, off on a mesh host)."""
    for name, neutral in NEUTRAL.items():
        value = getattr(req, name)
        if not on_device and value is not None and value != neutral:
            raise unsupported(name, f"{name}={value!r} {NO_TOKEN_STATE}")
    bias = []
    for key, value in (req.logit_bias or {}).items():
        if int(key) >= vocab:
            raise invalid("logit_bias", f"logit_bias holds token id {key}, outside the vocabulary [0, {vocab})")
        bias.append((int(key), float(value)))
    allowed = sorted(set(req.allowed_token_ids or ()))
    if allowed and allowed[-1] >= vocab:
        raise invalid("allowed_token_ids", f"allowed_token_ids holds token id {allowed[-1]}, outside the vocabulary "
                                           f"[0, {vocab})")
    return {"presence_penalty": float(req.presence_penalty or 0.0),
            "frequency_penalty": float(req.frequency_penalty or 0.0),
            "repetition_penalty": float(1.0 if req.repetition_penalty is None else req.repetition_penalty),
            "logit_bias": tuple(sorted(bias)), "allowed_token_ids": tuple(allowed), "min_tokens": req.min_tokens or 0}


def check_allowed(sampling: SamplingParams, stop_ids: frozenset[int], invalid: Callable[[str, str], Exception]
                  ) -> None:
    """Refuse allowed_token_ids that min_tokens would leave empty: all of them stop ids, held back at the start."""
    if sampling.allowed_token_ids and sampling.min_tokens > 0 and set(sampling.allowed_token_ids) <= stop_ids:
        raise invalid("allowed_token_ids", "allowed_token_ids holds only stop or EOS ids, which min_tokens masks: "
                                           "no token could be generated")


class Strict(BaseModel):
    """A request body: strict types, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StructuredOutputs(Strict):
    """vLLM's structured outputs: exactly one of json, regex, choice, grammar or json_object (engine/constraints.py)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (an object, or a "
                                               "string holding one) the output follows")
    regex: str | None = Field(None, description="a regular expression the whole output matches")
    choice: list[str] | None = Field(None, min_length=1, description="the output is one of these strings")
    grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect) or a GBNF one")
    json_object: bool | None = Field(None, description="true: any JSON object")


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def request_field(field: str) -> str:
    """The request field a constraint's field names: `structured_outputs.regex` is `structured_outputs`'s, a face's
    own path (`text.format`, `output_config.format`) is itself."""
    head, _, last = field.rpartition(".")
    return head if head == "structured_outputs" and last in STRUCTURED_KINDS else field


def constraint_spec(so: StructuredOutputs, field: str, invalid: Callable[[str, str], Exception]
                    ) -> ConstraintSpec | None:
    """The one constraint a structured_outputs object asks for (None for none), or `invalid(field, message)`."""
    given = {name: value for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                             ("grammar", so.grammar)) if value is not None}
    if so.json_object:
        given["json_object"] = {"type": "object"}
    if len(given) > 1:
        raise invalid(field, f"{field} takes one of json, regex, choice, grammar and json_object, got "
                             f"{', '.join(given)}")
    if not given:
        return None
    (name, value), = given.items()
    kind = "json" if name == "json_object" else name
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise invalid(f"{field}.json", f"{field}.json is not JSON: {e}") from None
    return ConstraintSpec(kind, value, f"{field}.{name}")


class GenerateRequest(Strict, TokenControls):
    tokens: list[TokenId] = Field(min_length=1, description="the prompt's token ids")
    max_new_tokens: int = Field(ge=1, description="at most this many tokens are generated")
    temperature: float | None = Field(None, ge=0, description="0 (the default) is greedy")
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT, description="null draws a random seed")
    top_k: int | None = Field(None, ge=0, description="0 or null is off")
    top_p: float | None = Field(None, gt=0, le=1)
    stop_token_ids: list[TokenId] | None = Field(None, description="more ids that end the request, beside EOS")
    stop_at_sentence_end: bool = Field(False, description="end at the first token that closes a sentence")
    resume: bool = Field(False, description="the prompt continues an earlier request: its cached KV may be reused")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: the output follows a JSON "
                                                         "schema, a regex, a choice or a grammar")
    speculative: bool = Field(True, description="false: never draft tokens for this request where the station "
                                                "speculates (its tokens are the same either way)")
    lora: str | None = Field(None, description="the name of a loaded LoRA adapter to run with (docs/lora.md); an "
                                               "unknown name is a 404")


class GenerateTiming(BaseModel):
    queue_s: float
    ttft_s: float
    total_s: float
    cached_tokens: int


class GenerateResponse(BaseModel):
    generated: list[int]
    finish_reason: Literal["stop", "length", "sentence_end"]
    prompt_tokens: int
    timing: GenerateTiming


class HealthResponse(BaseModel):
    status: str
    error: str | None = None


class ReadyResponse(BaseModel):
    status: Literal["ready", "loading", "draining", "failed"]


class ResetPrefixCacheResponse(BaseModel):
    cleared: int = Field(description="cached prefixes dropped")


class LaneStatus(BaseModel):
    state: Literal["free", "cached", "prefilling", "decoding"] = Field(description="cached: free, and holding the "
                                                                       "KV of a prefix a request may reuse")
    prompt_tokens: int = Field(description="the request's prompt; a cached lane's: the prefix's")
    fed: int = Field(description="prompt tokens in the lane's KV (prefilled or reused)")
    generated: int = Field(description="tokens the request has generated")


class ThroughputStatus(BaseModel):
    bucket_s: int = Field(description="seconds per bucket")
    generated: list[float] = Field(description="tokens generated per second in each of the last complete buckets, "
                                               "oldest first")
    prefilled: list[float] = Field(description="prompt tokens prefilled per second, likewise")


class PrefixCacheStatus(BaseModel):
    lookups: int = Field(description="requests that looked for a cached prefix")
    hits: int = Field(description="lookups that reused at least one chunk of KV")
    reused_tokens: int = Field(description="prompt tokens not prefilled thanks to a hit")


class StationStatusResponse(BaseModel):
    """What the station is doing, as its decode thread last published it (engine/activity.py)."""

    status: Literal["ready", "loading", "draining", "failed"] = Field(description="as /ready says")
    at: float | None = Field(description="Unix time of the snapshot; null before the scheduler starts")
    lanes: list[LaneStatus]
    queued: int = Field(description="requests waiting for a lane")
    max_queue: int
    generated_tokens: int = Field(description="since the station started")
    prompt_tokens: int = Field(description="prompt tokens prefilled since the station started")
    throughput: ThroughputStatus
    prefix_cache: PrefixCacheStatus


class LoadLoraAdapterRequest(Strict):
    lora_name: str = Field(min_length=1, description="the name requests give in `model`")
    lora_path: str = Field(min_length=1, description="a PEFT directory or a GGUF LoRA file on the station's disk")


class UnloadLoraAdapterRequest(Strict):
    lora_name: str = Field(min_length=1)


class LoraAdapterResponse(BaseModel):
    lora_name: str
    status: Literal["loaded", "unloaded"]


class ErrorDetail(BaseModel):
    message: str
    field: str | None


class ErrorResponse(BaseModel):
    """The station's error shape."""

    error: ErrorDetail


def parse_generate(body: Any, vocab: int, max_request_tokens: int, eos_ids: frozenset[int],
                   reuse_prefix: Callable[[bool], bool], on_device: bool) -> tuple[Job, ConstraintSpec | None]:
    """Validate a /generate body into a Job and the constraint it asks for (compiled by the caller, off the event
    loop), or raise StationError naming the offending field.

    reuse_prefix: whether a request with this `resume` flag may start on cached KV (`StationConfig.reuse_prefix`).
    on_device: whether the runner applies the token controls (`Runner.token_controls`).
    """
    if not isinstance(body, dict):
        raise StationError(400, "the body must be a JSON object", "body")
    try:
        req = GenerateRequest.model_validate(body)
    except ValidationError as e:
        field, message, kind = describe(e)
        if kind == "unknown":
            message = f"unknown field {field!r}; fields are {', '.join(GenerateRequest.model_fields)}"
        raise StationError(422, message, field.split("[")[0].split(".")[0]) from None
    for field in ("tokens", "stop_token_ids"):
        for t in getattr(req, field) or ():
            if t >= vocab:
                raise StationError(422, f"{field} holds token id {t}, outside the vocabulary [0, {vocab})", field)
    if len(req.tokens) + req.max_new_tokens > max_request_tokens:
        raise StationError(422, f"prompt ({len(req.tokens)} tokens) + max_new_tokens ({req.max_new_tokens}) exceeds "
                                f"the station's max_seq of {max_request_tokens}", "max_new_tokens")
    if (req.min_tokens or 0) > req.max_new_tokens:
        raise StationError(422, f"min_tokens ({req.min_tokens}) exceeds max_new_tokens ({req.max_new_tokens})",
                           "min_tokens")
    refuse = lambda field, message: StationError(422, message, field)  # noqa: E731
    controls = token_controls(req, vocab, on_device, refuse, refuse)
    seed = secrets.randbelow(SEED_LIMIT) if req.seed is None else req.seed
    sampling = SamplingParams.bounded(temperature=float(req.temperature or 0.0), top_k=req.top_k or 0,
                                      top_p=float(1.0 if req.top_p is None else req.top_p), seed=seed, **controls)
    stops = (frozenset() if req.ignore_eos else eos_ids) | frozenset(req.stop_token_ids or ())
    check_allowed(sampling, stops, refuse)
    spec = constraint_spec(req.structured_outputs, "structured_outputs", refuse) if req.structured_outputs else None
    if spec is not None and not on_device:
        raise StationError(422, f"structured_outputs {NO_TOKEN_STATE}", "structured_outputs")
    job = Job(tokens=req.tokens, max_new_tokens=req.max_new_tokens, sampling=sampling, stop_ids=stops,
              stop_at_sentence_end=req.stop_at_sentence_end, reuse_prefix=reuse_prefix(req.resume),
              speculate=req.speculative)
    return job, spec
