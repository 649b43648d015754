"""A Messages request as the chat completions request the station runs, and a finished run as a Messages reply.

The prompt is the chat template's, exactly as for chat completions: `system` is the system turn (and so is a
message with role `system`, which Claude Code sends mid-conversation), `tool_use` blocks
are the assistant's tool calls, each `tool_result` a tool turn, and earlier thinking is dropped (templates drop it
too). tool_choice `auto`, `any`, `tool` and `none` are chat's `auto`, `required`, a named function and `none`;
`disable_parallel_tool_use` is `parallel_tool_calls: false`; `thinking` sets the template's `enable_thinking`;
`output_config.format` is a JSON-schema `response_format`. Both APIs then share one run of the engine.

A system text block that starts with `x-anthropic-billing-header:` is not prompt: Claude Code opens its system prompt
with one whose hash changes every session, and kept, it would end every session's cached prefix at its first line.
"""

from __future__ import annotations

import json
from typing import Any

from jaxstation.anthropic import protocol as a
from jaxstation.openai.run import Choice, Run

BILLING_HEADER = "x-anthropic-billing-header:"


def _text(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(b.text for b in content if isinstance(b, a.TextBlock))


def _system(content: str | list) -> str:
    """A system prompt's text, less Claude Code's per-session billing block."""
    if isinstance(content, list):
        content = [b for b in content if not (isinstance(b, a.TextBlock) and b.text.startswith(BILLING_HEADER))]
    return _text(content)


def _user_turns(content: str | list) -> list[dict]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
           for b in content if isinstance(b, a.ToolResultBlock)]
    texts = [b.text for b in content if isinstance(b, a.TextBlock)]
    return out + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant_turn(content: str | list) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    turn: dict[str, Any] = {"role": "assistant",
                            "content": "\n".join(b.text for b in content if isinstance(b, a.TextBlock))}
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in content if isinstance(b, a.ToolUseBlock)]
    if calls:
        turn["tool_calls"] = calls
    return turn


def _tool_choice(choice: a.ToolChoice | None) -> dict[str, Any]:
    if choice is None:
        return {}
    out: dict[str, Any] = {}
    if not isinstance(choice, a.ToolChoiceNone) and choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    match choice:
        case a.ToolChoiceAuto():
            out["tool_choice"] = "auto"
        case a.ToolChoiceAny():
            out["tool_choice"] = "required"
        case a.ToolChoiceTool():
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        case a.ToolChoiceNone():
            out["tool_choice"] = "none"
    return out


def chat_body(req: a.MessagesInput) -> dict[str, Any]:
    """The chat completions body of a Messages request (or of a count_tokens one, without sampling)."""
    messages: list[dict] = []
    if req.system and (system := _system(req.system)):
        messages.append({"role": "system", "content": system})
    for m in req.messages:
        if m.role == "system":
            messages.append({"role": "system", "content": _system(m.content)})
        else:
            messages += _user_turns(m.content) if m.role == "user" else [_assistant_turn(m.content)]
    body: dict[str, Any] = {"model": req.model, "messages": messages, **_tool_choice(req.tool_choice)}
    if tools := [t for t in req.tools or () if isinstance(t, a.ToolDefinition)]:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                           **({"description": t.description} if t.description else {})}}
                         for t in tools]
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": req.output_config.format.schema_}}
    if isinstance(req, a.MessagesRequest):
        sampling = {"max_tokens": req.max_tokens, "stop": req.stop_sequences, "stream": req.stream,
                    "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
        body.update({k: v for k, v in sampling.items() if v is not None})
    return body


def call_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as a tool_use block's input (a cut-off call's arguments are no object: {})."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(run: Run, c: Choice) -> tuple[a.StopReason, str | None]:
    """The stop_reason and stop_sequence of a finished choice: at the end of the context (its max_tokens cut to what
    was left), model_context_window_exceeded, so that a client does not retry for more output."""
    if c.finish == "tool_calls":
        return "tool_use", None
    if c.finish == "length":
        return ("model_context_window_exceeded" if run.req.context_ends[c.prompt] else "max_tokens"), None
    return ("stop_sequence", c.stop) if c.stop is not None else ("end_turn", None)


def usage(run: Run) -> a.MessagesUsage:
    """Anthropic's usage: the prompt's tokens read from the prefix cache apart from the rest."""
    u = run.usage()
    cached = u.prompt_tokens_details.cached_tokens
    return a.MessagesUsage(input_tokens=u.prompt_tokens - cached, output_tokens=u.completion_tokens,
                           cache_creation_input_tokens=0, cache_read_input_tokens=cached)


def reply(run: Run, head: dict) -> a.MessageReply:
    """The Messages reply of a finished run (one choice)."""
    c = run.choices[0]
    blocks: list[a.ContentBlock] = []
    if c.reasoning is not None and c.reasoning.text:
        blocks.append(a.ThinkingOut(type="thinking", thinking=c.reasoning.text, signature=""))
    text = "".join(c.answer) if c.tool is None else (c.tool.content or "")
    if text:
        blocks.append(a.TextOut(type="text", text=text))
    for call in c.tool.calls if c.tool is not None else ():
        blocks.append(a.ToolUseOut(type="tool_use", id=call["id"], name=call["function"]["name"],
                                   input=call_input(call["function"]["arguments"])))
    reason, sequence = stop_reason(run, c)
    return a.MessageReply(**head, type="message", role="assistant", content=blocks, stop_reason=reason,
                          stop_sequence=sequence, usage=usage(run))
