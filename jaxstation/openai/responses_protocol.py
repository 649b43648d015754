"""OpenAI's Responses API (`/v1/responses`) as the station serves it, declared once as pydantic models: the request
(validated strictly, unknown fields refused by name), the response object, its output items and the stream's events.

Declared `ignored`, as they cannot change the tokens the station returns (docs/api.md lists them): `include`,
`prompt_cache_key` (prefix reuse is automatic), `client_metadata` (Codex's), `service_tier`, `safety_identifier`,
`stream_options`, `reasoning.summary`, `reasoning.generate_summary`, `text.verbosity`, and the `id`, `status` and
`phase` of input items and the `annotations` and `logprobs` of their text. `truncation` is accepted as "disabled"
only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from jaxstation.chat.hosted_tools import FUNCTION_TOOL, HOSTED_TOOL, HostedTool, tool_kind
from jaxstation.chat.protocol import Body, Reply
from jaxstation.server.protocol import ignored


class InputText(Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = ignored("an earlier output's")
    logprobs: list[Any] | None = ignored("an earlier output's")


class Item(Body):
    """An input item."""

    id: str | None = ignored("an earlier response's")
    status: str | None = ignored("an earlier response's")


class MessageItem(Item):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    phase: str | None = ignored("the client's label of an earlier message")


class FunctionCallItem(Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItemIn(Item):
    type: Literal["reasoning"]
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None


def _item_kind(value: Any) -> str:
    return (value.get("type") or "message") if isinstance(value, dict) else getattr(value, "type", None) or "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItemIn, Tag("reasoning")], Discriminator(_item_kind)]


class FunctionTool(Body):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="accepted; required and named calls always follow the schema")


Tool = Annotated[Annotated[FunctionTool, Tag(FUNCTION_TOOL)] | Annotated[HostedTool, Tag(HOSTED_TOOL)],
                 Discriminator(tool_kind(("function",)))]


class FunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextFormatText(Body):
    type: Literal["text"]


class TextFormatJsonObject(Body):
    type: Literal["json_object"]


class TextFormatJsonSchema(Body):
    type: Literal["json_schema"]
    name: str = Field(max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Body):
    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
                      Field(discriminator="type")] | None = None
    verbosity: str | None = ignored("the model has no verbosity setting")


class ReasoningConfig(Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="none turns the chat template's thinking off (enable_thinking), any other effort on")
    summary: str | None = ignored("the thinking comes back whole, never summarized")
    generate_summary: str | None = ignored("the thinking comes back whole, never summarized")


class ResponsesRequest(Body):
    model: str | None = Field(None, description="any name; the reply names the served model")
    input: str | list[InputItem]
    instructions: str | None = Field(None, description="the system turn; not carried over by previous_response_id")
    max_output_tokens: int | None = Field(None, ge=1, description="cut to the context left after the prompt")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[Tool] | None = Field(None, max_length=128, description="function tools; a tool of another type "
                                     "(web_search, namespace, ...) is left out of the prompt and named in the "
                                     "X-Jaxstation-Skipped-Tools header")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = Field(None, description="keep the response in memory for previous_response_id and GET "
                               "(default true; bounded, lost on restart)")
    previous_response_id: str | None = None
    stream: bool | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = ignored("extra output the station does not keep (encrypted reasoning, sources)")
    prompt_cache_key: str | None = ignored("prefix reuse is automatic")
    client_metadata: dict[str, Any] | None = ignored("client metadata")
    service_tier: str | None = ignored("one station serves every request alike")
    safety_identifier: str | None = ignored("client metadata")
    stream_options: dict[str, Any] | None = ignored("the stream's events are always the same")


# ---- replies -----------------------------------------------------------------------------------------------------
Status = Literal["in_progress", "completed", "incomplete"]


class OutputText(Reply):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ReasoningText(Reply):
    type: Literal["reasoning_text"]
    text: str


class OutputMessage(Reply):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: Status
    content: list[OutputText]


class OutputFunctionCall(Reply):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status


class OutputReasoning(Reply):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText]
    status: Status


OutputItem = Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]


class InputTokensDetails(Reply):
    cached_tokens: int


class OutputTokensDetails(Reply):
    reasoning_tokens: int = Field(description="the tokens generated in the thinking, its tags included")


class ResponseUsage(Reply):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Reply):
    reason: Literal["max_output_tokens"]


class ResponseError(Reply):
    code: str
    message: str


class ResponseObject(Reply):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float | None
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


class DeletedResponse(Reply):
    id: str
    object: Literal["response"]
    deleted: bool


class ResponseEvent(Reply):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    sequence_number: int
    response: ResponseObject


class ItemEvent(Reply):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class PartEvent(Reply):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: Annotated[OutputText | ReasoningText, Field(discriminator="type")]


class DeltaEvent(Reply):
    type: Literal["response.output_text.delta", "response.reasoning_text.delta",
                  "response.function_call_arguments.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int | None = None
    delta: str
    logprobs: list[Any] | None = None


class TextDoneEvent(Reply):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] | None = None


class ArgumentsDoneEvent(Reply):
    type: Literal["response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


StreamEvent = ResponseEvent | ItemEvent | PartEvent | DeltaEvent | TextDoneEvent | ArgumentsDoneEvent
