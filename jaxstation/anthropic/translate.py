"""A Messages request as the station's chat request, and a finished run as a Messages reply.

The prompt is the chat template's, exactly as for chat completions: `system` is the system turn (and so is a
message with role `system`, which Claude Code sends mid-conversation), `tool_use` blocks
are the assistant's tool calls, each `tool_result` a tool turn, and earlier thinking is dropped (templates drop it
too). tool_choice `auto`, `any`, `tool` and `none` are the tool plan's `auto`, `required`, a named function and
`none`; `disable_parallel_tool_use` allows one call; `thinking` sets the template's `enable_thinking`;
`output_config.format` is the JSON schema the output follows. Every API then shares one run of the engine; errors
name the Messages fields (`max_tokens`, `stop_sequences`, `output_config.format`).

A system text block that starts with `x-anthropic-billing-header:` is not prompt: Claude Code opens its system prompt
with one whose hash changes every session, and kept, it would end every session's cached prefix at its first line.

A tool with `defer_loading` is left out of the prompt until a `tool_reference` block in a tool result names it. The
reference shows the tool's definition there, in the tool's turn, as Anthropic's API does (a `<functions>` block of
`<function>` lines, what Claude Code's tool search tells the model to expect), and from then on the tool can be
called. The chat template's tool list, at the head of the prompt, stays the same as tools load, so the prefix cache
keeps the conversation's prompt.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxstation.anthropic import protocol as a
from jaxstation.chat.request import ChatRequest, Sampling, bad, function_tool, sampling_params, turn
from jaxstation.chat.run import Choice, Run
from jaxstation.engine.constraints import ConstraintSpec

BILLING_HEADER = "x-anthropic-billing-header:"
NAMES = {"stop": "stop_sequences"}  # how Messages spells chat's fields


def _text(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(b.text for b in content if isinstance(b, a.TextBlock))


def _system(content: str | list) -> str:
    """A system prompt's text, less Claude Code's per-session billing block."""
    if isinstance(content, list):
        content = [b for b in content if not (isinstance(b, a.TextBlock) and b.text.startswith(BILLING_HEADER))]
    return _text(content)


def _references(block: a.ToolResultBlock) -> list[tuple[int, a.ToolReferenceBlock]]:
    """The tool_reference blocks of a tool result, with their indices in its content."""
    content = block.content if isinstance(block.content, list) else []
    return [(k, b) for k, b in enumerate(content) if isinstance(b, a.ToolReferenceBlock)]


def _result(block: a.ToolResultBlock, tools: dict[str, dict]) -> str:
    """A tool result's text, each tool it references shown by its definition."""
    text, refs = _text(block.content), [tools[b.tool_name]["function"] for _, b in _references(block)]
    if not refs:
        return text
    shown = [{"description": f.get("description", ""), "name": f["name"], "parameters": f["parameters"]} for f in refs]
    functions = "<functions>\n" + "".join(f"<function>{json.dumps(d)}</function>\n" for d in shown) + "</functions>"
    return f"{text}\n{functions}" if text else functions


def _user_turns(content: str | list, tools: dict[str, dict]) -> list[dict]:
    if isinstance(content, str):
        return [turn("user", content)]
    out = [turn("tool", _result(b, tools), call_id=b.tool_use_id) for b in content
           if isinstance(b, a.ToolResultBlock)]
    texts = [b.text for b in content if isinstance(b, a.TextBlock)]
    return out + ([turn("user", "\n".join(texts))] if texts else [])


def _assistant_turn(content: str | list) -> dict:
    if isinstance(content, str):
        return turn("assistant", content)
    return turn("assistant", "\n".join(b.text for b in content if isinstance(b, a.TextBlock)),
                calls=[(b.id, b.name, b.input) for b in content if isinstance(b, a.ToolUseBlock)])


