"""Structured outputs and tool calls over HTTP, driven by the official `openai` client against a real uvicorn: the
SDK's `parse()` with pydantic models, json_object, regexes and choices (also on /v1/completions and /generate), tools
with required, named and auto choices, streamed and not, a two-turn tool conversation, and every refusal. Each
constrained output is checked against its schema with `jsonschema`.

One continuous-batching station on the default model (4 lanes, 512 positions) serves the module. Requests are greedy
and schemas bounded (short strings, closed objects) so that SmolLM2-135M finishes them well within max_tokens.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
from server_util import ServerThread, wait_for

from jaxstation.app import create_app
from jaxstation.chat.tools import HERMES_PROMPT, ToolPlan, ToolStream, parse_calls
from jaxstation.config.settings import StationConfig
from jaxstation.model.loader import LoadedModel
from jaxstation.openai.parse import parse_chat
from jaxstation.server.errors import ApiError
from jaxstation.server.station import Station

SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}
MODEL = "SmolLM2-135M-Instruct.Q4_1"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK_BOTH = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]  # a call of each tool


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=16)
    country: str = pydantic.Field(max_length=16)
    population_millions: float


@pytest.fixture(scope="module")
def live(default_model: LoadedModel):
    station = Station(StationConfig(**SHAPE, continuous=True, drain_s=5), model=default_model)
    with ServerThread(create_app(station)) as server, server.client(timeout=120) as http:
        wait_for(lambda: http.get("/ready").status_code == 200, 300, "the station did not turn ready", 0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        yield client, http


def schema_of(tool: dict) -> dict:
    return tool["function"]["parameters"]


# ---- response_format and structured_outputs ----------------------------------------------------------------------
@pytest.mark.parametrize("model", [Person, City])
def test_parse_with_a_pydantic_model(live, model):
    client, _ = live
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Give me an example."}],
                                      response_format=model, temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model)
    jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())


def test_json_object(live):
    client, _ = live
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a cat in JSON."}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=120)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_a_regex_and_a_choice_on_completions(live):
    client, _ = live
    r = client.completions.create(model=MODEL, prompt="The year the Eiffel Tower was finished:", max_tokens=10,
                                  temperature=0, extra_body={"structured_outputs": {"regex": "1[0-9]{3}"}})
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].text) == 4 and r.choices[0].text.isdigit()
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0.9,
                                  seed=3, n=3, extra_body={"structured_outputs": {"choice": [" yes", " no"]}})
    assert [c.finish_reason for c in r.choices] == ["stop"] * 3
    assert {c.text for c in r.choices} <= {" yes", " no"}


def test_a_grammar_and_a_json_schema_in_structured_outputs(live):
    client, _ = live
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 6 times 7?"}],
                                       temperature=0, max_tokens=20,
                                       extra_body={"structured_outputs": {"grammar": grammar}})
    text = r.choices[0].message.content
    assert text.startswith("The answer is ") and text.endswith(".") and text[14:-1].isdigit()
    schema = Person.model_json_schema()
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                       temperature=0, max_tokens=80,
                                       extra_body={"structured_outputs": {"json": json.dumps(schema)}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_a_streamed_json_schema_equals_the_whole_reply(live):
    client, _ = live
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema()}}
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Invent a person."}], "temperature": 0,
          "max_tokens": 80, "response_format": person}
    whole = client.chat.completions.create(**kw).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
              if c.choices]
    assert "".join(pieces) == whole
    jsonschema.validate(json.loads(whole), Person.model_json_schema())


def test_generate_takes_structured_outputs(live):
    _, http = live
    r = http.post("/generate", json={"tokens": [504, 3575, 282], "max_new_tokens": 12,
                                     "structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["finish_reason"] == "stop" and 2 <= len(body["generated"]) <= 7
    r = http.post("/detokenize", json={"tokens": body["generated"]})
    text = r.json()["prompt"]
    assert len(text) == 7 and text[4] == "-" and (text[:4] + text[5:]).isdigit()


# ---- tools ------------------------------------------------------------------------------------------------------
def collect_stream(stream) -> tuple[str, dict[int, dict], str | None]:
    """(content, {index: {"id", "type", "name", "arguments"}}, finish_reason) of a streamed single choice, checking
    OpenAI's delta rules: id, type and name once per call, arguments in fragments."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "type": d.type, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_calls_are_well_formed(live, stream):
    client, _ = live
    kw = {"model": MODEL, "messages": ASK_BOTH, "tools": [WEATHER, TIME], "tool_choice": "required",
          "temperature": 0, "max_tokens": 120}
    if stream:
        content, found, finish = collect_stream(client.chat.completions.create(**kw, stream=True))
        calls = [(c["name"], c["arguments"]) for _, c in sorted(found.items())]
        assert content == ""
    else:
        r = client.chat.completions.create(**kw)
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        assert message.content is None
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert all(c.type == "function" and c.id.startswith("call_") for c in message.tool_calls)
    assert finish == "tool_calls" and calls
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schema_of(tools[name]))


