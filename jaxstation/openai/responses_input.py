"""A Responses request as the station's chat request, and the bounded store behind `store` and
`previous_response_id`.

The prompt is the chat template's, as for chat completions: `instructions` is the system turn, message items are
turns (developer as system), consecutive `function_call` items are one assistant turn's tool calls (joined to the
assistant message just before them), each `function_call_output` is a tool turn, and reasoning items are dropped
(templates drop earlier thinking too). `text.format` is what the output follows, `reasoning.effort` the template's
`enable_thinking` (off for "none"), and `max_output_tokens` is cut to the context left. Errors name the Responses
fields: `input`, `max_output_tokens`, `text.format`.

The store keeps each stored response and the conversation that led to it (its turns, the response's own included)
in memory: at most `responses_store_size` of them, none older than `responses_store_age_s`, the oldest evicted
first. It is lost when the station restarts. A client that resends the whole history (as Codex does, with
store=false) needs no store: its shared prefix is reused from the prefix cache all the same.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

from jaxstation.chat.request import ChatRequest, Sampling, function_tool, sampling_params, turn
from jaxstation.engine.constraints import ConstraintSpec
from jaxstation.openai import responses_protocol as r

NAMES = {"messages": "input", "max_tokens": "max_output_tokens"}  # how Responses spells chat's fields


def _text(content: str | list[r.InputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def turns(items: str | list) -> list[dict]:
    """The input's items as the chat template's messages."""
    if isinstance(items, str):
        return [turn("user", items)]
    out: list[dict] = []
    for item in items:
        if isinstance(item, r.MessageItem):
            out.append(turn(item.role, _text(item.content)))
        elif isinstance(item, r.FunctionCallItem):
            call = turn("assistant", None, calls=[(item.call_id, item.name, item.arguments)])
            if out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [*out[-1].get("tool_calls", []), *call["tool_calls"]]
            else:
                out.append(call)
        elif isinstance(item, r.FunctionCallOutputItem):
            out.append(turn("tool", item.output, call_id=item.call_id))
    return out


def output_turn(output: list[dict]) -> dict:
    """A response's output items as the assistant turn that continues its conversation."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    return turn("assistant", text, calls=[(item["call_id"], item["name"], item["arguments"])
                                          for item in output if item["type"] == "function_call"])


def _format(fmt: Any) -> tuple[ConstraintSpec, ...]:
    if isinstance(fmt, r.TextFormatJsonObject):
        return (ConstraintSpec("json", {"type": "object"}, "text.format"),)
    if isinstance(fmt, r.TextFormatJsonSchema):
        return (ConstraintSpec("json", fmt.schema_, "text.format"),)
    return ()


def chat_request(req: r.ResponsesRequest, history: list[dict]) -> ChatRequest:
    """The chat request of a Responses request; `history`: the turns of its previous response."""
    system = [turn("system", req.instructions)] if req.instructions else []
    choice = req.tool_choice
    sampling = Sampling(max_tokens=req.max_output_tokens, params=sampling_params(req.temperature, req.top_p),
                        formats=_format(req.text.format) if req.text is not None else (), stream=bool(req.stream),
                        cap=True, model=req.model)
    effort = req.reasoning.effort if req.reasoning is not None else None
    return ChatRequest(
        messages=system + history + turns(req.input), sampling=sampling,
        tools=tuple(function_tool(t.name, t.description, t.parameters, t.strict) for t in req.tools or ()
                    if isinstance(t, r.FunctionTool)),
        tool_choice=None if isinstance(choice, r.FunctionChoice) else choice,
        named_tool=choice.name if isinstance(choice, r.FunctionChoice) else None,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        template_kwargs={"enable_thinking": effort != "none"} if effort is not None else {}, names=NAMES)


@dataclasses.dataclass
class Stored:
    at: float  # time.monotonic() when stored
    response: r.ResponseObject
    conversation: list[dict]  # template messages, less the instructions, up to and including this response's output


class ResponseStore:
    """Stored responses by id, bounded in number and age, oldest evicted first. The server's event loop owns it:
    only the Responses routes touch it, from their handlers, so it needs no lock."""

    def __init__(self, size: int, age_s: float) -> None:
        self.size, self.age_s = size, age_s
        self.entries: collections.OrderedDict[str, Stored] = collections.OrderedDict()  # the event loop's

    def _expire(self) -> None:
        now = time.monotonic()
        while self.entries and (len(self.entries) > self.size
                                or now - next(iter(self.entries.values())).at > self.age_s):
            self.entries.popitem(last=False)

    def put(self, response: r.ResponseObject, conversation: list[dict]) -> None:
        self.entries[response.id] = Stored(time.monotonic(), response, conversation)
        self._expire()

    def get(self, response_id: str) -> Stored | None:
        self._expire()
        return self.entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self.entries.pop(response_id, None) is not None
