"""Prefix reuse through the real HTTP server: `resume`, `timing.cached_tokens`, OpenAI's
`usage.prompt_tokens_details.cached_tokens` (also from the host-memory tier, with Anthropic's
`cache_read_input_tokens`), the /metrics counters, POST /reset_prefix_cache and the MOONSHINE_PREFIX_REUSE setting.

Two continuous stations share the default model and the usual shape (4 lanes, 512 positions, chunk 32): one with
`prefix_reuse="resume"` (only /generate with `resume: true` reuses, so `resume: false` is a fresh run on the same
station) and one with the default `auto` (every request reuses). The OpenAI routes never reuse on the first, so it
serves their fresh reference.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
from server_util import ServerThread, metric, wait_for

from jaxstation.app import create_app
from jaxstation.config.settings import ConfigError, StationConfig, resolve
from jaxstation.model.loader import LoadedModel
from jaxstation.server.station import Station

SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}
MODEL = "SmolLM2-135M-Instruct.Q4_1"
SYSTEM = ("You are a patient librarian in a small seaside town. You answer questions about books, authors and the "
          "history of the town in two short sentences, plainly, without lists, and you never make up a title or a "
          "date you are not sure of. If a question is not about books or the town, you say so politely.")
COUNTERS = ("lookups", "hits", "reused_tokens", "prefill_saved_tokens")


def station_server(model: LoadedModel, prefix_reuse: str):
    station = Station(StationConfig(**SHAPE, continuous=True, drain_s=5, prefix_reuse=prefix_reuse), model=model)
    server = ServerThread(create_app(station))
    return station, server


@pytest.fixture(scope="module")
def stations(default_model: LoadedModel):
    """{"resume": (server, http client, openai client), "auto": ...}."""
    out = {}
    servers = [station_server(default_model, mode) for mode in ("resume", "auto")]
    with servers[0][1] as s0, servers[1][1] as s1, s0.client() as h0, s1.client() as h1:
        for mode, server, http in (("resume", s0, h0), ("auto", s1, h1)):
            wait_for(lambda http=http: http.get("/ready").status_code == 200, 120, "station not ready", 0.1)
            out[mode] = (server, http, openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                                                     max_retries=0, timeout=60))
        yield out


def counters(http) -> dict[str, float]:
    text = http.get("/metrics").text
    return {c: metric(text, f"jaxstation_prefix_cache_{c}_total") for c in COUNTERS}


def generate(http, tokens: list[int], **kw) -> dict:
    r = http.post("/generate", json={"tokens": tokens, "max_new_tokens": 8, **kw})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 99}], ids=["greedy", "seeded"])
def test_generate_resume_multi_turn_equals_fresh(stations, sampling):
    _, http, _ = stations["resume"]
    rng = np.random.default_rng(len(sampling))
    turn1 = rng.integers(3, 49152, size=75).tolist()
    before = counters(http)
    r1 = generate(http, turn1, resume=True, **sampling)
    assert r1["timing"]["cached_tokens"] == 0
    turn2 = turn1 + r1["generated"] + rng.integers(3, 49152, size=9).tolist()
    resumed = generate(http, turn2, resume=True, **sampling)
    assert resumed["timing"]["cached_tokens"] == 64  # turn 1's 75 prefill-written tokens, down to a chunk
    fresh = generate(http, turn2, resume=False, **sampling)  # this station reuses only for resume: true
    assert fresh["timing"]["cached_tokens"] == 0
    assert resumed["generated"] == fresh["generated"]
    after = counters(http)
    assert {c: after[c] - before[c] for c in COUNTERS} == {"lookups": 2, "hits": 1, "reused_tokens": 75,
                                                           "prefill_saved_tokens": 64}


def test_auto_reuses_for_every_generate(stations):
    _, http, _ = stations["auto"]
    prefix = np.random.default_rng(7).integers(3, 49152, size=70).tolist()
    before = counters(http)
    generate(http, prefix + [11, 12])
    second = generate(http, prefix + [13])
    assert second["timing"]["cached_tokens"] == 64
    after = counters(http)
    assert (after["lookups"] - before["lookups"], after["hits"] - before["hits"]) == (2, 1)


def test_reset_prefix_cache_makes_the_next_request_prefill_in_full(stations):
    _, http, _ = stations["auto"]
    prefix = np.random.default_rng(11).integers(3, 49152, size=70).tolist()
    assert http.post("/reset_prefix_cache").status_code == 200  # whatever earlier tests left
    first = generate(http, prefix + [21])
    assert generate(http, prefix + [21])["timing"]["cached_tokens"] == 64
    r = http.post("/reset_prefix_cache")
    assert (r.status_code, r.json()) == (200, {"cleared": 1})  # the one lane both requests ran in
    again = generate(http, prefix + [21])
    assert again["timing"]["cached_tokens"] == 0
    assert again["generated"] == first["generated"]
    assert http.post("/reset_prefix_cache").json() == {"cleared": 1}  # the lane the last request freed


def test_openai_chat_reports_cached_tokens_and_matches_a_fresh_run(stations):
    *_, auto = stations["auto"]
    *_, fresh_client = stations["resume"]  # OpenAI routes never reuse on a resume-mode station
    kw = {"model": MODEL, "max_tokens": 12, "temperature": 0.7, "seed": 3}

    def chat(client: openai.OpenAI, question: str, **extra):
        return client.chat.completions.create(messages=[{"role": "system", "content": SYSTEM},
                                                        {"role": "user", "content": question}], **kw, **extra)

    first = chat(auto, "Who wrote Moby-Dick?")
    assert first.usage.prompt_tokens > 64
    hit = chat(auto, "When was the town library built?")
    cached = hit.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 32 == 0 and cached < hit.usage.prompt_tokens
    fresh = chat(fresh_client, "When was the town library built?")
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.choices[0].message.content == fresh.choices[0].message.content
    # streamed, with usage: the final chunk reports it too (the same prompt again: all but its last chunk cached)
    usage = [c.usage for c in chat(auto, "When was the town library built?", stream=True,
                                   stream_options={"include_usage": True}) if c.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == (hit.usage.prompt_tokens - 1) // 32 * 32


def test_usage_counts_reuse_from_host_memory(stations):
    """A conversation whose lane every later prompt took resumes from the host tier: OpenAI's and Anthropic's usage
    report it as cached, and /metrics under tier="memory"."""
    _, http, client = stations["auto"]
    rng = np.random.default_rng(17)

    def push_out() -> None:  # a fresh prompt into every lane, the least recently used first
        for _ in range(SHAPE["lanes"]):
            generate(http, rng.integers(3, 49152, size=40).tolist(), max_new_tokens=1)

    def memory_saved() -> float:
        return metric(http.get("/metrics").text, "jaxstation_prefix_cache_tier_saved_tokens_total", {"tier": "memory"})

    system = SYSTEM + " Today is a quiet Tuesday."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Who wrote Emma?"}]
    client.chat.completions.create(model=MODEL, max_tokens=2, messages=messages)
    push_out()
    before = memory_saved()
    hit = client.chat.completions.create(model=MODEL, max_tokens=2, messages=messages)
    cached = hit.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and memory_saved() - before == cached
    push_out()
    before = memory_saved()
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "system": system,
                                        "messages": [{"role": "user", "content": "Who wrote Emma?"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["cache_read_input_tokens"] == memory_saved() - before > 0


def test_prefix_reuse_setting():
    assert resolve(env={"MOONSHINE_PREFIX_REUSE": "resume"}).prefix_reuse == "resume"
    assert resolve(env={}).prefix_reuse == "auto"
    with pytest.raises(ConfigError, match="MOONSHINE_PREFIX_REUSE='always' must be one of auto, resume, off"):
        resolve(env={"MOONSHINE_PREFIX_REUSE": "always"})
    table = {mode: (StationConfig(prefix_reuse=mode).reuse_prefix(False), StationConfig(prefix_reuse=mode)
                    .reuse_prefix(True)) for mode in ("auto", "resume", "off")}
    assert table == {"auto": (True, True), "resume": (False, True), "off": (False, False)}