def test_one_required_call_without_parallel_calls(live):
    client, _ = live
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_call(live, stream):
    client, _ = live
    kw = {"model": MODEL, "messages": ASK, "tools": [TIME, WEATHER], "temperature": 0, "max_tokens": 80,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if stream:
        _, found, finish = collect_stream(client.chat.completions.create(**kw, stream=True))
        assert list(found) == [0]
        name, arguments = found[0]["name"], found[0]["arguments"]
    else:
        r = client.chat.completions.create(**kw)
        finish, (call,) = r.choices[0].finish_reason, r.choices[0].message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    assert finish == "tool_calls" and name == "get_weather"
    jsonschema.validate(json.loads(arguments), schema_of(WEATHER))


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("forced", [f"Let me check. {HERMES_CALL}",
                                    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'],
                         ids=["hermes", "llama3 json"])
def test_auto_parses_the_models_calls(live, stream, forced):
    """auto: the model's own text, parsed. The text is forced with a one-string choice (the model is free under
    auto), once in Hermes tags after some prose, once as Llama-3's bare JSON."""
    client, _ = live
    kw = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 80,
          "extra_body": {"structured_outputs": {"choice": [forced]}}}
    if stream:
        content, found, finish = collect_stream(client.chat.completions.create(**kw, stream=True))
        calls = [(c["name"], c["arguments"]) for c in found.values()]
    else:
        r = client.chat.completions.create(**kw)
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert finish == "tool_calls"
    assert calls == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    assert (content or "") == ("Let me check." if forced.startswith("Let") else "")


def test_auto_text_stays_text(live):
    client, _ = live
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=12,
                                       extra_body={"structured_outputs": {"regex": "It is sunny in Paris today\\."}})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == "It is sunny in Paris today."


def test_a_two_turn_tool_conversation(live, default_model):
    """The call and its result go back in; the template (SmolLM2's ignores tools) gets the Hermes rendering."""
    client, _ = live
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=16)
    assert second.choices[0].message.content and second.choices[0].message.tool_calls is None
    req = parse_chat({"messages": messages, "tools": [WEATHER]}, default_model.tokenizer, 49152, 512,
                     frozenset({2}), True)
    text = default_model.tokenizer.decode(req.prompts[0])
    assert HERMES_PROMPT.split("\n")[0] in text and json.dumps(WEATHER) in text
    arguments = json.dumps(json.loads(call.function.arguments))
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in text


def test_the_parser_on_its_own():
    plan = ToolPlan("auto", (WEATHER, TIME))
    two = '<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call>\n<tool_call>[{"name": ' \
          '"get_weather", "parameters": {"city": "Rome"}}]'  # a list in a block, left open at the end
    assert parse_calls(two, plan) == (None, [{"name": "get_time", "arguments": '{"city": "Oslo"}'},
                                             {"name": "get_weather", "arguments": '{"city": "Rome"}'}])
    assert parse_calls('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', plan)[1] == []
    assert parse_calls("<tool_call>{not json</tool_call>", plan) == ("<tool_call>{not json</tool_call>", [])
    assert parse_calls("plain words", plan) == ("plain words", [])


def test_the_stream_splits_content_from_calls():
    named = ToolStream(ToolPlan("named", (WEATHER,), "get_weather"))
    deltas = [d for piece in ("", '{"city"', ': "Rome"}') for d in named.push(piece)[1]]
    assert [("id" in d, d["function"].get("arguments")) for d in deltas] == [(True, ""), (False, '{"city"'),
                                                                             (False, ': "Rome"}')]
    assert named.finish() == ("", []) and named.calls[0]["function"]["arguments"] == '{"city": "Rome"}'
    auto = ToolStream(ToolPlan("auto", (WEATHER,)))
    shown = [auto.push(piece)[0] for piece in ("Sure ", "thing. <tool", '_call>{"name": "get_weather", ',
                                               '"arguments": {}}</tool_call> trailing')]
    assert shown == ["Sure", " thing.", "", ""]  # trailing spaces and a tag's start wait
    rest, deltas = auto.finish()
    assert rest == "" and auto.content == "Sure thing." and [d["index"] for d in deltas] == [0, 0]
    text = ToolStream(ToolPlan("auto", (WEATHER,)))
    assert [text.push(p)[0] for p in ("a <", "b")] == ["a", " <b"] and text.finish() == ("", [])


# ---- refusals ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strnig"}}}}}}, "response_format", "strnig"),
    ({"response_format": {"type": "xml"}}, "response_format", "type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "unclosed"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs", "nowhere"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "send one"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "send one"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "pattern"),
    ({"guided_json": {"type": "object"}}, "guided_json", "structured_outputs"),
    ({"functions": [{"name": "f"}]}, "functions", "tools"),
], ids=["bad schema", "bad format type", "bad regex", "bad grammar", "json not json", "two kinds", "two fields",
        "tools and a format", "choice without tools", "unknown tool", "duplicate tools", "bad tool name",
        "guided_json", "functions"])
def test_refusals_name_the_field(live, extra, param, words):
    _, http = live
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param.split(".")[0]) and words in error["message"], error


def test_no_token_left_is_a_clear_error(live):
    """A grammar whose tokens allowed_token_ids rules out: 400 in a whole reply, an error event in a stream."""
    _, http = live
    body = {"messages": ASK, "max_tokens": 4, "allowed_token_ids": [13, 30],
            "structured_outputs": {"choice": ["yes", "no"]}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "constraint_failed"
    assert "allows no token" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={**body, "stream": True})
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "constraint_failed"
    r = http.post("/generate", json={"tokens": [1, 2], "max_new_tokens": 3, "allowed_token_ids": [13],
                                     "structured_outputs": {"choice": ["yes"]}})
    assert r.status_code == 422 and r.json()["error"]["field"] == "structured_outputs"


def test_a_mesh_host_refuses_constraints(default_model):
    for body in ({"response_format": {"type": "json_object"}}, {"tools": [WEATHER], "tool_choice": "required"}):
        with pytest.raises(ApiError) as e:
            parse_chat({"messages": ASK, **body}, default_model.tokenizer, 49152, 512, frozenset({2}), False)
        assert e.value.status == 400 and "mesh host" in str(e.value)


def test_generate_refuses_a_bad_constraint(live):
    _, http = live
    r = http.post("/generate", json={"tokens": [1, 2], "max_new_tokens": 3, "structured_outputs": {"regex": "(x"}})
    assert r.status_code == 422 and r.json()["error"]["field"] == "structured_outputs"
