"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), driven by the official `anthropic` client
against a real uvicorn on loopback.

One continuous-batching station on the default model serves the module, with an API key that the client sends as
`x-api-key`. Requests are greedy and short, so replies are deterministic and the module stays fast.
"""

from __future__ import annotations

import json
import logging

import anthropic
import httpx
import pytest
from conftest import REFERENCE
from server_util import ServerThread, wait_for

from jaxstation.anthropic.protocol import MessagesRequest
from jaxstation.anthropic.translate import BILLING_HEADER, chat_request
from jaxstation.app import create_app
from jaxstation.chat.request import chat_prompt
from jaxstation.chat.tools import parse_calls
from jaxstation.config.settings import StationConfig
from jaxstation.model.loader import LoadedModel
from jaxstation.server.station import Station

SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}
KEY = "k3y"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
GREEDY = {"extra_body": {"temperature": 0}}  # the current SDK takes temperature only this way
SYSTEM = "You are a terse assistant who answers in one short sentence, in the language asked for."
HELLO = [{"role": "user", "content": "Say hello in French."}]
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def station(default_model: LoadedModel):
    st = Station(StationConfig(**SHAPE, continuous=True, drain_s=5, api_key=KEY), model=default_model)
    with ServerThread(create_app(st)) as server, server.client() as http:
        http.headers["x-api-key"] = KEY
        wait_for(lambda: http.get("/ready").status_code == 200, 120, "the station did not turn ready", 0.1)
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=KEY, max_retries=0,
                                     timeout=60)
        yield st, http, client


def check_order(types: list[str]) -> None:
    """Anthropic's documented event order."""
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta", "message_stop"]
    k = 2
    while k < len(types) - 2:
        assert types[k] == "content_block_start", types
        k += 1
        while types[k] == "content_block_delta":
            k += 1
        assert types[k] == "content_block_stop", types
        k += 1


def event_types(http: httpx.Client, body: dict) -> list[str]:
    """The names of a streamed reply's events, as sent (the SDK does not show pings)."""
    with http.stream("POST", "/v1/messages", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    return names


def streamed(client: anthropic.Anthropic, **kw) -> anthropic.types.Message:
    with client.messages.stream(model=MODEL, **kw) as stream:
        return stream.get_final_message()


def same_reply(a: anthropic.types.Message, b: anthropic.types.Message) -> None:
    assert [c.model_dump() for c in a.content] == [c.model_dump() for c in b.content]
    assert (a.stop_reason, a.stop_sequence, a.usage.output_tokens) == (b.stop_reason, b.stop_sequence,
                                                                       b.usage.output_tokens)
    assert a.usage.input_tokens + a.usage.cache_read_input_tokens == b.usage.input_tokens + \
        b.usage.cache_read_input_tokens


def test_create_and_stream_give_the_same_message(station) -> None:
    _, http, client = station
    msg = client.messages.create(model=MODEL, max_tokens=24, messages=HELLO, system=SYSTEM,
                                 **GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL and msg.id.startswith("msg_")
    assert [c.type for c in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens <= 24
    count = client.messages.count_tokens(model=MODEL, messages=HELLO, system=SYSTEM)
    assert count.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    again = streamed(client, max_tokens=24, messages=HELLO, system=SYSTEM, **GREEDY)
    same_reply(msg, again)
    check_order(event_types(http, {"max_tokens": 24, "messages": HELLO, "temperature": 0}))
    prompt = count.input_tokens  # the same prompt again: reused down to whole prefill chunks, less its last token
    assert again.usage.cache_read_input_tokens == (prompt - 1) // 32 * 32 > 0


def test_max_tokens_is_cut_to_the_context_and_reported(station) -> None:
    _, _, client = station
    short = client.messages.create(model=MODEL, max_tokens=3, messages=HELLO, **GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    whole = client.messages.create(model=MODEL, max_tokens=32000, messages=HELLO, **GREEDY)  # as agents ask
    assert whole.content[0].text.startswith(short.content[0].text)
    assert whole.usage.output_tokens + whole.usage.input_tokens + whole.usage.cache_read_input_tokens <= 512
    # a prompt that leaves a few positions: the reply fills the context, and says so rather than max_tokens
    for n in range(100, 200):
        long = [{"role": "user", "content": "Count on: " + " ".join(str(i) for i in range(1, n))}]
        if (prompt := client.messages.count_tokens(model=MODEL, messages=long).input_tokens) >= 500:
            break
    full = client.messages.create(model=MODEL, max_tokens=32000, messages=long, **GREEDY)
    assert full.stop_reason == "model_context_window_exceeded" and full.usage.output_tokens == 512 - prompt, prompt


def test_a_stop_sequence_ends_the_reply_and_is_named(station) -> None:
    _, _, client = station
    full = client.messages.create(model=MODEL, max_tokens=24, messages=HELLO, **GREEDY).content[0].text
    word = full.split()[1]
    for msg in (client.messages.create(model=MODEL, max_tokens=24, messages=HELLO, **GREEDY,
                                       stop_sequences=[word]),
                streamed(client, max_tokens=24, messages=HELLO, **GREEDY, stop_sequences=[word])):
        assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == word
        assert msg.content[0].text == full[:full.find(word)]


def test_a_two_turn_tool_conversation(station) -> None:
    _, http, client = station
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=MODEL, max_tokens=80, messages=ask, tools=[WEATHER], **GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use", first
    call = first.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and set(call.input) == {"city"}
    choice = {"type": "tool", "name": "get_weather"}
    again = streamed(client, max_tokens=80, messages=ask, tools=[WEATHER], **GREEDY, tool_choice=choice)
    check_order(event_types(http, {"max_tokens": 80, "messages": ask, "tools": [WEATHER], "tool_choice": choice}))
    assert (again.content[-1].name, again.content[-1].input, again.stop_reason) == (call.name, call.input,
                                                                                   "tool_use")
    follow = ask + [{"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": "Sunny, 21 C"}]}]
    second = client.messages.create(model=MODEL, max_tokens=30, messages=follow, tools=[WEATHER], **GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use") and second.content
    assert second.usage.cache_read_input_tokens > 0  # the first turn's prompt is the second's prefix


def test_output_config_holds_the_reply_to_a_schema(station) -> None:
    _, _, client = station
    schema = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 20}},
              "required": ["greeting"], "additionalProperties": False}
    msg = client.messages.create(model=MODEL, max_tokens=40, messages=HELLO, **GREEDY,
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    assert msg.stop_reason == "end_turn" and set(json.loads(msg.content[0].text)) == {"greeting"}


def test_what_claude_code_sends_is_accepted(station) -> None:
    _, http, _ = station
    body = {"model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": False, "temperature": 0,
            "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello in French.",
                                                       "cache_control": {"type": "ephemeral"}}]}],
            "metadata": {"user_id": "user_abc"}, "service_tier": "auto",
            "thinking": {"type": "enabled", "budget_tokens": 31999, "display": "omitted"},
            "context_management": {"edits": []},
            "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}]}
    r = http.post("/v1/messages?beta=true", json=body,
                  headers={"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"})
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message" and r.json()["model"] == MODEL


