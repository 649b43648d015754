"""The OpenAI-compatible routes, driven by the official `openai` client against a real uvicorn on loopback.

One continuous-batching station on the default model, float32-exact (4 lanes, 512 positions), serves the module; the
auth test starts a second station with an API key on the default model. Token counts stay small to keep the module
fast.
"""

from __future__ import annotations

import copy
import json
import threading

import httpx
import openai
import pytest
from server_util import ServerThread, metric, queue_held_full, raw_post, wait_for

from jaxstation.app import create_app
from jaxstation.config.settings import StationConfig
from jaxstation.model.loader import LoadedModel
from jaxstation.openai.parse import parse_chat, render_chat
from jaxstation.openai.protocol import MAX_PROMPTS
from jaxstation.server.station import Station

SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}
READY_S = 120
MODEL = "SmolLM2-135M-Instruct.Q4_1"
CHINESE = [{"role": "user", "content": "Say hello in Chinese."}]
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def make_station(model: LoadedModel, **overrides) -> Station:
    return Station(StationConfig(**{**SHAPE, "continuous": True, "drain_s": 5, **overrides}), model=model)


def wait_ready(client: httpx.Client) -> None:
    wait_for(lambda: client.get("/ready").status_code == 200, READY_S, "the station did not turn ready", 0.1)


def openai_client(server: ServerThread, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def station(exact_model: LoadedModel):
    """The default model's blocks float32-exact: the replies asserted word for word below are the dequantized
    model's (integer products, the default, answer some of these prompts differently)."""
    st = make_station(exact_model, dtype="gguf-exact", speculative="ngram")  # every test here runs with speculation on
    with ServerThread(create_app(st)) as server, server.client() as http:
        wait_ready(http)
        yield st, server, http, openai_client(server)


def cancelled_total(http: httpx.Client) -> float:
    return metric(http.get("/metrics").text, "jaxstation_requests_total", {"outcome": "cancelled"})


def chat_text(client: openai.OpenAI, messages: list[dict], **kw) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def stream_chat(client: openai.OpenAI, messages: list[dict], **kw) -> tuple[list[str], str | None, object]:
    """(content pieces, finish_reason, usage) of a streamed chat completion with one choice."""
    pieces, finish, usage, roles = [], None, None, []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw):
        assert chunk.object == "chat.completion.chunk" and chunk.model == MODEL and chunk.id.startswith("chatcmpl-")
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert roles == ["assistant"]
    return pieces, finish, usage


# ---- basics ------------------------------------------------------------------------------------------------------
def test_models_tokenize_detokenize(station) -> None:
    st, _, http, client = station
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = http.post("/tokenize", json={"prompt": "Hello world"})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert r.json()["count"] == len(tokens) and r.json()["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "Hello world"}
    r = http.post("/tokenize", json={"messages": CAPITAL})
    assert r.json()["tokens"] == render_chat(st.model.tokenizer, CAPITAL)


def test_completion_stream_equals_non_stream(station) -> None:
    _, _, http, client = station
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.id.startswith("cmpl-") and full.model == MODEL
    (choice,) = full.choices
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == full.usage.prompt_tokens + 12

    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        assert chunk.object == "text_completion" and chunk.model == MODEL
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.text)
            finish = c.finish_reason or finish
    assert "".join(pieces) == choice.text and finish == "length"
    assert usage is not None and usage.model_dump() == full.usage.model_dump()

    # the raw wire format: data lines, blank-line separated, ending with [DONE]
    with http.stream("POST", "/v1/completions", json={**kw, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]) == choice.text


