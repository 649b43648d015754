"""OpenAI's Responses API (`/v1/responses`), driven by the official `openai` client against a real uvicorn on
loopback, and the same request through chat completions, Responses and Messages giving the same tokens.

One continuous-batching station on the default model serves the module (a store of two responses, to see eviction).
Requests are greedy and short, so replies are deterministic and the module stays fast.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import threading

import anthropic
import openai
import pydantic
import pytest
from conftest import REFERENCE
from server_util import ServerThread, wait_for

from jaxstation.app import create_app
from jaxstation.chat import stream as chat_stream
from jaxstation.config.settings import StationConfig
from jaxstation.model.loader import LoadedModel
from jaxstation.server.station import Station

SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}
MODEL = "SmolLM2-135M-Instruct.Q4_1"
HELLO = "Say hello in French."
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
ITEM_EVENTS = {"message": ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                           "response.output_text.done", "response.content_part.done", "response.output_item.done"],
               "function_call": ["response.output_item.added", "response.function_call_arguments.delta",
                                 "response.function_call_arguments.done", "response.output_item.done"]}


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def station(default_model: LoadedModel):
    st = Station(StationConfig(**SHAPE, continuous=True, drain_s=5, responses_store_size=2), model=default_model)
    with ServerThread(create_app(st)) as server, server.client() as http:
        wait_for(lambda: http.get("/ready").status_code == 200, 120, "the station did not turn ready", 0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        yield server, http, client, st


def check_order(events: list) -> None:
    """OpenAI's documented order: created, in_progress, each item's events in turn, then the end; numbered 0..."""
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    k = 2
    while k < len(types) - 1:
        kind = events[k].item.type
        steps = ITEM_EVENTS[kind]
        assert types[k] == steps[0]
        k += 1
        for step in steps[1:]:
            while types[k] == step and step.endswith(".delta"):
                k += 1
            if not step.endswith(".delta"):
                assert types[k] == step, (types[k], step)
                k += 1


def streamed(client: openai.OpenAI, **kw) -> tuple[openai.types.responses.Response, list]:
    """The final response (from the last event: the SDK's get_final_response wants response.completed, and a
    response cut at max_output_tokens ends with response.incomplete) and the events."""
    with client.responses.stream(model=MODEL, **kw) as stream:
        events = list(stream)
    return events[-1].response, events


def items(response: openai.types.responses.Response) -> list[dict]:
    """The output items less their ids (the parsed copy the SDK adds to a streamed one dropped)."""
    out = []
    for item in response.output:
        d = item.model_dump(exclude_none=True, exclude={"id", "call_id"})
        d["content"] = [{k: v for k, v in part.items() if k != "parsed"} for part in d.get("content", ())]
        out.append(d)
    return out


def same_output(a: openai.types.responses.Response, b: openai.types.responses.Response) -> None:
    assert items(a) == items(b)
    assert (a.status, a.usage.output_tokens, a.usage.input_tokens) == (b.status, b.usage.output_tokens,
                                                                       b.usage.input_tokens)


def test_create_and_stream_give_the_same_response(station) -> None:
    _, _, client, _ = station
    whole = client.responses.create(model=MODEL, input=HELLO, instructions="Be terse.", max_output_tokens=24,
                                    temperature=0, store=False)
    assert whole.object == "response" and whole.status in ("completed", "incomplete") and whole.model == MODEL
    assert [i.type for i in whole.output] == ["message"] and whole.output_text
    assert whole.usage.output_tokens_details.reasoning_tokens == 0
    again, events = streamed(client, input=HELLO, instructions="Be terse.", max_output_tokens=24, temperature=0,
                             store=False)
    same_output(whole, again)
    check_order(events)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    prompt = whole.usage.input_tokens  # the same prompt again: reused down to whole prefill chunks
    assert again.usage.input_tokens_details.cached_tokens == (prompt - 1) // 32 * 32


def test_max_output_tokens_is_cut_to_the_context_and_reported(station) -> None:
    _, _, client, _ = station
    short = client.responses.create(model=MODEL, input=HELLO, max_output_tokens=3, temperature=0, store=False)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 3
    whole = client.responses.create(model=MODEL, input=HELLO, max_output_tokens=100000, temperature=0, store=False)
    assert whole.output_text.startswith(short.output_text)


def test_tools_and_a_function_call_output_follow_up(station) -> None:
    _, _, client, _ = station
    kw = {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0,
          "max_output_tokens": 80, "store": False}
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", **kw)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and set(call.model_dump()) >= {"call_id"}
    again, events = streamed(client, input="What is the weather in Paris?", **kw)
    same_output(first, again)
    check_order(events)
    follow = [{"role": "user", "content": "What is the weather in Paris?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    second = client.responses.create(model=MODEL, input=follow, tools=[WEATHER], temperature=0,
                                     max_output_tokens=30, store=False)
    assert second.output and second.usage.input_tokens_details.cached_tokens > 0


def test_text_format_with_a_pydantic_model(station) -> None:
    _, _, client, _ = station
    parsed = client.responses.parse(model=MODEL, input="Invent a person.", text_format=Person, temperature=0,
                                    max_output_tokens=60, store=False)
    assert isinstance(parsed.output_parsed, Person)


def test_previous_response_id_and_the_bounded_store(station) -> None:
    _, http, client, _ = station
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0, max_output_tokens=12)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=12)
    resent = client.responses.create(model=MODEL, temperature=0, max_output_tokens=12, store=False, input=[
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.output_text == resent.output_text and second.previous_response_id == first.id
    assert second.usage.input_tokens == resent.usage.input_tokens
    client.responses.create(model=MODEL, input=HELLO, temperature=0, max_output_tokens=2)  # the store holds two
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)  # the oldest was evicted
    assert http.delete(f"/v1/responses/{second.id}").json() == {"id": second.id, "object": "response",
                                                                 "deleted": True}
    assert http.get(f"/v1/responses/{second.id}").status_code == 404
    r = http.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": second.id})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("change, field", [
    ({"background": True}, "background"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "image", "url": "x"}]}, "input"),
    ({"truncation": "auto"}, "truncation"),
])
def test_refusals_name_the_field(station, change, field) -> None:
    _, http, _, _ = station
    r = http.post("/v1/responses", json={"model": MODEL, "input": HELLO, **change})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


@pytest.mark.parametrize("change, param, words", [
    ({"input": []}, "input", "no message"),
    ({"input": "hi " * 600}, "input", "leaves no room"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": 5}]}, "input[2].content", "no accepted form"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strnig"}}}}}}, "text.format", "strnig"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER], "tool_choice": "required"}, "tool_choice",
     "text.format and tool_choice each constrain"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not among"),
], ids=["no input", "too long", "deep in an item", "bad schema", "two constraints", "unknown tool"])
def test_refusals_name_the_responses_field_the_client_sent(station, change, param, words) -> None:
    """The request is checked as Responses, not as a chat completion: the error names the Responses field, never a
    chat completions one (messages, max_tokens, response_format) that the client did not send."""
    _, _, client, _ = station
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": MODEL, "input": HELLO, "max_output_tokens": 4, **change})
    assert e.value.param == param and words in e.value.message, e.value.body
    assert not {"messages", "max_tokens", "response_format"} & set(e.value.message.replace(":", " ").split())


def test_tools_the_station_cannot_run_are_skipped_and_named(station) -> None:
    """The hosted web_search and the namespace of sub-agent tools of Codex's own request (captured) are left out, a
    function tool kept; a function tool with a bad name is still refused."""
    _, http, client, _ = station
    codex = json.loads((REFERENCE / "codex_request.json").read_text(encoding="utf-8"))["request"]
    hosted = [t for t in codex["tools"] if t["type"] != "function"]
    assert [t["type"] for t in hosted] == ["namespace", "web_search"]
    tools = [WEATHER, *hosted]
    raw = client.responses.with_raw_response.create(model=codex["model"], input=HELLO, tools=tools,
                                                    max_output_tokens=4, store=False, temperature=0)
    assert raw.headers["x-jaxstation-skipped-tools"] == "namespace:multi_agent_v1, web_search"
    assert raw.parse().status == "incomplete"
    r = http.post("/v1/responses", json={"model": MODEL, "input": HELLO, "tools": [{**WEATHER, "name": "a b"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].name", r.text


def test_the_same_request_through_three_apis_gives_the_same_tokens(station) -> None:
    """One prompt (the same template rendering), one greedy run each: the same tokens, shown as the same text."""
    server, _, client, _ = station
    ask = [{"role": "user", "content": HELLO}]
    chat = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=20, logprobs=True)
    resp = client.responses.create(model=MODEL, input=ask, temperature=0, max_output_tokens=20, store=False)
    messages = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0)
    msg = messages.messages.create(model=MODEL, messages=ask, max_tokens=20, extra_body={"temperature": 0})
    tokens = chat.choices[0].logprobs.content
    shown = tokens[:-1] if chat.choices[0].finish_reason == "stop" else tokens  # a stop token is listed, not text
    text = b"".join(bytes(t.bytes) for t in shown).decode()
    assert resp.output_text == msg.content[0].text == chat.choices[0].message.content == text
    assert resp.usage.output_tokens == msg.usage.output_tokens == chat.usage.completion_tokens == len(shown)
    assert resp.usage.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens == \
        chat.usage.prompt_tokens


def test_a_reply_does_not_depend_on_what_runs_beside_it(station) -> None:
    """A Messages and a Responses request run together, in one decode wave, give the tokens each gives alone."""
    server, _, client, _ = station
    messages = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0)

    def message() -> tuple[str, int]:
        m = messages.messages.create(model=MODEL, messages=[{"role": "user", "content": HELLO}], max_tokens=20,
                                     extra_body={"temperature": 0})
        return m.content[0].text, m.usage.output_tokens

    def response() -> tuple[str, int]:
        r = client.responses.create(model=MODEL, input="Name a color.", temperature=0, max_output_tokens=20,
                                    store=False)
        return r.output_text, r.usage.output_tokens

    alone = (message(), response())
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = tuple(f.result() for f in [pool.submit(message), pool.submit(response)])
    assert together == alone


def test_thinking_comes_back_where_each_api_puts_it(station, monkeypatch) -> None:
    """With the deepseek_r1 parser the output starts in the thinking; SmolLM2 never closes it, so every token is
    thinking: chat's reasoning_content, a Responses reasoning item, a Messages thinking block, streamed alike."""
    server, _, client, st = station
    monkeypatch.setattr(st, "config", dataclasses.replace(st.config, reasoning_parser="deepseek_r1"))
    ask = [{"role": "user", "content": HELLO}]
    chat = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=12)
    thinking = chat.choices[0].message.reasoning_content
    assert thinking and chat.choices[0].message.reasoning == thinking and chat.choices[0].message.content == ""
    chunks = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=12, stream=True)
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == thinking
    kw = {"input": ask, "temperature": 0, "max_output_tokens": 12, "store": False}
    whole = client.responses.create(model=MODEL, **kw)
    again, events = streamed(client, **kw)
    same_output(whole, again)
    assert [(i.type, i.content[0].text) for i in whole.output] == [("reasoning", thinking)]
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens == 12
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thinking
    messages = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0)
    msg = messages.messages.create(model=MODEL, messages=ask, max_tokens=12, extra_body={"temperature": 0})
    with messages.messages.stream(model=MODEL, messages=ask, max_tokens=12, extra_body={"temperature": 0}) as s:
        streamed_msg = s.get_final_message()
    assert [(b.type, b.thinking) for b in msg.content] == [(b.type, b.thinking) for b in streamed_msg.content] == [
        ("thinking", thinking)]
    omitted = {"type": "adaptive", "display": "omitted"}  # the blocks come back without their text
    msg = messages.messages.create(model=MODEL, messages=ask, max_tokens=12, thinking=omitted,
                                   extra_body={"temperature": 0})
    with messages.messages.stream(model=MODEL, messages=ask, max_tokens=12, thinking=omitted,
                                  extra_body={"temperature": 0}) as s:
        streamed_msg = s.get_final_message()
    assert [(b.type, b.thinking) for b in msg.content] == [(b.type, b.thinking) for b in streamed_msg.content] == [
        ("thinking", "")] and msg.usage.output_tokens == 12