# Claude Code's first request of a session, in its shape: an environment block as a system message after the user's
# turn, cache marks, a per-message output_config, a deferred tool, adaptive thinking without display, context edits
ENVIRONMENT = {"role": "system", "content": [{"type": "text", "text": "# Environment\nPlatform: linux",
                                              "cache_control": {"type": "ephemeral"}}],
               "output_config": {"effort": "medium"}}
PLACEHOLDER = {"name": "DeferredToolPlaceholder", "description": "Reserved placeholder; never call this tool.",
               "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}
AGENT = {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.1c9;"},
                    {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
         "messages": HELLO + [ENVIRONMENT], "tools": [WEATHER, PLACEHOLDER],
         "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "medium"},
         "metadata": {"user_id": '{"device_id": "d", "session_id": "s"}'}}
AGENT_EXTRA = {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
               "temperature": 0}  # the current SDK takes these two only in extra_body
IGNORED_LOG = "jaxstation.server.protocol"


def test_claude_codes_request_is_taken_whole(station, caplog: pytest.LogCaptureFixture) -> None:
    """Claude Code's request answers 200, created and streamed alike; each ignored field is logged once by name."""
    _, _, client = station
    with caplog.at_level(logging.INFO, logger=IGNORED_LOG):
        msg = client.messages.create(model=MODEL, max_tokens=16, **AGENT, extra_body=AGENT_EXTRA)
    assert "/v1/messages: accepting and ignoring messages[].output_config.effort" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=IGNORED_LOG):
        same_reply(msg, streamed(client, max_tokens=16, **AGENT, extra_body=AGENT_EXTRA))
    assert "messages[].output_config.effort" not in caplog.text  # once per station
    assert msg.content and msg.usage.output_tokens <= 16
    # the deferred placeholder is not in the prompt: the request counts as many tokens without it
    count = {k: v for k, v in AGENT.items() if k != "metadata"}
    without = {**count, "tools": [WEATHER]}
    assert client.messages.count_tokens(model=MODEL, **count).input_tokens == \
        client.messages.count_tokens(model=MODEL, **without).input_tokens


def test_the_connection_check_answers_without_the_key(station) -> None:
    _, _, client = station
    url = f"{client.base_url}".rstrip("/") + "/api/hello"
    assert httpx.head(url).status_code == 200 and httpx.get(url).json() == {"status": "ok"}


SEARCH = {"name": "ToolSearch", "description": "Loads deferred tools by name",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}


def test_a_deferred_tool_is_shown_where_the_conversation_loads_it(default_model: LoadedModel) -> None:
    """A deferred tool is out of the prompt until a tool_reference names it; then its definition is in the tool
    result, the prompt's head is unchanged (the earlier prompt is the later one's prefix), and it can be called."""
    tok = default_model.tokenizer
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [SEARCH, {**WEATHER, "defer_loading": True}]

    def prompt(messages: list[dict]) -> tuple:
        return chat_prompt(chat_request(MessagesRequest.model_validate(
            {"model": MODEL, "max_tokens": 8, "tools": tools, "messages": messages})), tok)

    plan, before = prompt(ask)
    assert plan.names == {"ToolSearch"} and "get_weather" not in tok.decode(before)
    load = ask + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                                     "input": {"query": "select:get_weather"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                      {"type": "tool_reference", "tool_name": "get_weather"}]}]}]
    plan, after = prompt(load)
    assert after[:len(before)] == before and plan.names == {"ToolSearch", "get_weather"}
    shown = json.dumps({"description": WEATHER["description"], "name": "get_weather",
                        "parameters": WEATHER["input_schema"]})
    assert f"<functions>\n<function>{shown}</function>\n</functions>" in tok.decode(after)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert parse_calls(call, plan)[1] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]


