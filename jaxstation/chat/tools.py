"""Tool calls as OpenAI defines them, for every face (Responses' and Messages' tool choices map onto chat's): tools
into the prompt, a constraint for `required` and named calls, and the model's text back into `tool_calls`.

Prompt. The tools reach the model through its chat template, which receives `tools` (and assistant `tool_calls`,
and `role: "tool"` messages) as HF templates expect. A template that ignores `tools` (SmolLM2-Instruct's does) gets
them in the Hermes style instead: a system prompt listing the functions in `<tools>` and asking for each call as
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`; earlier calls are rendered so in the assistant's turn, and
tool results as a user turn in `<tool_response>` tags.

tool_choice:
- "none": the tools are left out of the prompt and the text is not parsed;
- "auto" (the default with tools): the model answers freely; its text is parsed for calls (`parse_calls`);
- "required": the output is held to a JSON array of one or more calls of the offered tools (one call when
  parallel_tool_calls is false), each `{"name": <a tool's name>, "arguments": <its parameters schema>}`;
- a named function: the output is held to that function's parameters schema, and is the call's arguments.

Parser ("hermes"): `<tool_call>...</tool_call>` blocks, each a call object or a list of them (a block the output
leaves open at its end counts), or else a whole output that is one call object or a list of them (the Llama-3 JSON
style). A call object is {"name", "arguments"} or {"name", "parameters"}, naming an offered tool. The text before
the first block, less its trailing whitespace, is the message's content.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from functools import lru_cache
from typing import Any

from jaxstation.engine.constraints import ConstraintSpec
from jaxstation.model.chat_template import compile_template
from jaxstation.model.tokenizer import Tokenizer

PARSER = "hermes"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_name", "description": "d", "parameters": {}}}
HERMES_PROMPT = (
    "You can call functions to answer the user. The functions, as JSON signatures, are within <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, write a JSON object with its name and arguments within <tool_call></tool_call> tags:\n"
    "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n</tool_call>"
)


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask for: the mode, the offered tools (OpenAI's dicts) and, when named, the
    function."""

    mode: str  # "auto" | "required" | "named"
    tools: tuple[dict, ...]
    named: str | None = None
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_constraint(plan: ToolPlan) -> ConstraintSpec | None:
    """The constraint of `required` and named tool choices (None for auto)."""
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t["function"]["name"] == plan.named)
        return ConstraintSpec("json", _parameters(tool), "tool_choice")
    if plan.mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in plan.tools]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not plan.parallel:
        schema["maxItems"] = 1
    return ConstraintSpec("json", schema, "tool_choice")


@lru_cache(maxsize=16)
def _template_takes_tools(template: str) -> bool:
    """Whether a chat template renders `tools` at all (probed once per template)."""
    compiled = compile_template(template)
    messages = [{"role": "user", "content": "x"}]
    common = {"bos_token": "", "eos_token": "", "add_generation_prompt": True}
    try:
        return compiled.render(messages=messages, tools=[_PROBE_TOOL], **common) != compiled.render(
            messages=messages, **common)
    except Exception:  # a template that raises on tools does not take them as HF passes them
        return False


def _hermes_call(call: dict) -> str:
    arguments = call["function"]["arguments"]  # parsed already where it is JSON (`chat.request.turn`)
    return f"{OPEN}\n{json.dumps({'name': call['function']['name'], 'arguments': arguments})}\n{CLOSE}"


def template_messages(tok: Tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], dict]:
    """The messages and the extra template variables for `tools` (None: no tools in the prompt): passed to the
    template when it takes them, else rewritten in the Hermes style (see the module docstring)."""
    if tok.chat_template and _template_takes_tools(tok.chat_template):
        return messages, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = "\n".join(([m["content"]] if m.get("content") else []) + [_hermes_call(c) for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    if tools:
        prompt = HERMES_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _as_calls(value: Any, names: set[str]) -> list[dict] | None:
    """A call object or a list of them, as [{"name", "arguments": <JSON string>}], or None if `value` is not."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append({"name": item["name"],
                      "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)})
    return calls or None


def parse_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """The message's content and its calls ([{"name", "arguments"}]) from the model's text, for `plan.mode`. With
    calls in tool-call blocks, the content is the text before the first block."""
    if plan.mode == "named":
        return None, [{"name": plan.named, "arguments": text}]
    names = plan.names
    if plan.mode == "required":
        try:
            return None, _as_calls(json.loads(text), names) or []
        except ValueError:
            return text, []  # cut off by max_tokens: no complete call
    calls: list[dict] = []
    for block in _BLOCK.findall(text):
        try:
            found = _as_calls(json.loads(block.strip()), names)
        except ValueError:
            found = None
        if found is None:
            return text, []  # a malformed block: the text stays text
        calls.extend(found)
    if calls:
        return text[:text.find(OPEN)].rstrip() or None, calls
    try:
        whole = _as_calls(json.loads(text.strip()), names)
    except ValueError:
        whole = None
    return (None, whole) if whole else (text, [])


def held_from(text: str) -> int:
    """In auto mode, where the text a stream may not show yet starts: at a tool-call tag (or a prefix of one at the
    end), or at 0 when the output so far is a JSON call in the making (it starts with '{' or '['). Whitespace before
    that point waits too: content before a call ends without it."""
    if text.lstrip()[:1] in ("{", "["):
        return 0
    at = text.find(OPEN)
    if at < 0:
        at = len(text)
        for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
            if text.endswith(OPEN[:k]):
                at = len(text) - k
                break
    return len(text[:at].rstrip())


class ToolStream:
    """One choice's text under a tool plan: what its chunks may show as content now, its tool-call deltas, and at
    the end its message's content and calls.

    A named call streams its arguments as they are generated (the output is the arguments). Otherwise calls are
    sent whole when the output ends: a delta with the call's index, id, type and name, then one with its arguments.
    In auto mode, text before a tool-call block streams as content."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.raw = ""
        self.shown = 0
        self.content: str | None = None
        self.calls: list[dict] = []  # OpenAI's tool_calls entries, once finished
        self._named_id = call_id() if plan.mode == "named" else None
        self._named_sent = False  # the named call's first delta (id, type, name) is out

    def push(self, text: str) -> tuple[str, list[dict]]:
        """Take more text; return (content to show, tool-call deltas)."""
        self.raw += text
        if self.plan.mode == "named":
            head = []
            if not self._named_sent:
                self._named_sent = True
                head = [{"index": 0, "id": self._named_id, "type": "function",
                         "function": {"name": self.plan.named, "arguments": ""}}]
            return "", head + ([{"index": 0, "function": {"arguments": text}}] if text else [])
        if self.plan.mode == "required":
            return "", []
        upto = max(self.shown, held_from(self.raw))
        out, self.shown = self.raw[self.shown:upto], upto
        return out, []

    def finish(self) -> tuple[str, list[dict]]:
        """The output ended: parse it; return (content still to show, tool-call deltas still to send)."""
        self.content, calls = parse_calls(self.raw, self.plan)
        ids = [self._named_id] if self._named_id else [call_id() for _ in calls]
        self.calls = [{"id": i, "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for i, c in zip(ids, calls, strict=True)]
        if self.plan.mode == "named":
            return "", []
        if not calls:
            rest, self.shown = self.raw[self.shown:], len(self.raw)
            return rest, []
        deltas = []
        for index, call in enumerate(self.calls):
            deltas.append({"index": index, "id": call["id"], "type": "function",
                           "function": {"name": call["function"]["name"], "arguments": ""}})
            deltas.append({"index": index, "function": {"arguments": call["function"]["arguments"]}})
        return "", deltas
