"""The one request every face translates its body into, and from it what the station runs.

A face validates its own pydantic body and builds a `ChatRequest` (messages as the chat template reads them, tools,
tool choice, template variables, and the `Sampling` of the run) or, for OpenAI's completions, a `Sampling` and its
prompts. Here the messages are rendered through the model's template, tokenized, and checked for what no type can say
(the context, token ids, rules between fields); the result is a `RunRequest`. Every refusal is an `ApiError`
naming the field as the face spells it (`names`: `max_tokens` is Responses' `max_output_tokens`, `messages` its
`input`), rendered in the shape of the route's API by `server.outcomes`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from jaxstation.chat.reasoning import OPEN, after_thinking
from jaxstation.chat.tools import ToolPlan, template_messages, tool_constraint
from jaxstation.engine.constraints import ConstraintSpec
from jaxstation.engine.rows import SamplingParams
from jaxstation.model.tokenizer import Tokenizer
from jaxstation.server.errors import ApiError, describe
from jaxstation.server.protocol import (
    NO_TOKEN_STATE,
    IgnoredFields,
    TokenControls,
    check_allowed,
    request_field,
    token_controls,
)

M = TypeVar("M", bound=BaseModel)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value")


def unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, param, "unsupported_parameter")


def validate(model: type[M], body: Any, refused: Mapping[str, str] | None = None,
             ignored: IgnoredFields | None = None) -> M:
    """`body` as `model`, or a 400 naming the first field that does not fit (with why, for a `refused` field); the
    ignored fields it sets are noted in `ignored`."""
    if not isinstance(body, dict):
        raise bad("body", "the body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        field, message, kind = describe(e, body)
        if kind == "unknown" and field in (refused or {}):
            message = f"{message}: {refused[field]}"
        raise (unsupported(field, message) if kind == "unknown" else bad(field, message)) from None
    if ignored is not None:
        ignored.note(req)
    return req


def _arguments(arguments: Any) -> Any:
    """A call's arguments as templates read them: the parsed JSON object, or the string when it is not JSON."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def turn(role: str, content: str | None, *, calls: Sequence[tuple[str, str, Any]] = (), call_id: str | None = None,
         name: str | None = None) -> dict[str, Any]:
    """One message as the chat template reads it: the role mapped (developer is system), the content a string, an
    assistant's (id, name, arguments) calls with their arguments parsed, a tool result with its call id."""
    msg: dict[str, Any] = {"role": _ROLES[role], "content": content or ""}
    if name is not None:
        msg["name"] = name
    if calls:
        msg["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": _arguments(a)}}
                             for i, n, a in calls]
    if call_id is not None:
        msg["tool_call_id"] = call_id
    return msg


def function_tool(name: str, description: str | None, parameters: dict | None, strict: bool | None = None) -> dict:
    """A function tool as chat templates (and `ToolPlan`) read it."""
    fields = {"name": name, "description": description, "parameters": parameters, "strict": strict}
    return {"type": "function", "function": {k: v for k, v in fields.items() if v is not None}}


