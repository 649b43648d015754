"""From a request body to what the station runs: validate against `openai.protocol`, render chat messages through
the model's template, tokenize, and check what the types cannot (token ids, the context, rules between fields).
Every refusal is an `OpenAIError` naming the field."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from jaxstation.engine.constraints import ConstraintSpec
from jaxstation.engine.rows import SamplingParams
from jaxstation.model.tokenizer import Tokenizer
from jaxstation.openai.protocol import (
    REFUSED_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    SamplingFields,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from jaxstation.openai.reasoning import OPEN, after_thinking
from jaxstation.openai.tools import ToolPlan, template_messages, tool_constraint
from jaxstation.serving.errors import OpenAIError, describe
from jaxstation.serving.protocol import NO_TOKEN_STATE, check_allowed, constraint_spec, token_controls

M = TypeVar("M", bound=BaseModel)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param, "invalid_value")


def unsupported(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param, "unsupported_parameter")


def validate(model: type[M], body: Any) -> M:
    """`body` as `model`, or a 400 naming the first field that does not fit."""
    if not isinstance(body, dict):
        raise bad("body", "the body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        field, message, kind = describe(e)
        if kind == "unknown" and field in REFUSED_FIELDS:
            message = f"{message}: {REFUSED_FIELDS[field]}"
        raise (unsupported(field, message) if kind == "unknown" else bad(field, message)) from None


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
    model: str | None = None  # the model the request names: a LoRA adapter's name selects it (docs/lora.md)


def check_token_ids(tokens: list[int], vocab: int, param: str) -> list[int]:
    for t in tokens:
        if t >= vocab:
            raise bad(param, f"{param} holds token id {t}, outside the vocabulary [0, {vocab})")
    return tokens


def request_constraint(req: SamplingFields, tools: ToolPlan | None, on_device: bool) -> ConstraintSpec | None:
    """The one constraint a request asks for: response_format, structured_outputs, or a required or named
    tool_choice."""
    asked: list[ConstraintSpec] = []
    fmt = req.response_format
    if isinstance(fmt, JsonObjectFormat):
        asked.append(ConstraintSpec("json", {"type": "object"}, "response_format"))
    elif isinstance(fmt, JsonSchemaFormat):
        asked.append(ConstraintSpec("json", fmt.json_schema.schema_ or {"type": "object"}, "response_format"))
    if req.structured_outputs is not None:
        spec = constraint_spec(req.structured_outputs, "structured_outputs", bad)
        if spec is not None:
            asked.append(spec)
    if tools is not None and (spec := tool_constraint(tools)) is not None:
        asked.append(spec)
    if len(asked) > 1:
        fields = sorted({a.field.split(".")[0] for a in asked})
        raise bad(fields[-1], f"{' and '.join(fields)} each constrain the output: send one of them")
    if asked and not on_device:
        field = asked[0].field.split(".")[0]
        raise unsupported(field, f"{field} {NO_TOKEN_STATE}")
    return asked[0] if asked else None


def _common(req: SamplingFields, chat: bool, prompts: list[list[int]], logprobs: int | None, max_tokens: int | None,
            max_request_tokens: int, vocab: int, eos_ids: frozenset[int], on_device: bool,
            echo_texts: list[str] | None = None, tools: ToolPlan | None = None, cap: bool = False) -> RunRequest:
    """cap: a max_tokens past the context left is cut to it (as agents' APIs do) rather than refused."""
    prompt_param = "messages" if chat else "prompt"
    lengths, context_ends = [], []
    for i, p in enumerate(prompts):
        if not p:
            raise bad(prompt_param, f"prompt {i} is empty")
        room = max_request_tokens - len(p)
        if room < 1 and (max_tokens is None or cap):
            raise bad(prompt_param, f"the prompt ({len(p)} tokens) leaves no room to generate in the station's "
                                    f"context of {max_request_tokens} tokens")
        if max_tokens is None:
            lengths.append(room if chat else min(16, room))  # OpenAI's defaults: the rest of the context / 16
        elif cap:
            lengths.append(min(max_tokens, room))
            context_ends.append(max_tokens >= room)
        elif len(p) + max_tokens > max_request_tokens:
            raise bad("max_tokens", f"the prompt ({len(p)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                    f"station's context of {max_request_tokens} tokens")
        else:
            lengths.append(max_tokens)
    if (req.min_tokens or 0) > min(lengths):
        raise bad("min_tokens", f"min_tokens ({req.min_tokens}) exceeds max_tokens ({min(lengths)})")
    options = req.stream_options
    if options is not None and not req.stream:
        raise bad("stream_options", "stream_options is only allowed with stream=true")
    if options is not None and options.continuous_usage_stats and not options.include_usage:
        field = "stream_options.continuous_usage_stats"
        raise bad(field, f"{field} needs include_usage=true")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    if any(not s for s in stops):
        raise bad("stop", "stop strings must not be empty")
    stop_ids = frozenset(check_token_ids(req.stop_token_ids or [], vocab, "stop_token_ids"))
    controls = token_controls(req, vocab, on_device, bad, unsupported)
    sampling = SamplingParams(temperature=float(1.0 if req.temperature is None else req.temperature),
                              top_k=0 if req.top_k in (None, -1) else req.top_k,
                              top_p=float(1.0 if req.top_p is None else req.top_p),
                              min_p=float(req.min_p or 0.0), **controls)
    stop_ids |= frozenset() if req.ignore_eos else eos_ids
    check_allowed(sampling, stop_ids, bad)
    return RunRequest(chat=chat, prompts=prompts, n=req.n or 1, max_tokens=lengths, sampling=sampling, seed=req.seed,
                      model=req.model,
                      stops=tuple(stops), stop_ids=stop_ids, logprobs=logprobs, stream=bool(req.stream),
                      include_usage=bool(options and options.include_usage),
                      continuous_usage=bool(options and options.continuous_usage_stats),
                      include_stop=bool(req.include_stop_str_in_output),
                      skip_special=req.skip_special_tokens is not False,
                      echo_texts=echo_texts, constraint=request_constraint(req, tools, on_device), tools=tools,
                      speculate=req.speculative is not False, context_ends=tuple(context_ends))


def parse_completion(body: Any, tok: Tokenizer, vocab: int, max_request_tokens: int, eos_ids: frozenset[int],
                     on_device: bool) -> RunRequest:
    req = validate(CompletionRequest, body)
    if req.best_of is not None and req.best_of not in (1, req.n or 1):
        raise unsupported("best_of", f"best_of={req.best_of!r} is not supported (only 1 or n is accepted)")
    texts: list[str] | None = None
    prompt = req.prompt
    special = req.add_special_tokens is not False
    if isinstance(prompt, str):
        texts, prompts = [prompt], [tok.encode(prompt, add_special_tokens=special)]
    elif isinstance(prompt[0], str):
        texts, prompts = list(prompt), [tok.encode(p, add_special_tokens=special) for p in prompt]
    elif isinstance(prompt[0], int):
        prompts = [check_token_ids(prompt, vocab, "prompt")]
    else:
        prompts = [check_token_ids(p, vocab, "prompt") for p in prompt]
    if req.echo and req.stream:
        raise unsupported("echo", "echo=true is not supported with stream=true")
    if req.max_tokens == 0 and not req.echo:
        raise bad("max_tokens", "max_tokens must be >= 1 (0 is allowed only with echo=true, to score the prompt)")
    if req.truncate_prompt_tokens is not None:
        prompts, texts = [p[-req.truncate_prompt_tokens:] for p in prompts], None
    echo_texts = None
    if req.echo:  # the prompt as sent (or as truncated); token ids are decoded
        echo_texts = texts if texts is not None else [tok.decode(p) for p in prompts]
    return _common(req, False, prompts, req.logprobs, req.max_tokens, max_request_tokens, vocab, eos_ids, on_device,
                   echo_texts)


def _arguments(text: str) -> Any:
    """A call's arguments as templates read them: the parsed JSON object, or the string when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template reads them: roles mapped (developer is system), text parts joined, an
    assistant's tool calls with their arguments parsed, a tool result with its call id."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())
        msg: dict[str, Any] = {"role": _ROLES[m.role], "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tools and tool_choice as a plan, or None when no tool may be called."""
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    if not req.tools:
        if choice != "none":
            raise bad("tool_choice", "tool_choice needs tools")
        return None
    if choice == "none":
        return None
    tools = tuple(t.model_dump(by_alias=True, exclude_none=True) for t in req.tools)
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad("tools", "tools must have distinct function names")
    named = None
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
        if named not in names:
            raise bad("tool_choice", f"tool_choice names {named!r}, which is not among the tools ({', '.join(names)})")
    return ToolPlan("named" if named else choice, tools, named, req.parallel_tool_calls is not False)


def render_chat(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                add_special_tokens: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The chat template's text for `messages`, tokenized (the template writes its own special tokens, so the
    tokenizer adds none unless asked)."""
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                       **(template_kwargs or {}))
    except Exception as e:  # the template's raise_exception, a clashing variable, or no template at all
        raise bad("messages", f"the chat template failed: {e}") from None
    return tok.encode(text, add_special_tokens=add_special_tokens)


def chat_prompt(req: ChatCompletionRequest, tok: Tokenizer) -> tuple[ToolPlan | None, list[int]]:
    """A chat request's tool plan and its prompt's tokens."""
    tools = tool_plan(req)
    messages, variables = template_messages(tok, chat_messages(req.messages), list(tools.tools) if tools else None)
    prompt = render_chat(tok, messages, req.add_generation_prompt is not False, bool(req.add_special_tokens),
                         {**variables, **(req.chat_template_kwargs or {})})
    if req.truncate_prompt_tokens is not None:
        prompt = prompt[-req.truncate_prompt_tokens:]
    return tools, prompt


def parse_chat(body: Any, tok: Tokenizer, vocab: int, max_request_tokens: int, eos_ids: frozenset[int],
               on_device: bool, reasoning: str | None = None, cap: bool = False) -> RunRequest:
    """reasoning: the station's reasoning parser (None: the thinking stays in the text); cap: as `_common`'s."""
    req = validate(ChatCompletionRequest, body)
    tools, prompt = chat_prompt(req, tok)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs", "top_logprobs needs logprobs=true")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    run = _common(req, True, [prompt], (req.top_logprobs or 0) if req.logprobs else None, max_tokens,
                  max_request_tokens, vocab, eos_ids, on_device, tools=tools, cap=cap)
    if reasoning is None:
        return run
    opens = tok.decode(prompt[-8:], skip_special_tokens=False).rstrip().endswith(OPEN)
    constraint = after_thinking(run.constraint, reasoning, opens) if run.constraint is not None else None
    return dataclasses.replace(run, reasoning=reasoning, prompt_opens=opens, constraint=constraint)


def parse_tokenize(body: Any, tok: Tokenizer) -> list[int]:
    """/tokenize: a prompt (tokenized as a completion's is) or chat messages (rendered through the template)."""
    if isinstance(body, dict) and "messages" in body:
        chat = validate(TokenizeChatRequest, body)
        gen = True if chat.add_generation_prompt is None else chat.add_generation_prompt
        messages, _ = template_messages(tok, chat_messages(chat.messages), None)
        return render_chat(tok, messages, gen)
    req = validate(TokenizeCompletionRequest, body)
    return tok.encode(req.prompt, add_special_tokens=True if req.add_special_tokens is None else req.add_special_tokens)


def parse_detokenize(body: Any, vocab: int) -> list[int]:
    return check_token_ids(validate(DetokenizeRequest, body).tokens, vocab, "tokens")