def test_chat_stream_equals_non_stream(station) -> None:
    _, _, _, client = station
    full = chat_text(client, CAPITAL, max_tokens=16, temperature=0)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-") and full.model == MODEL
    (choice,) = full.choices
    assert choice.message.role == "assistant" and choice.message.content
    pieces, finish, usage = stream_chat(client, CAPITAL, max_tokens=16, temperature=0,
                                        stream_options={"include_usage": True})
    assert "".join(pieces) == choice.message.content and finish == choice.finish_reason
    details = {"prompt_tokens_details"}
    assert usage.model_dump(exclude=details) == full.usage.model_dump(exclude=details)
    # the same prompt again reuses the first run's KV (prefix reuse): all of it but the chunk holding its last token
    assert usage.prompt_tokens_details.cached_tokens == (full.usage.prompt_tokens - 1) // 32 * 32 > 0

    # vLLM's continuous_usage_stats: every chunk carries the usage so far, the last one the full count
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CAPITAL, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in chunks)
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == full.usage.completion_tokens
    assert "".join(d.delta.content or "" for c in chunks for d in c.choices) == choice.message.content


def test_greedy_chat_equals_generate(station) -> None:
    st, _, http, client = station
    tok = st.model.tokenizer
    ids = render_chat(tok, CAPITAL)
    r = http.post("/generate", json={"tokens": ids, "max_new_tokens": 24})
    assert r.status_code == 200, r.text
    gen = r.json()
    full = chat_text(client, CAPITAL, max_completion_tokens=24, temperature=0)
    assert full.choices[0].message.content == tok.decode(gen["generated"], skip_special_tokens=True)
    assert full.choices[0].finish_reason == gen["finish_reason"]
    assert full.usage.prompt_tokens == len(ids) and full.usage.completion_tokens == len(gen["generated"])