def sampling_params(temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                    min_p: float | None = None) -> SamplingParams:
    """A face's sampling fields as the engine takes them, with the chat APIs' defaults for what was not sent
    (temperature 1; top_k 0 or -1 is off). The face's types have bounded them: they are not checked again."""
    return SamplingParams.bounded(temperature=float(1.0 if temperature is None else temperature),
                                  top_k=0 if top_k in (None, -1) else top_k,
                                  top_p=float(1.0 if top_p is None else top_p), min_p=float(min_p or 0.0))


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What shapes a run beside its prompt, as every face asks for it."""

    max_tokens: int | None = None  # None: the rest of the context (chat) or 16 (completions)
    params: SamplingParams = dataclasses.field(default_factory=sampling_params)  # the token controls join at `plan_run`
    seed: int | None = None  # choice j samples with seed + j; None: a random seed for each choice
    n: int = 1
    stops: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    controls: TokenControls = dataclasses.field(default_factory=TokenControls)  # penalties, bias, min_tokens, ...
    formats: tuple[ConstraintSpec, ...] = ()  # what the output follows, each naming the face's field
    logprobs: int | None = None  # None: off; k: the sampled token plus k alternatives
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    include_stop: bool = False
    skip_special: bool = True
    speculate: bool = True
    cap: bool = False  # a max_tokens past the context left is cut to it (as agents' APIs do) rather than refused
    model: str | None = None  # the model the request names: a LoRA adapter's name selects it (docs/lora.md)


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A chat request of any face: its messages (`turn`s), function tools (`function_tool`s), tool choice, template
    variables and sampling, and how the face spells the fields errors name."""

    messages: list[dict]
    sampling: Sampling
    tools: tuple[dict, ...] = ()  # listed in the prompt by the chat template
    loaded_tools: tuple[dict, ...] = ()  # callable too, their definitions in the conversation (a deferred tool loaded)
    tool_choice: str | None = None  # none, auto or required; None: auto with tools, else none
    named_tool: str | None = None  # the function a named tool choice calls
    parallel_tool_calls: bool = True
    template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    truncate_prompt_tokens: int | None = None
    names: Mapping[str, str] = dataclasses.field(default_factory=dict)  # internal field -> the face's


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """A validated request: what to run, and how to shape the reply."""

    chat: bool
    prompts: list[list[int]]
    n: int
    max_tokens: list[int]  # per prompt
    sampling: SamplingParams
    seed: int | None
    stops: tuple[str, ...]
    stop_ids: frozenset[int]
    logprobs: int | None  # None: off; k: the sampled token plus k alternatives
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage so far on every chunk (vLLM's continuous_usage_stats)
    include_stop: bool = False  # the stop string that ended a choice stays in its text
    skip_special: bool = True  # special tokens are left out of the text
    echo_texts: list[str] | None = None  # per prompt, with echo: the prompt's text, put before the completion
    constraint: ConstraintSpec | None = None  # what the output follows (compiled by the route, off the event loop)
    tools: ToolPlan | None = None  # a chat request's tools, unless tool_choice is none
    speculate: bool = True  # may draft tokens where the station speculates
    reasoning: str | None = None  # the reasoning parser splitting the thinking from the answer (chat only)
    prompt_opens: bool = False  # the rendered prompt ends with the thinking's opening tag
    context_ends: tuple[bool, ...] = ()  # per prompt, with cap: max_tokens was cut to the context left
    names: Mapping[str, str] = dataclasses.field(default_factory=dict)  # internal field -> the face's
    model: str | None = None  # the model the request names: a LoRA adapter's name selects it (docs/lora.md)

    def param(self, name: str) -> str:
        return self.names.get(name, name)


def check_token_ids(tokens: Sequence[int], vocab: int, param: str) -> list[int]:
    for t in tokens:
        if t >= vocab:
            raise bad(param, f"{param} holds token id {t}, outside the vocabulary [0, {vocab})")
    return list(tokens)


def request_constraint(formats: Sequence[ConstraintSpec], tools: ToolPlan | None, on_device: bool
                       ) -> ConstraintSpec | None:
    """The one constraint a request asks for: a response format, structured outputs, or a required or named tool
    choice."""
    asked = list(formats)
    if tools is not None and (spec := tool_constraint(tools)) is not None:
        asked.append(spec)
    if len(asked) > 1:
        fields = sorted({request_field(a.field) for a in asked})
        raise bad(fields[-1], f"{' and '.join(fields)} each constrain the output: send one of them")
    if asked and not on_device:
        field = request_field(asked[0].field)
        raise unsupported(field, f"{field} {NO_TOKEN_STATE}")
    return asked[0] if asked else None


def _lengths(prompts: list[list[int]], s: Sampling, chat: bool, max_request_tokens: int, names: Mapping[str, str]
             ) -> tuple[list[int], list[bool]]:
    """Each prompt's max tokens, and (with cap) whether it was cut to the context left."""
    prompt_param = names.get("messages", "messages") if chat else "prompt"
    max_param = names.get("max_tokens", "max_tokens")
    lengths, context_ends = [], []
    for i, p in enumerate(prompts):
        if not p:
            raise bad(prompt_param, f"prompt {i} is empty")
        room = max_request_tokens - len(p)
        if room < 1 and (s.max_tokens is None or s.cap):
            raise bad(prompt_param, f"the prompt ({len(p)} tokens) leaves no room to generate in the station's "
                                    f"context of {max_request_tokens} tokens")
        if s.max_tokens is None:
            lengths.append(room if chat else min(16, room))  # OpenAI's defaults: the rest of the context / 16
        elif s.cap:
            lengths.append(min(s.max_tokens, room))
            context_ends.append(s.max_tokens >= room)
        elif len(p) + s.max_tokens > max_request_tokens:
            raise bad(max_param, f"the prompt ({len(p)} tokens) plus {max_param} ({s.max_tokens}) exceeds the "
                                 f"station's context of {max_request_tokens} tokens")
        else:
            lengths.append(s.max_tokens)
    return lengths, context_ends


def plan_run(prompts: list[list[int]], s: Sampling, chat: bool, max_request_tokens: int, vocab: int,
             eos_ids: frozenset[int], on_device: bool, echo_texts: list[str] | None = None,
             tools: ToolPlan | None = None, names: Mapping[str, str] | None = None) -> RunRequest:
    """The run of `prompts` under `s`: each prompt's max tokens, the sampling parameters, stops and constraint."""
    names = names or {}
    lengths, context_ends = _lengths(prompts, s, chat, max_request_tokens, names)
    controls = s.controls
    if (controls.min_tokens or 0) > min(lengths):
        raise bad("min_tokens", f"min_tokens ({controls.min_tokens}) exceeds max_tokens ({min(lengths)})")
    if any(not stop for stop in s.stops):
        stop_param = names.get("stop", "stop")
        raise bad(stop_param, f"{stop_param} strings must not be empty")
    stop_ids = frozenset(check_token_ids(s.stop_token_ids, vocab, "stop_token_ids"))
    sampling = SamplingParams.bounded(s.params, **token_controls(controls, vocab, on_device, bad, unsupported))
    stop_ids |= frozenset() if controls.ignore_eos else eos_ids
    check_allowed(sampling, stop_ids, bad)
    return RunRequest(chat=chat, prompts=prompts, n=s.n, max_tokens=lengths, sampling=sampling, seed=s.seed,
                      stops=s.stops, stop_ids=stop_ids, logprobs=s.logprobs, stream=s.stream,
                      include_usage=s.include_usage, continuous_usage=s.continuous_usage,
                      include_stop=s.include_stop, skip_special=s.skip_special, echo_texts=echo_texts,
                      constraint=request_constraint(s.formats, tools, on_device), tools=tools,
                      speculate=s.speculate, context_ends=tuple(context_ends), names=names, model=s.model)


def tool_plan(req: ChatRequest) -> ToolPlan | None:
    """The request's tools and tool choice as a plan, or None when no tool may be called."""
    choice_param, tools_param = req.names.get("tool_choice", "tool_choice"), req.names.get("tools", "tools")
    tools = req.tools + req.loaded_tools
    choice = "named" if req.named_tool is not None else (req.tool_choice or ("auto" if tools else "none"))
    if not tools:
        if choice != "none":
            raise bad(choice_param, f"{choice_param} needs {tools_param}")
        return None
    if choice == "none":
        return None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad(tools_param, f"{tools_param} must have distinct function names")
    if req.named_tool is not None and req.named_tool not in names:
        raise bad(choice_param, f"{choice_param} names {req.named_tool!r}, which is not among the {tools_param} "
                                f"({', '.join(names)})")
    return ToolPlan(choice, tools, req.named_tool, req.parallel_tool_calls)


def render_chat(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                add_special_tokens: bool = False, template_kwargs: Mapping[str, Any] | None = None,
                param: str = "messages") -> list[int]:
    """The chat template's text for `messages`, tokenized (the template writes its own special tokens, so the
    tokenizer adds none unless asked)."""
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                       **(template_kwargs or {}))
    except Exception as e:  # the template's raise_exception, a clashing variable, or no template at all
        raise bad(param, f"the chat template failed: {e}") from None
    return tok.encode(text, add_special_tokens=add_special_tokens)


