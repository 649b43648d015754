"""A Responses request as the chat completions request the station runs, and the bounded store behind `store` and
`previous_response_id`.

The prompt is the chat template's, as for chat completions: `instructions` is the system turn, message items are
turns (developer as system), consecutive `function_call` items are one assistant turn's tool calls (joined to the
assistant message just before them), each `function_call_output` is a tool turn, and reasoning items are dropped
(templates drop earlier thinking too). `text.format` is `response_format`, `reasoning.effort` the template's
`enable_thinking` (off for "none"), and `max_output_tokens` is `max_tokens`, cut to the context left.

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

from jaxstation.openai import responses_protocol as r


def _text(content: str | list[r.InputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def turns(items: str | list) -> list[dict]:
    """The input's items as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for item in items:
        if isinstance(item, r.MessageItem):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, r.FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [*out[-1].get("tool_calls", []), call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, r.FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def output_turn(output: list[dict]) -> dict:
    """A response's output items as the assistant turn that continues its conversation."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def _text_format(fmt: Any) -> dict[str, Any]:
    if isinstance(fmt, r.TextFormatJsonObject):
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, r.TextFormatJsonSchema):
        spec = {"name": fmt.name, "schema": fmt.schema_,
                **{k: v for k, v in (("description", fmt.description), ("strict", fmt.strict)) if v is not None}}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    return {}


def chat_body(req: r.ResponsesRequest, history: list[dict]) -> dict[str, Any]:
    """The chat completions body of a Responses request; `history`: the turns of its previous response."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"model": req.model, "messages": system + history + turns(req.input)}
    if functions := [t for t in req.tools or () if isinstance(t, r.FunctionTool)]:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in functions]
    if isinstance(req.tool_choice, r.FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.reasoning.effort != "none"}
    if req.text is not None:
        body.update(_text_format(req.text.format))
    sampling = {"max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "parallel_tool_calls": req.parallel_tool_calls, "user": req.user, "stream": req.stream}
    body.update({k: v for k, v in sampling.items() if v is not None})
    return {k: v for k, v in body.items() if v is not None}


@dataclasses.dataclass
class Stored:
    at: float  # time.monotonic() when stored
    response: r.ResponseObject
    conversation: list[dict]  # chat turns, less the instructions, up to and including this response's output


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