# ---- sampling parameters -----------------------------------------------------------------------------------------
def test_n3_and_seeds(station) -> None:
    _, _, _, client = station
    kw = {"model": MODEL, "prompt": "My favourite colour is", "max_tokens": 8, "temperature": 1.0}
    r = client.completions.create(**kw, n=3, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 24  # the prompt counts once, the three choices all count
    # choice i runs with seed + i, so it equals a single request with that seed
    singles = [client.completions.create(**kw, seed=5 + i).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == singles
    assert len(set(singles)) > 1  # different seeds sample differently


def test_seeded_sampling_is_reproducible(station) -> None:
    _, _, _, client = station
    kw = {"max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    a = chat_text(client, CAPITAL, **kw).choices[0].message.content
    b = chat_text(client, CAPITAL, **kw).choices[0].message.content
    pieces, _, _ = stream_chat(client, CAPITAL, **kw)
    assert a == b == "".join(pieces)
    extra = client.chat.completions.create(model=MODEL, messages=CAPITAL, **kw, extra_body={"top_k": 40, "min_p": 0.0})
    assert extra.choices[0].message.content  # the vLLM extras are accepted


def test_stop_strings_across_token_boundaries(station) -> None:
    st, _, http, client = station
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
    full = client.completions.create(**kw, logprobs=0).choices[0]
    text, offsets = full.text, full.logprobs.text_offset
    # a stop string that straddles a token boundary, found first at that boundary
    boundary = next(o for o in offsets[2:] if text.find(text[o - 2:o + 2]) == o - 2 and text[o - 2:o + 2].strip())
    stop = text[boundary - 2:boundary + 2]
    cancelled_before = cancelled_total(http)
    r = client.completions.create(**kw, stop=[stop, "never appears"])
    assert r.choices[0].text == text[:boundary - 2] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16
    wait_for(lambda: st.scheduler.busy_lanes == 0, 10, "the stopped request kept its lane")
    assert cancelled_total(http) == cancelled_before  # retired as "stop" by the scheduler, not cancelled
    ok_before = metric(http.get("/metrics").text, "jaxstation_requests_total", {"outcome": "ok"})
    pieces = [c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True) if c.choices]
    assert "".join(pieces) == text[:boundary - 2]
    # a streamed request that ends on a stop string is retired as "stop" too, never counted as cancelled
    wait_for(lambda: metric(http.get("/metrics").text, "jaxstation_requests_total", {"outcome": "ok"}) == ok_before + 1,
             10, "the streamed stop-string request was not counted as ok")
    assert cancelled_total(http) == cancelled_before


def test_prompt_lists_and_n(station) -> None:
    st, _, _, client = station
    kw = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    r = client.completions.create(**kw, prompt=["Hello, my name is", "The sky is"], n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt p, choice j -> index p * n + j
    alone = [client.completions.create(**kw, prompt=p).choices[0].text for p in ("Hello, my name is", "The sky is")]
    assert [c.text for c in r.choices] == [alone[0], alone[0], alone[1], alone[1]]
    ids = st.model.tokenizer.encode("The sky is")
    assert client.completions.create(**kw, prompt=ids).choices[0].text == alone[1]
    assert r.usage.prompt_tokens == len(st.model.tokenizer.encode("Hello, my name is")) + len(ids)


def test_stop_token_ids(station) -> None:
    st, _, http, client = station
    tok = st.model.tokenizer
    ids = tok.encode("The capital of France is")
    gen = http.post("/generate", json={"tokens": ids, "max_new_tokens": 10}).json()["generated"]
    stop_id = gen[3]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == tok.decode(gen[:gen.index(stop_id)])


def test_logprobs(station) -> None:
    _, _, _, client = station
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and chosen <= 0 and max(top.values()) == pytest.approx(chosen)  # greedy: the top one

    c = chat_text(client, CAPITAL, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2).choices[0]
    content = c.logprobs.content
    assert len(content) == 6
    assert b"".join(bytes(e.bytes) for e in content).decode() == c.message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=6, temperature=0,
                                                stream=True, logprobs=True, top_logprobs=2):
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                streamed += [(e.token, e.logprob) for e in ch.logprobs.content]
    assert streamed == [(e.token, e.logprob) for e in content]


def test_utf8_stream_pieces_equal_the_text(station) -> None:
    st, _, http, client = station
    tok = st.model.tokenizer
    # the serial run: this prompt makes the model write CJK characters, split over byte-level tokens
    gen = http.post("/generate", json={"tokens": render_chat(tok, CHINESE), "max_new_tokens": 20}).json()
    serial = tok.decode(gen["generated"], skip_special_tokens=True)
    assert any(ord(ch) > 127 for ch in serial)
    full = chat_text(client, CHINESE, max_tokens=20, temperature=0).choices[0].message.content
    assert full == serial
    pieces, _, _ = stream_chat(client, CHINESE, max_tokens=20, temperature=0)
    assert "".join(pieces) == full
    assert all("\ufffd" not in p for p in pieces)


# ---- penalties, logit_bias and vLLM's length controls -------------------------------------------------------------
def test_penalties_and_bias_equal_generate_on_every_route(station) -> None:
    st, _, http, client = station
    tok = st.model.tokenizer
    ids = tok.encode("The capital of France is")
    openai_fields = {"presence_penalty": 1.2, "frequency_penalty": 0.6, "logit_bias": {"260": 3, "7042": -100}}
    vllm_fields = {"repetition_penalty": 1.3}
    plain = http.post("/generate", json={"tokens": ids, "max_new_tokens": 12}).json()["generated"]
    r = http.post("/generate", json={"tokens": ids, "max_new_tokens": 12, **openai_fields, **vllm_fields})
    assert r.status_code == 200, r.text
    gen = r.json()["generated"]
    assert 7042 in plain and 7042 not in gen and gen != plain
    kw = {"model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 0, **openai_fields, "extra_body": vllm_fields}
    full = client.completions.create(**kw).choices[0].text
    assert full == tok.decode(gen)
    assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices) == full
    # a bias of 100 wins every step; the logprobs reported are the model's, before the bias
    chat = chat_text(client, CAPITAL, max_tokens=3, temperature=0, logit_bias={"9805": 100}, logprobs=True)
    assert chat.choices[0].message.content == " yes yes yes"
    assert all(e.logprob < -1 for e in chat.choices[0].logprobs.content)


def test_ignore_eos_and_min_tokens(station) -> None:
    _, _, _, client = station
    plain = chat_text(client, CAPITAL, max_tokens=40, temperature=0)
    n, text = plain.usage.completion_tokens, plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "stop" and n < 34
    ignored = chat_text(client, CAPITAL, max_tokens=n + 6, temperature=0, extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == n + 6
    assert ignored.choices[0].message.content.startswith(text)
    held = chat_text(client, CAPITAL, max_tokens=n + 6, temperature=0, extra_body={"min_tokens": n + 3})
    assert (n, held.usage.completion_tokens, held.choices[0].finish_reason) == (7, 13, "length")
    assert held.choices[0].message.content == text + " It's a city steeped in"
    # a stop string does not end a choice before min_tokens either
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0, "stop": [" Paris"]}
    assert client.completions.create(**kw).choices[0].text == ""
    r = client.completions.create(**kw, extra_body={"min_tokens": 5})
    assert (r.choices[0].text, r.usage.completion_tokens) == (" Paris.\n\nThe answer is: 2", 10)  # armed past " Paris"


def test_vllm_text_and_prompt_extras(station) -> None:
    """include_stop_str_in_output, skip_special_tokens, truncate_prompt_tokens, add_special_tokens,
    add_generation_prompt and allowed_token_ids, sent as the official client sends vLLM's fields."""
    st, _, http, client = station
    tok = st.model.tokenizer
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stop": ["."]}
    assert client.completions.create(**kw).choices[0].text == " Paris"
    kept = client.completions.create(**kw, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == " Paris." and kept.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(**kw, stream=True,
                                                                   extra_body={"include_stop_str_in_output": True})
              if c.choices]
    assert "".join(pieces) == " Paris."

    answer = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    shown = chat_text(client, CAPITAL, **answer).choices[0].message.content
    raw = chat_text(client, CAPITAL, **{**answer, "extra_body": {"ignore_eos": True, "skip_special_tokens": False}})
    raw_text = raw.choices[0].message.content
    assert "<|im_end|>" in raw_text and "<|im_end|>" not in shown
    assert raw_text.replace("<|im_end|>", "").replace("<|im_start|>", "") == shown

    target = tok.encode("The capital of France is")
    noise = tok.encode("Bananas are yellow and grow in bunches. ")
    plain = client.completions.create(model=MODEL, prompt=target, max_tokens=6, temperature=0)
    cut = client.completions.create(model=MODEL, prompt=noise + target, max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": len(target)})
    assert cut.usage.prompt_tokens == len(target) and cut.choices[0].text == plain.choices[0].text

    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, extra_body={"add_special_tokens": False})
    assert r.usage.prompt_tokens == len(tok.encode("Hello", add_special_tokens=False))
    r = chat_text(client, CAPITAL, max_tokens=1, extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(render_chat(tok, CAPITAL, add_generation_prompt=False)) \
        < len(render_chat(tok, CAPITAL))

    allowed = [13, 30, 260, 1780]
    gen = http.post("/generate", json={"tokens": target, "max_new_tokens": 6, "allowed_token_ids": allowed}).json()
    assert set(gen["generated"]) <= set(allowed) and len(gen["generated"]) == 6
    r = client.completions.create(model=MODEL, prompt=target, max_tokens=6, temperature=0,
                                  extra_body={"allowed_token_ids": allowed})
    assert r.choices[0].text == tok.decode(gen["generated"])


def test_chat_template_kwargs_reach_the_template(default_model: LoadedModel) -> None:
    tok = copy.copy(default_model.tokenizer)
    tok.chat_template = "{{ greeting }}: {{ messages[0]['content'] }}{% if add_generation_prompt %}!{% endif %}"
    run = parse_chat({"messages": CAPITAL, "chat_template_kwargs": {"greeting": "Hello"}}, tok, 49152, 512,
                     frozenset({2}), True)
    assert run.prompts == [tok.encode("Hello: What is the capital of France?!", add_special_tokens=False)]


def test_a_refused_field_says_why(station) -> None:
    _, _, http, _ = station
    for field, value, why in (("functions", [{"name": "f"}], "send tools and tool_choice"),
                              ("guided_json", {"type": "object"}, "send structured_outputs"),
                              ("use_beam_search", True, "beam search is not served")):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CAPITAL, field: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == "unsupported_parameter" and why in err["message"], err


# ---- concurrency and disconnects ---------------------------------------------------------------------------------
def test_eight_concurrent_streams(station) -> None:
    _, _, _, client = station
    prompts = [[{"role": "user", "content": f"Count to {i + 2}."}] for i in range(8)]
    expected = [chat_text(client, p, max_tokens=10, temperature=0).choices[0].message.content for p in prompts]
    got: list[str | None] = [None] * 8
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            pieces, finish, _ = stream_chat(client, prompts[i], max_tokens=10, temperature=0)
            assert finish in ("stop", "length")
            got[i] = "".join(pieces)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got == expected


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_the_lane(station, stream: bool) -> None:
    st, server, http, _ = station
    wait_for(lambda: st.scheduler.busy_lanes == 0, 10, "an earlier test left a lane busy")
    before = cancelled_total(http)
    body = json.dumps({"model": MODEL, "messages": CAPITAL, "max_tokens": 400, "temperature": 0, "stream": stream,
                       "stop": "never appears"})
    sock = raw_post(server.address, "/v1/chat/completions", body.encode())
    wait_for(lambda: st.scheduler.busy_lanes == 1, 10, "the request did not take a lane")
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # the stream has started
    sock.close()
    wait_for(lambda: st.scheduler.busy_lanes == 0, 10, "the lane was not freed")
    wait_for(lambda: cancelled_total(http) == before + 1, 5, "the job was not counted as cancelled")


# ---- auth and errors ---------------------------------------------------------------------------------------------
def test_auth_off_needs_no_key(station) -> None:
    _, _, http, _ = station
    assert http.get("/v1/models").status_code == 200
    assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 200


def test_auth_on(default_model: LoadedModel) -> None:
    st = make_station(default_model, api_key="s3cret")
    with ServerThread(create_app(st)) as server, server.client() as http:
        assert http.get("/health").status_code == 200
        wait_ready(http)  # /ready needs no key either
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
            r = http.request(method, path, json={})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"]
        for method, path in (("POST", "/generate"), ("GET", "/metrics"), ("GET", "/openapi.json")):
            r = http.request(method, path, json={})  # the station's own routes answer in the station's shape
            assert r.status_code == 401, (path, r.text)
            assert r.json() == {"error": {"message": "a valid API key is required: send 'Authorization: Bearer "
                                                     "<MOONSHINE_API_KEY>'", "field": "authorization"}}
        with pytest.raises(openai.AuthenticationError):
            openai_client(server, "wrong").models.list()
        client = openai_client(server, "s3cret")
        assert [m.id for m in client.models.list().data] == [MODEL]
        r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
        headers = {"Authorization": "Bearer s3cret"}
        assert http.post("/generate", json={"tokens": [1, 2], "max_new_tokens": 1}, headers=headers).status_code == 200


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "echo": True, "stream": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": "0.5"}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"49152": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias.5"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 17}, "min_tokens"),  # the default max_tokens is 16
    ("/v1/completions", {"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "n": 9}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/chat/completions", {"messages": CAPITAL, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/v1/chat/completions", {"messages": CAPITAL, "frequency_penalty": -2.01}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": CAPITAL, "repetition_penalty": "1.1"}, "repetition_penalty"),
    ("/v1/chat/completions", {"messages": CAPITAL, "logit_bias": {"x": 1}}, "logit_bias.x.[key]"),
    ("/v1/chat/completions", {"messages": CAPITAL, "logit_bias": []}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CAPITAL, "min_tokens": -1}, "min_tokens"),
    ("/v1/chat/completions", {"messages": CAPITAL, "max_completion_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ("/v1/chat/completions", {"messages": CAPITAL, "ignore_eos": 1}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": CAPITAL, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CAPITAL, "temperature": 3}, "temperature"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [49152]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ("/v1/chat/completions", {"messages": CAPITAL, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CAPITAL, "chat_template_kwargs": {"messages": []}}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": CAPITAL, "stop": ["a", 1]}, "stop[1]"),
])
def test_unsupported_or_invalid_field_is_400(station, route: str, body: dict, param: str) -> None:
    _, _, http, _ = station
    r = http.post(route, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"


def test_a_chat_prompt_too_long_for_the_context_without_max_tokens(station) -> None:
    """The user sent no max_tokens: the error speaks of the prompt and the context, not of a negative max_tokens."""
    _, _, http, _ = station
    long = [{"role": "user", "content": "word " * 600}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": long})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "max_tokens" not in err["message"], err
    assert err["message"].startswith("the prompt (") and "leaves no room to generate in the station's context of " \
        "512 tokens" in err["message"], err


def test_openai_client_sees_400_and_neutral_penalties_pass(station) -> None:
    _, _, _, client = station
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"99999": 1})
    assert "logit_bias" in str(e.value) and "99999" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"repetition_penalty": -1})
    assert "repetition_penalty" in str(e.value)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2, presence_penalty=0, frequency_penalty=0,
                                  user="someone", temperature=0)
    assert (r.choices[0].text, r.usage.completion_tokens) == ("-1", 2)  # greedy, as without the neutral fields


