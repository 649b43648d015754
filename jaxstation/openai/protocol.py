"""The OpenAI API as the station serves it, declared once as pydantic models: request bodies (validated strictly,
unknown fields refused by name) and reply bodies (the documented shapes, in `/openapi.json`).

A field the station does not support but that arrives as null is treated as absent, as OpenAI's own clients send
nulls freely. What a type cannot say is checked in `openai.parse`: token ids below the vocabulary size, a prompt plus
`max_tokens` that fits the context, and rules between fields (`top_logprobs` needs `logprobs`, `echo` not with
`stream`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxstation.engine.sampling import TOP_LOGPROBS
from jaxstation.serving.protocol import TokenControls

MAX_N = 8
MAX_STOPS = 16
TokenId = Annotated[int, Field(ge=0)]


class Body(BaseModel):
    """A request body: strict types; unknown fields refused, unless sent as null."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_null_extras(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data


class StreamOptions(Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM's: with include_usage, every chunk carries the usage so far")


class SamplingFields(Body, TokenControls):
    """The fields /v1/completions and /v1/chat/completions share (with the penalties, logit_bias, and vLLM's
    repetition_penalty, min_tokens and ignore_eos)."""

    model: str | None = Field(None, description="any name; the reply names the served model")
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2, description="default 1; 0 is greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64, description="taken modulo 2**32; choice j uses seed + j")
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = Field(
        None, description="matched on the detokenized text across token boundaries, trimmed from the output")
    n: int | None = Field(None, ge=1, le=MAX_N)
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    top_k: int | None = Field(None, ge=-1, description="vLLM's: 0 or -1 is off")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM's")
    stop_token_ids: list[TokenId] | None = Field(None, description="vLLM's: more ids that end a choice, beside EOS")


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)] = Field(
            description="a string, a list of strings, a list of token ids or a list of such lists")
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS,
                                 description="the sampled token's logprob plus this many alternatives")
    echo: bool | None = Field(None, description="put the prompt before the completion (not with stream)")
    best_of: int | None = Field(None, ge=1, description="only 1 or n is accepted")


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS, description="needs logprobs=true")


class TokenizeCompletionRequest(Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None


class TokenizeChatRequest(Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[TokenId]


# ---- replies -----------------------------------------------------------------------------------------------------
class Reply(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CompletionLogprobs(Reply):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(Reply):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Reply):
    content: list[TokenLogprob]


class PromptTokensDetails(Reply):
    cached_tokens: int


class Usage(Reply):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


Finish = Literal["stop", "length"]


class CompletionChoice(Reply):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Finish | None


class CompletionResponse(Reply):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(Reply):
    role: Literal["assistant"]
    content: str


class ChatChoice(Reply):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Finish


class ChatCompletionResponse(Reply):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(Reply):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Reply):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Finish | None


class ChatCompletionChunk(Reply):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(Reply):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(Reply):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(Reply):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Reply):
    prompt: str


class TokenizerInfo(BaseModel):
    """tokenizer_config.json's fields, as vLLM's /tokenizer_info returns them."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    model_max_length: int
    vocab_size: int
    chat_template: str | None = None


class OpenAIErrorDetail(Reply):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorResponse(Reply):
    """OpenAI's error shape."""

    error: OpenAIErrorDetail