def test_claude_codes_billing_block_is_not_prompt(default_model: LoadedModel) -> None:
    """Two real Claude Code sessions, whose first system blocks are billing lines with different hashes, give prompts
    that agree up to the user's turn, so that the second session reuses the first one's cached prefix."""
    sessions = json.loads((REFERENCE / "claude_code_sessions.json").read_text(encoding="utf-8"))["requests"]
    assert [r["system"][0]["text"][:27] for r in sessions] == [BILLING_HEADER] * 2
    first, second = (r["system"] for r in sessions)
    assert first[0] != second[0] and first[1:] == second[1:]
    prompts = [chat_prompt(chat_request(MessagesRequest.model_validate(r)), default_model.tokenizer)[1]
               for r in sessions]
    shared = next(i for i, (x, y) in enumerate(zip(*prompts, strict=False)) if x != y)
    system = default_model.tokenizer.encode(_system_text(sessions[0]))
    assert shared > len(system) > 1000, (shared, len(system), [len(p) for p in prompts])
    assert "x-anthropic-billing-header" not in default_model.tokenizer.decode(prompts[0])


def test_server_tools_are_skipped_and_named(station) -> None:
    _, _, client = station
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=4, messages=HELLO, tools=[WEATHER, search],
                                                   **GREEDY)
    assert raw.headers["x-jaxstation-skipped-tools"] == "web_search_20250305:web_search"
    assert raw.parse().usage.output_tokens == 4


def _system_text(request: dict) -> str:
    return "\n".join(b["text"] for b in request["system"][1:])


@pytest.mark.parametrize("change, field", [
    ({"mcp_servers": []}, "mcp_servers"),
    ({"min_p": 0.1}, "min_p"),  # a sampling control the station does not take here: it would change the output
    ({"messages": [{"role": "user", "content": "hi", "output_config": {"format": {"type": "json_schema",
                                                                                "schema": {}}}}]},
     "messages[0].output_config.format"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"stop_sequences": [""]}, "stop_sequences[0]"),
])
def test_refusals_name_the_field_in_anthropics_shape(station, change, field) -> None:
    _, http, _ = station
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": HELLO, **change})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert field in body["error"]["message"]


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strnig"}}}


@pytest.mark.parametrize("change, field, words", [
    ({"output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}}, "output_config.format", "strnig"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}, "tools": [WEATHER],
      "tool_choice": {"type": "any"}}, "output_config.format and tool_choice", "send one"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice", "not among"),
    ({"messages": [{"role": "user", "content": []}]}, "messages", "no message"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                {"type": "text", "text": "x", "source": {}}]}]},
     "messages[0].content[1].source", "unsupported"),
    ({"system": 5}, "system", "no accepted form"),
    ({"tools": [WEATHER], "messages": HELLO + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "found"}, {"type": "tool_reference", "tool_name": "nope"}]}]}]},
     "messages[2].content[0].content[1].tool_name", "not among the tools"),
], ids=["bad schema", "two constraints", "choice without tools", "unknown tool", "no turn", "field in a block",
        "system", "reference to no tool"])
def test_refusals_name_the_messages_field_the_client_sent(station, change, field, words) -> None:
    """The request is checked as Messages, not as a chat completion: the error names the Messages field, never a
    chat completions one (response_format, stop) that the client did not send."""
    _, _, client = station
    body = {"max_tokens": 8, "messages": HELLO, **change}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, **body)
    error = e.value.body["error"]
    assert error["type"] == "invalid_request_error" and field in error["message"] and words in error["message"], error
    assert not {"response_format", "stop", "max_completion_tokens"} & set(error["message"].replace(":", " ").split())


def test_errors_and_the_key(station) -> None:
    st, http, client = station
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": HELLO},
                  headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError, match="leaves no room"):
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi " * 600}])
