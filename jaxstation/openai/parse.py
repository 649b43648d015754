"""An OpenAI completions or chat completions body as the station's request: validated against `openai.protocol`,
then translated into `chat.request`'s types (the chat messages as the template reads them, the sampling), which render,
tokenize and check what the types cannot. Every refusal is an `ApiError` naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxstation.chat.request import (
    ChatRequest,
    RunRequest,
    Sampling,
    bad,
    check_token_ids,
    function_tool,
    plan_chat,
    plan_run,
    render_chat,
    sampling_params,
    turn,
    unsupported,
    validate,
)
from jaxstation.chat.tools import template_messages
from jaxstation.engine.constraints import ConstraintSpec
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
from jaxstation.server.protocol import IgnoredFields, constraint_spec


def _formats(req: SamplingFields) -> tuple[ConstraintSpec, ...]:
    """The constraints response_format and structured_outputs ask for."""
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
    return tuple(asked)


def _sampling(req: SamplingFields, logprobs: int | None, max_tokens: int | None) -> Sampling:
    """The fields completions and chat completions share, as the station's sampling."""
    options = req.stream_options
    if options is not None and not req.stream:
        raise bad("stream_options", "stream_options is only allowed with stream=true")
    if options is not None and options.continuous_usage_stats and not options.include_usage:
        field = "stream_options.continuous_usage_stats"
        raise bad(field, f"{field} needs include_usage=true")
    return Sampling(max_tokens=max_tokens, params=sampling_params(req.temperature, req.top_p, req.top_k, req.min_p),
                    seed=req.seed, n=req.n or 1,
                    stops=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
                    stop_token_ids=tuple(req.stop_token_ids or ()), controls=req, formats=_formats(req),
                    logprobs=logprobs, stream=bool(req.stream), include_usage=bool(options and options.include_usage),
                    continuous_usage=bool(options and options.continuous_usage_stats),
                    include_stop=bool(req.include_stop_str_in_output),
                    skip_special=req.skip_special_tokens is not False, speculate=req.speculative is not False,
                    model=req.model)


def parse_completion(body: Any, tok: Tokenizer, vocab: int, max_request_tokens: int, eos_ids: frozenset[int],
                     on_device: bool, ignored: IgnoredFields | None = None) -> RunRequest:
    """A completions body as the station runs it; the ignored fields it sets are noted in `ignored`."""
    req = validate(CompletionRequest, body, REFUSED_FIELDS, ignored)
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
    return plan_run(prompts, _sampling(req, req.logprobs, req.max_tokens), False, max_request_tokens, vocab, eos_ids,
                    on_device, echo_texts)


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Chat messages as the template reads them: text parts joined."""
    return [turn(m.role, m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ()),
                 calls=[(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()],
                 call_id=m.tool_call_id, name=m.name) for m in messages]


def chat_request(req: ChatCompletionRequest, cap: bool = False) -> ChatRequest:
    """A validated chat completions body as the station's chat request. cap: a max_tokens past the context left is
    cut to it, not refused."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs", "top_logprobs needs logprobs=true")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling = _sampling(req, (req.top_logprobs or 0) if req.logprobs else None, max_tokens)
    choice = req.tool_choice
    return ChatRequest(
        messages=chat_messages(req.messages), sampling=dataclasses.replace(sampling, cap=cap),
        tools=tuple(function_tool(**t.function.model_dump()) for t in req.tools or ()),
        tool_choice=None if isinstance(choice, NamedToolChoice) else choice,
        named_tool=choice.function.name if isinstance(choice, NamedToolChoice) else None,
        parallel_tool_calls=req.parallel_tool_calls is not False, template_kwargs=req.chat_template_kwargs or {},
        add_generation_prompt=req.add_generation_prompt is not False, add_special_tokens=bool(req.add_special_tokens),
        truncate_prompt_tokens=req.truncate_prompt_tokens)


def parse_chat(body: Any, tok: Tokenizer, vocab: int, max_request_tokens: int, eos_ids: frozenset[int],
               on_device: bool, reasoning: str | None = None, cap: bool = False,
               ignored: IgnoredFields | None = None) -> RunRequest:
    """A chat completions body as the station runs it: how the /v1/chat/completions route prepares every request.
    reasoning: the station's reasoning parser (None: the thinking stays in the text); cap: as `chat_request`'s;
    the ignored fields it sets are noted in `ignored`."""
    return plan_chat(chat_request(validate(ChatCompletionRequest, body, REFUSED_FIELDS, ignored), cap), tok, vocab,
                     max_request_tokens, eos_ids, on_device, reasoning)


def parse_tokenize(body: Any, tok: Tokenizer) -> list[int]:
    """/tokenize: a prompt (tokenized as a completion's is) or chat messages (rendered through the template)."""
    if isinstance(body, dict) and "messages" in body:
        chat = validate(TokenizeChatRequest, body, REFUSED_FIELDS)
        gen = True if chat.add_generation_prompt is None else chat.add_generation_prompt
        messages, _ = template_messages(tok, chat_messages(chat.messages), None)
        return render_chat(tok, messages, gen)
    req = validate(TokenizeCompletionRequest, body, REFUSED_FIELDS)
    return tok.encode(req.prompt, add_special_tokens=True if req.add_special_tokens is None else req.add_special_tokens)


def parse_detokenize(body: Any, vocab: int) -> list[int]:
    return check_token_ids(validate(DetokenizeRequest, body, REFUSED_FIELDS).tokens, vocab, "tokens")