def fail_decode_after(st: Station, monkeypatch: pytest.MonkeyPatch, ok_calls: int) -> None:
    """Make the station's decode step raise after `ok_calls` good calls, once; then it runs again."""
    real, calls = st.engine.decode, []

    def decode(*args, **kwargs):
        calls.append(1)
        if len(calls) == ok_calls + 1:
            raise RuntimeError("injected decode failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(st.engine, "decode", decode)


def stream_until_failure(server: ServerThread, api: str) -> tuple[list[str], str]:
    """Stream HELLO through `api` with its SDK: the text that came before the failure, and the failure's message
    (as each API carries it: an error chunk, `response.failed`, an `error` event)."""
    ask, text = [{"role": "user", "content": HELLO}], []
    openai_client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
    try:
        if api == "responses":
            with openai_client.responses.stream(model=MODEL, input=ask, temperature=0, max_output_tokens=40,
                                                store=False) as stream:
                events = list(stream)
            text = [e.delta for e in events if e.type == "response.output_text.delta"]
            assert events[-1].type == "response.failed", [e.type for e in events[-3:]]
            return text, events[-1].response.error.message
        if api == "messages":
            messages = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused",
                                           max_retries=0)
            with messages.messages.stream(model=MODEL, messages=ask, max_tokens=40) as stream:
                for piece in stream.text_stream:
                    text.append(piece)
        elif api == "chat":
            for chunk in openai_client.chat.completions.create(model=MODEL, messages=ask, temperature=0,
                                                               max_tokens=40, stream=True):
                text.append(chunk.choices[0].delta.content or "")
        else:
            for chunk in openai_client.completions.create(model=MODEL, prompt=HELLO, temperature=0, max_tokens=40,
                                                          stream=True):
                text.append(chunk.choices[0].text)
    except (openai.APIError, anthropic.APIError) as e:
        return text, str(e)
    raise AssertionError(f"the {api} stream ended without its failure event")