def chat_prompt(req: ChatRequest, tok: Tokenizer) -> tuple[ToolPlan | None, list[int]]:
    """A chat request's tool plan and its prompt's tokens."""
    param = req.names.get("messages", "messages")
    if not req.messages:
        raise bad(param, f"{param} holds no message for the prompt")
    tools = tool_plan(req)
    messages, variables = template_messages(tok, req.messages, list(req.tools) if tools else None)
    prompt = render_chat(tok, messages, req.add_generation_prompt, req.add_special_tokens,
                         {**variables, **req.template_kwargs}, param)
    if req.truncate_prompt_tokens is not None:
        prompt = prompt[-req.truncate_prompt_tokens:]
    return tools, prompt


def plan_chat(req: ChatRequest, tok: Tokenizer, vocab: int, max_request_tokens: int, eos_ids: frozenset[int],
              on_device: bool, reasoning: str | None = None) -> RunRequest:
    """A chat request as the station runs it. reasoning: the station's reasoning parser (None: the thinking stays in
    the text)."""
    tools, prompt = chat_prompt(req, tok)
    run = plan_run([prompt], req.sampling, True, max_request_tokens, vocab, eos_ids, on_device, tools=tools,
                   names=req.names)
    if reasoning is None:
        return run
    opens = tok.decode(prompt[-8:], skip_special_tokens=False).rstrip().endswith(OPEN)
    constraint = after_thinking(run.constraint, reasoning, opens) if run.constraint is not None else None
    return dataclasses.replace(run, reasoning=reasoning, prompt_opens=opens, constraint=constraint)