def messages(req: a.MessagesInput, tools: dict[str, dict]) -> list[dict]:
    """The request's system prompt and messages as the chat template's messages; `tools`: the custom tools by name."""
    out: list[dict] = []
    if req.system and (system := _system(req.system)):
        out.append(turn("system", system))
    for m in req.messages:
        if m.role == "system":
            out.append(turn("system", _system(m.content)))
        else:
            out += _user_turns(m.content, tools) if m.role == "user" else [_assistant_turn(m.content)]
    return out


def loaded(req: a.MessagesInput, tools: dict[str, dict]) -> set[str]:
    """The tools the conversation's tool results reference, or a 400 naming a reference to no tool of the request."""
    names = set()
    for i, m in enumerate(req.messages):
        for j, block in enumerate(m.content if isinstance(m.content, list) else ()):
            for k, ref in _references(block) if isinstance(block, a.ToolResultBlock) else ():
                if ref.tool_name not in tools:
                    field = f"messages[{i}].content[{j}].content[{k}].tool_name"
                    raise bad(field, f"{field} names {ref.tool_name!r}, which is not among the tools")
                names.add(ref.tool_name)
    return names


def chat_request(req: a.MessagesInput) -> ChatRequest:
    """The station's chat request of a Messages request (or of a count_tokens one, without sampling)."""
    choice = req.tool_choice
    sampling = Sampling(cap=True, model=req.model)
    if isinstance(req, a.MessagesRequest):
        sampling = Sampling(max_tokens=req.max_tokens, params=sampling_params(req.temperature, req.top_p, req.top_k),
                            stops=tuple(req.stop_sequences or ()), stream=bool(req.stream), cap=True, model=req.model)
    if req.output_config is not None and req.output_config.format is not None:
        schema = req.output_config.format.schema_ or {"type": "object"}
        sampling = dataclasses.replace(sampling, formats=(ConstraintSpec("json", schema, "output_config.format"),))
    custom = [t for t in req.tools or () if isinstance(t, a.CustomTool)]
    tools = {t.name: function_tool(t.name, t.description or None, t.input_schema) for t in custom}
    references = loaded(req, tools)
    return ChatRequest(
        messages=messages(req, tools), sampling=sampling,
        tools=tuple(tools[t.name] for t in custom if not t.defer_loading),
        loaded_tools=tuple(tools[t.name] for t in custom if t.defer_loading and t.name in references),
        tool_choice={a.ToolChoiceAuto: "auto", a.ToolChoiceAny: "required", a.ToolChoiceNone: "none"}.get(type(choice)),
        named_tool=choice.name if isinstance(choice, a.ToolChoiceTool) else None,
        parallel_tool_calls=not getattr(choice, "disable_parallel_tool_use", None),
        template_kwargs={"enable_thinking": req.thinking.type != "disabled"} if req.thinking is not None else {},
        names=NAMES)


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
    n = run.counts()
    return a.MessagesUsage(input_tokens=n.prompt - n.cached, output_tokens=n.generated,
                           cache_creation_input_tokens=0, cache_read_input_tokens=n.cached)


def shows_thinking(req: a.MessagesRequest) -> bool:
    """Whether the reply's thinking blocks carry their text: not with `thinking.display: "omitted"`."""
    return req.thinking is None or req.thinking.display != "omitted"


def reply(run: Run, head: dict, show_thinking: bool) -> a.MessageReply:
    """The Messages reply of a finished run (one choice); its thinking without its text unless `show_thinking`."""
    c = run.choices[0]
    blocks: list[a.ContentBlock] = []
    if c.thinking:
        blocks.append(a.ThinkingOut(type="thinking", thinking=c.thinking if show_thinking else "", signature=""))
    if c.content:
        blocks.append(a.TextOut(type="text", text=c.content))
    for call in c.calls:
        blocks.append(a.ToolUseOut(type="tool_use", id=call["id"], name=call["function"]["name"],
                                   input=call_input(call["function"]["arguments"])))
    reason, sequence = stop_reason(run, c)
    return a.MessageReply(**head, type="message", role="assistant", content=blocks, stop_reason=reason,
                          stop_sequence=sequence, usage=usage(run))