@pytest.mark.parametrize("api", ["chat", "completions", "responses", "messages"])
def test_a_step_failing_mid_stream_ends_each_api_stream_with_its_failure_event(station, monkeypatch, api) -> None:
    server, http, _, st = station
    fail_decode_after(st, monkeypatch, 2)
    text, message = stream_until_failure(server, api)
    assert "".join(text) and "injected decode failure" in message, (text, message)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": HELLO, "max_tokens": 2})
    assert r.status_code == 200  # the station keeps serving


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_a_stream_opens_before_the_prompt_is_prefilled(station, monkeypatch, api) -> None:
    """The opening events (Messages' message_start and ping, Responses' created and in_progress) reach the client
    while the prompt's first step is still held, and beats (Messages' ping, else an SSE comment) follow through the
    silence, so a long prefill never leaves a client or proxy without bytes."""
    server, http, _, st = station
    monkeypatch.setattr(chat_stream, "KEEPALIVE_S", 0.2)
    held, entered = threading.Event(), threading.Event()
    for name in ("pack", "prefill"):
        real = getattr(st.engine, name)

        def waiting(*args, _real=real, **kwargs):
            entered.set()
            assert held.wait(30), "the test did not release the step"
            return _real(*args, **kwargs)

        monkeypatch.setattr(st.engine, name, waiting)
    path, body = (("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": HELLO}]})
                  if api == "messages" else ("/v1/responses", {"max_output_tokens": 4, "input": HELLO}))
    opening = ["message_start", "ping"] if api == "messages" else ["response.created", "response.in_progress"]
    with http.stream("POST", path, json={"model": MODEL, "stream": True, "temperature": 0, **body}) as r:
        lines = r.iter_lines()
        names = [line[7:] for line in itertools.islice(lines, 6) if line.startswith("event: ")]
        assert names == opening and entered.wait(30) and not held.is_set()
        beats = [line for line in itertools.islice(lines, 6) if line]
        assert beats == (["event: ping", 'data: {"type":"ping"}'] * 2 if api == "messages" else
                         [": keep-alive"] * 3), beats
        held.set()
        rest = [line[7:] for line in lines if line.startswith("event: ")]
    assert rest[-1] in ("message_stop", "response.incomplete", "response.completed"), rest