def test_queue_full_is_503_with_retry_after(default_model: LoadedModel) -> None:
    st = make_station(default_model, continuous=False, max_queue=1)
    with ServerThread(create_app(st)) as server, server.client() as http:
        wait_ready(http)
        with queue_held_full(st, server):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
            assert "queue is full" in r.json()["error"]["message"]
            with pytest.raises(openai.InternalServerError):
                openai_client(server).chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=2)
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text



def test_a_request_larger_than_the_queue_is_400_naming_max_queue(default_model: LoadedModel) -> None:
    """Jobs (prompts x n) past max_queue could never be queued: a 400, not a 503 to retry; the prompt list's bound
    is in /openapi.json."""
    st = make_station(default_model, max_queue=8)
    with ServerThread(create_app(st)) as server, server.client() as http:
        wait_ready(http)
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": ["Hi"] * 9, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "max_queue" in r.json()["error"]["message"] and "9" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": ["Hi"] * 5, "n": 2, "max_tokens": 2})
        assert r.status_code == 400 and "10" in r.json()["error"]["message"], r.text
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": ["Hi"] * 8, "max_tokens": 2}
                         ).status_code == 200
        prompt = http.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
        lists = {branch["items"].get("type"): branch.get("maxItems") for branch in prompt["anyOf"]
                 if branch.get("type") == "array"}
        assert lists["string"] == lists["array"] == MAX_PROMPTS  # a list of texts, a list of token-id lists
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": ["Hi"] * (MAX_PROMPTS + 1), "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


COPY = ("Repeat this list twice, exactly: red, orange, yellow, green, blue, indigo, violet. "
        "red, orange, yellow, green, blue, indigo, violet.")


def test_speculation_changes_no_token_text_or_logprob(station) -> None:
    """The station speculates (prompt lookup): a request that opts out gets the same tokens, text and logprobs, and
    so does the stream, whose chunks may carry several tokens."""
    _, _, http, client = station
    drafted = metric(http.get("/metrics").text, "jaxstation_spec_decode_num_draft_tokens_total")
    kw = {"model": MODEL, "messages": [{"role": "user", "content": COPY}], "max_tokens": 48, "temperature": 0,
          "logprobs": True, "top_logprobs": 2}
    spec = client.chat.completions.create(**kw)
    plain = client.chat.completions.create(**kw, extra_body={"speculative": False})
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.choices[0].logprobs == plain.choices[0].logprobs
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    assert metric(http.get("/metrics").text, "jaxstation_spec_decode_num_draft_tokens_total") > drafted
    pieces, finish, _ = stream_chat(client, kw["messages"], max_tokens=48, temperature=0)
    assert "".join(pieces) == spec.choices[0].message.content and finish == spec.choices[0].finish_reason
