"""The OpenAI API as the station serves it, declared once as pydantic models: request bodies (validated strictly,
unknown fields refused by name) and reply bodies (the documented shapes, in `/openapi.json`).

A field the station does not support but that arrives as null is treated as absent, as OpenAI's own clients send
nulls freely. A field that cannot change the tokens the station returns is declared `ignored` (docs/api.md lists
them); any other field the station does not serve is refused by name, with why for those in REFUSED_FIELDS. What a
type cannot say is checked in `openai.parse` and `chat.request`: token ids below the vocabulary size, a prompt plus
`max_tokens` that fits the context, and rules between fields (`top_logprobs` needs `logprobs`, `echo` not with
`stream`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from jaxstation.chat.protocol import Body, Reply
from jaxstation.engine.sampling import TOP_LOGPROBS
from jaxstation.server.protocol import StructuredOutputs, TokenControls, ignored

MAX_N = 8
MAX_PROMPTS = 256
MAX_STOPS = 16

_FUNCTIONS = "the legacy functions API is not served; send tools and tool_choice"
_GUIDED = "send structured_outputs (json, regex, choice, grammar) or response_format"
# Fields of OpenAI's and vLLM's APIs that the station refuses, and why: the 400 says so. Any other unknown field is
# refused too, by name.
REFUSED_FIELDS = {
    "functions": _FUNCTIONS, "function_call": _FUNCTIONS,
    "guided_json": _GUIDED, "guided_regex": _GUIDED, "guided_choice": _GUIDED, "guided_grammar": _GUIDED,
    "guided_decoding_backend": "the constraint engine is llguidance", "guided_whitespace_pattern": _GUIDED,
    "suffix": "fill-in-the-middle is not served",
    "use_beam_search": "beam search is not served: each choice samples on its own lane",
    "length_penalty": "it applies to beam search, which is not served",
    "bad_words": "not served; logit_bias and allowed_token_ids mask single tokens",
    "logits_processors": "a request cannot run code in the station",
    "priority": "the scheduler admits requests first come, first served",
    "prompt_logprobs": "send echo=true with logprobs to /v1/completions for the prompt's logprobs",
    "return_tokens_as_token_ids": "not served; POST /generate returns token ids",
    "cache_salt": "prefix reuse is exact and shared by every request of a station",
    "kv_transfer_params": "disaggregated prefill is not served",
    "continue_final_message": "not served; send the partial reply as a completion prompt",
    "chat_template": "a request cannot replace the model's chat template",
    "documents": "the chat template is rendered without documents",
    "mm_processor_kwargs": "the station serves text-only models", "modalities": "the station serves text only",
    "audio": "the station serves text only",
    "prediction": "predicted outputs are not served",
}
TokenId = Annotated[int, Field(ge=0)]


class JsonSchemaSpec(Body):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema; absent: any JSON "
                                           "object")
    strict: bool | None = ignored("the output always follows the schema")


class TextFormat(Body):
    type: Literal["text"]


class JsonObjectFormat(Body):
    type: Literal["json_object"]


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


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
    user: str | None = ignored("client metadata")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    top_k: int | None = Field(None, ge=-1, description="vLLM's: 0 or -1 is off")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM's")
    stop_token_ids: list[TokenId] | None = Field(None, description="vLLM's: more ids that end a choice, beside EOS")
    include_stop_str_in_output: bool | None = Field(None, description="vLLM's: keep the stop string that ended a "
                                                    "choice in its text")
    skip_special_tokens: bool | None = Field(None, description="vLLM's: leave special tokens out of the text "
                                             "(default true)")
    spaces_between_special_tokens: bool | None = ignored("vLLM's; decoding joins token bytes, as a fast tokenizer "
                                                         "does")
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="vLLM's: keep only the prompt's last this "
                                               "many tokens")
    response_format: ResponseFormat | None = Field(None, description="text, any JSON object, or a JSON schema the "
                                                   "output follows")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: the output follows a JSON "
                                                         "schema, a regex, a choice or a grammar")
    speculative: bool | None = Field(None, description="false: never draft tokens for this request where the "
                                     "station speculates (its tokens are the same either way)")


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        Annotated[list[TokenId], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)] \
        = Field(description=f"a string, a list of strings, a list of token ids or a list of such lists; at most "
                f"{MAX_PROMPTS} prompts, and prompts x n at most the station's max_queue")
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS,
                                 description="the sampled token's logprob plus this many alternatives")
    echo: bool | None = Field(None, description="put the prompt before the completion (not with stream)")
    best_of: int | None = Field(None, ge=1, description="only 1 or n is accepted")
    add_special_tokens: bool | None = Field(None, description="vLLM's: let the tokenizer add its special tokens "
                                            "(BOS) to a text prompt (default true)")


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: str = Field(description="the arguments, as a JSON string")


class ToolCallIn(Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="an assistant turn's calls")
    tool_call_id: str | None = Field(None, description="a tool turn: the call it answers")


class FunctionDefinition(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = Field(None, description="accepted; required and named calls always follow the schema")


class ToolDefinition(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS, description="needs logprobs=true")
    add_generation_prompt: bool | None = Field(None, description="vLLM's: end the rendered prompt with the "
                                               "assistant's turn (default true)")
    add_special_tokens: bool | None = Field(None, description="vLLM's: let the tokenizer add its special tokens to "
                                            "the rendered prompt (default false: the template writes them)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM's: more variables for the chat "
                                                        "template (for example enable_thinking)")
    tools: list[ToolDefinition] | None = Field(None, max_length=128, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default auto with tools; required and a named function constrain the output")
    parallel_tool_calls: bool | None = Field(None, description="with required: more than one call allowed "
                                             "(default true)")


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
ChatFinish = Literal["stop", "length", "tool_calls"]


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


class ToolCallFunction(Reply):
    name: str
    arguments: str


class ToolCall(Reply):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(Reply):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = Field(None, description="the thinking, with a reasoning parser (vLLM's name)")
    reasoning: str | None = Field(None, description="the same thinking (vLLM's newer name)")


class ChatChoice(Reply):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinish


class ChatCompletionResponse(Reply):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDeltaFunction(Reply):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Reply):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallDeltaFunction


class ChatDelta(Reply):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChunkChoice(Reply):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinish | None


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
    root: str | None = Field(None, description="a LoRA adapter's path")
    parent: str | None = Field(None, description="a LoRA adapter's base model")


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
