"""The station's `/openapi.json`, and schemathesis fuzzing a live station from it.

A real station (a real socket, real threads, the real engine) serves the document it generates from its pydantic
models; schemathesis reads it back over HTTP and sends every route valid and invalid bodies (wrong types, missing
fields, out-of-range numbers, huge arrays, deep nesting), a bounded number of examples per route. No reply may be a
5xx, break its declared schema or status codes, or hang; an invalid body must get a 4xx.

The station runs the default model's first two layers: its own tokenizer, chat template, embedding, final norm and
head, with 28 layers left out. What is fuzzed is the HTTP surface, which does not depend on the model's depth, and a
2-layer step compiles and runs in a fraction of the 30-layer one's time.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from pydantic import TypeAdapter
from schemathesis.core import NOT_SET
from schemathesis.core.parameters import ParameterLocation
from server_util import ServerThread, wait_for

from jaxstation.anthropic import protocol as anthropic_protocol
from jaxstation.app import create_app
from jaxstation.config.settings import StationConfig
from jaxstation.model.loader import LoadedModel
from jaxstation.openai import responses_protocol
from jaxstation.openai.protocol import ChatCompletionChunk, CompletionResponse, OpenAIErrorResponse
from jaxstation.server.protocol import IGNORED
from jaxstation.server.station import Station

# A short context keeps every valid request quick: at most 48 positions, 8 choices on 4 lanes; a 16-row packed step
# holds a third of the context, so one pack width (one compiled program) serves every prompt.
FUZZ_SHAPE = {"lanes": 4, "max_seq": 48, "prefill_chunk": 16, "kv_block": 16, "prefill_budget": "16"}
EXAMPLES = 8  # per route and generation mode (valid and invalid bodies)
STREAM_EVENTS = 2048  # read a stream to its end: at most 8 choices of 48 tokens
STREAM_CHUNKS = {"/v1/completions": CompletionResponse, "/v1/chat/completions": ChatCompletionChunk,
                 "/v1/responses": responses_protocol.StreamEvent, "/v1/messages": anthropic_protocol.StreamEvent}
NAMED_EVENTS = ("/v1/responses", "/v1/messages")  # streams of named events, without "[DONE]"
CASES: list[str] = []  # one entry per case sent, for the count in the docs
# A valid body that sets no limit on the tokens generated runs to the end of the context; it is sent with a small one,
# the route's first limit field (the schema allows any value >= 1). Every other field is sent as generated.
TOKEN_LIMITS = {"/v1/completions": ("max_tokens",), "/v1/chat/completions": ("max_completion_tokens", "max_tokens"),
                "/v1/responses": ("max_output_tokens",)}
FUZZ_MAX_TOKENS = 4


FUZZ_LAYERS = 2


def shallow(model: LoadedModel, layers: int) -> LoadedModel:
    """The model's first `layers` layers, with its tokenizer, embedding, final norm and head."""
    assert isinstance(model.params.layers, tuple), "the default model on CPU is unrolled"
    return dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, num_layers=layers),
                               params=dataclasses.replace(model.params, layers=model.params.layers[:layers]))


@pytest.fixture(scope="module")
def live(default_model: LoadedModel):
    station = Station(StationConfig(**FUZZ_SHAPE, continuous=True, drain_s=5, max_body_bytes=64 * 1024),
                      model=shallow(default_model, FUZZ_LAYERS))
    with ServerThread(create_app(station)) as server, server.client() as http:
        wait_for(lambda: http.get("/ready").status_code == 200, 300, "the station did not turn ready", 0.1)
        yield server, http
    print(f"\nschemathesis sent {len(CASES)} cases")


def test_openapi_lists_every_route_with_its_schemas(live) -> None:
    _, http = live
    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    routes = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert routes == {("/generate", "post"), ("/health", "get"), ("/ready", "get"), ("/metrics", "get"),
                      ("/reset_prefix_cache", "post"), ("/station/status", "get"),
                      ("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
                      ("/tokenize", "post"), ("/detokenize", "post"), ("/tokenizer_info", "get"),
                      ("/v1/responses", "post"), ("/v1/responses/{response_id}", "get"),
                      ("/v1/responses/{response_id}", "delete"), ("/v1/responses/{response_id}/cancel", "post"),
                      ("/v1/messages", "post"), ("/v1/messages/count_tokens", "post"), ("/api/hello", "get"),
                      ("/openapi.json", "get")}
    schemas = doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "200" in op["responses"], (path, method)
            if method == "post" and path not in ("/reset_prefix_cache", "/v1/responses/{response_id}/cancel"):
                assert op["requestBody"]["content"]["application/json"]["schema"], path
    chat = schemas["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False and "messages" in chat["required"]
    assert schemas["GenerateRequest"]["properties"]["max_new_tokens"]["minimum"] == 1
    assert schemas["CompletionRequest"]["properties"]["n"]["anyOf"][0]["maximum"] == 8
    error = doc["paths"]["/v1/completions"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/OpenAIErrorResponse"}
    error = doc["paths"]["/generate"]["post"]["responses"]["422"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}


def test_the_ignored_fields_are_declared_as_accepted(live) -> None:
    """A field that cannot change the tokens is in the schema, marked ignored, so the fuzzer sends it as valid; a
    field that shapes the output is declared without the mark."""
    _, http = live
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    marked = {(name, field) for name, schema in schemas.items()
              for field, prop in schema.get("properties", {}).items() if prop.get(IGNORED)}
    assert marked >= {("MessagesRequest", "metadata"), ("MessagesInput", "context_management"),
                      ("OutputConfig", "effort"), ("MessageOutputConfig", "effort"), ("Thinking", "budget_tokens"),
                      ("TextBlock", "cache_control"), ("CustomTool", "cache_control"),
                      ("ResponsesRequest", "prompt_cache_key"), ("ResponsesRequest", "client_metadata"),
                      ("ResponsesRequest", "include"), ("ReasoningConfig", "summary"),
                      ("ChatCompletionRequest", "user")}
    assert "output_config" in schemas["InputMessage"]["properties"]
    assert "function" in schemas["ToolDefinition"]["properties"]  # OpenAI's, apart from Anthropic's CustomTool
    served = [("CustomTool", "defer_loading"), ("Thinking", "display"), ("OutputConfig", "format"),
              ("ResponsesRequest", "store"), ("GenerateRequest", "resume")]
    assert all(field in schemas[name]["properties"] and (name, field) not in marked for name, field in served)


@pytest.fixture(scope="module")
def api_schema(live):
    server, _ = live
    schema = schemathesis.openapi.from_url(f"http://127.0.0.1:{server.port}/openapi.json")
    schema.config.generation.update(max_examples=EXAMPLES)
    schema.config.max_stream_events = STREAM_EVENTS
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_fuzz(case: schemathesis.Case) -> None:
    """Every generated case: no 5xx, the declared status codes, content types and schemas, and a 4xx for a body that
    breaks the schema. A body the schema allows may still be refused by a rule no type can say (a token id past the
    vocabulary, a prompt longer than the context), so a valid body's 4xx is not a failure; its error is checked."""
    CASES.append(f"{case.method} {case.path}")
    limits = TOKEN_LIMITS.get(case.path, ())
    if limits and isinstance(case.body, dict) and not case.meta.is_negative_at(ParameterLocation.BODY) and \
            all(case.body.get(field) is None for field in limits):
        case.body[limits[0]] = FUZZ_MAX_TOKENS
    try:
        response = case.call(timeout=60)
    except requests.Timeout:
        pytest.fail(f"{case.method} {case.path} hung")
    case.validate_response(response, excluded_checks=[schemathesis.checks.positive_data_acceptance])
    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        chunk = TypeAdapter(STREAM_CHUNKS[case.path])
        events = [line[line.index("data: ") + 6:] for line in response.text.split("\n\n") if "data: " in line]
        if case.path not in NAMED_EVENTS:
            assert events[-1] == "[DONE]", response.text
            events = events[:-1]
        for data in events:
            payload = json.loads(data)
            if payload.get("type") == "error":
                anthropic_protocol.AnthropicErrorResponse.model_validate(payload)
            elif "error" in payload and "type" not in payload:
                OpenAIErrorResponse.model_validate(payload)
            else:
                chunk.validate_python(payload)  # the declared shapes
        return
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"], response.text
        named = not case.path.startswith("/v1/messages")  # Anthropic's shape has no param: its message names it
        if response.status_code in (400, 422) and case.body is not NOT_SET and named:
            assert error.get("param") or error.get("field"), response.text  # it names the field


def test_every_route_was_fuzzed(live) -> None:
    _, http = live
    doc = http.get("/openapi.json").json()
    sent = set(CASES)
    for path, ops in doc["paths"].items():
        for method in ops:
            if path != "/openapi.json":  # schemathesis leaves out the route it read the document from
                assert f"{method.upper()} {path}" in sent, (method, path)
    assert len(CASES) > 300
