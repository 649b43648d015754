"""Anthropic's Messages API as the station serves it, declared once as pydantic models: the request bodies of
`POST /v1/messages` and `/v1/messages/count_tokens` (unknown fields refused by name), the reply, the stream's events
and the error shape.

A field that cannot change the tokens the station returns is declared `ignored` (docs/api.md lists them): prompt
caching marks, the request's metadata, the service tier, context management, the thinking budget, the output effort
(of the request or of a message), and whether a tool result is an error. Everything else that is not served is
refused with a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from jaxstation.chat.hosted_tools import FUNCTION_TOOL, HOSTED_TOOL, HostedTool, tool_kind
from jaxstation.chat.protocol import Body, Reply
from jaxstation.server.protocol import ignored

ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class Ignorable(Body):
    cache_control: dict[str, Any] | None = ignored("prefix reuse is automatic")


class TextBlock(Ignorable):
    type: Literal["text"]
    text: str


class ToolUseBlock(Ignorable):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolReferenceBlock(Ignorable):
    type: Literal["tool_reference"]
    tool_name: str = Field(description="a tool of the request's tools, whose definition the tool result shows: a "
                           "deferred tool is loaded so")


class ToolResultBlock(Ignorable):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ToolReferenceBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = ignored("the content says what happened")


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: str


InputBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                       Field(discriminator="type")]


class MessageOutputConfig(Body):
    effort: str | None = ignored("the model has no effort levels")


class InputMessage(Body):
    role: Literal["user", "assistant", "system"] = Field(description="system: a system turn mid-conversation (as "
                                                         "Claude Code sends), rendered where the chat template puts "
                                                         "system text")
    content: str | list[InputBlock] = Field(description="earlier turns' thinking blocks are dropped from the prompt")
    output_config: MessageOutputConfig | None = None


class CustomTool(Ignorable):
    type: Literal["custom"] | None = None
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON schema of the tool's input")
    defer_loading: bool | None = Field(None, description="true: left out of the prompt until a tool_reference block "
                                       "in a tool result names it, which shows its definition there")


# a server tool (web_search_20250305, bash_20250124, ...) is left out of the prompt and named in a header
Tool = Annotated[Annotated[CustomTool, Tag(FUNCTION_TOOL)] | Annotated[HostedTool, Tag(HOSTED_TOOL)],
                 Discriminator(tool_kind(("custom", None)))]


class ToolChoiceAuto(Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Body):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Body):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Body):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class Thinking(Body):
    type: Literal["enabled", "disabled", "adaptive"] = Field(
        description="enabled or adaptive turn the chat template's thinking on (enable_thinking), disabled off")
    budget_tokens: int | None = ignored("max_tokens bounds the whole output", ge=0)
    display: str | None = Field(None, description="omitted: thinking blocks come back without their text; any other "
                                "value shows it whole")


class JsonSchemaOutput(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    format: JsonSchemaOutput | None = Field(None, description="the output follows this JSON schema")
    effort: str | None = ignored("the model has no effort levels")


class MessagesInput(Body):
    """What shapes the prompt: the fields count_tokens takes."""

    model: str = Field(description="any name; the reply names the served model")
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=128, description="custom tools; a server tool is left out of "
                                     "the prompt and named in the X-Jaxstation-Skipped-Tools header")
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: dict[str, Any] | None = ignored("the station runs no context edit: the conversation is "
                                                        "the prompt as sent, earlier thinking left out")


class MessagesRequest(MessagesInput):
    max_tokens: int = Field(ge=1, description="cut to the context left after the prompt")
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=16)
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="0 is off")
    metadata: dict[str, Any] | None = ignored("client metadata")
    service_tier: str | None = ignored("one station serves every request alike")


# ---- replies -----------------------------------------------------------------------------------------------------
class TextOut(Reply):
    type: Literal["text"]
    text: str


class ThinkingOut(Reply):
    type: Literal["thinking"]
    thinking: str
    signature: str


class ToolUseOut(Reply):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[TextOut | ThinkingOut | ToolUseOut, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


class MessagesUsage(Reply):
    input_tokens: int = Field(description="prompt tokens not read from the prefix cache")
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int = Field(description="prompt tokens reused from the prefix cache")


class MessageReply(Reply):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessagesUsage


class CountTokensReply(Reply):
    input_tokens: int


class HelloReply(Reply):
    """`GET /api/hello`: the server answers (Claude Code sends `HEAD /api/hello` to open its connection)."""

    status: Literal["ok"]


class MessageStart(Reply):
    type: Literal["message_start"]
    message: MessageReply


class Ping(Reply):
    type: Literal["ping"]


class BlockStart(Reply):
    type: Literal["content_block_start"]
    index: int
    content_block: ContentBlock


class TextDelta(Reply):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(Reply):
    type: Literal["thinking_delta"]
    thinking: str


class InputJsonDelta(Reply):
    type: Literal["input_json_delta"]
    partial_json: str


class BlockDelta(Reply):
    type: Literal["content_block_delta"]
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | InputJsonDelta, Field(discriminator="type")]


class BlockStop(Reply):
    type: Literal["content_block_stop"]
    index: int


class MessageDeltaBody(Reply):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(Reply):
    type: Literal["message_delta"]
    delta: MessageDeltaBody
    usage: MessagesUsage


class MessageStop(Reply):
    type: Literal["message_stop"]


StreamEvent = Annotated[MessageStart | Ping | BlockStart | BlockDelta | BlockStop | MessageDelta | MessageStop,
                        Field(discriminator="type")]


class AnthropicErrorDetail(Reply):
    type: str
    message: str


class AnthropicErrorResponse(Reply):
    """Anthropic's error shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail
