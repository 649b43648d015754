"""The mesh on the default model: a 3-station mesh as real processes on loopback ports, split unevenly (a 2-station
mesh of another family is in test_families.py).

Every station, the host and the single station they are checked against run the default settings (the default
model's integer products on CPU) at the suite's shape: the single station packs prompts and runs narrow waves, the
mesh prefills one chunk at a time in full waves. Parity: the parity-gate style workload (more jobs than lanes, greedy
and seeded sampling, lanes=4) gives, through the unchanged Scheduler on a MeshEngine (continuous with and without
pipelining, and serialize-all) and through the host's HTTP routes, exactly the tokens and log-probabilities of the
single station's scheduler. Recovery: SIGKILL the middle station
mid-generation and restart it on its port: every request completes with the uninterrupted tokens; kill it for good:
the requests in flight get a 502 naming it, the host stays up, /health names it, and after a restart new requests
succeed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from conftest import tiny_model
from mesh_util import SHAPE, TOKEN, StationProcess, start_mesh
from server_util import ServerThread, metric, wait_for

from jaxstation import cli
from jaxstation.config.plan import planned_engine, resolve_plan
from jaxstation.config.settings import ConfigError, StationConfig
from jaxstation.engine.engine import Engine, generate
from jaxstation.engine.jobs import Job
from jaxstation.engine.rows import Sample, SamplingParams
from jaxstation.engine.scheduler import Scheduler
from jaxstation.group.payload import CONTENT_TYPE, DTYPES, decode, encode
from jaxstation.mesh.client import MeshError
from jaxstation.mesh.host import create_host_app
from jaxstation.mesh.host_engine import MeshEngine
from jaxstation.mesh.stage import fingerprint
from jaxstation.mesh.station import MeshStation, create_station_app

SPLIT3 = ["0:7", "7:19", "19:30"]


@dataclasses.dataclass(frozen=True)
class Spec:
    prompt: tuple[int, ...]
    max_new: int
    sampling: SamplingParams

    def body(self) -> dict:
        s = self.sampling
        return {"tokens": list(self.prompt), "max_new_tokens": self.max_new, "temperature": s.temperature,
                "seed": s.seed, "top_k": s.top_k, "top_p": s.top_p}


@pytest.fixture(scope="module")
def stations():
    """The mesh's three station processes."""
    procs = start_mesh(SPLIT3)
    yield {"3": procs}
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def local(default_model) -> Engine:
    """A single station's engine with default settings at the mesh's shape: on CPU the default model's integer
    products (dtype gguf), prompts in packed steps, narrow decode waves. The mesh runs none of its programs but the
    decode attention kernel and the CPU kernels' rows."""
    config = StationConfig(**SHAPE)
    plan = resolve_plan(config, default_model.cfg)
    assert (plan.dtype, plan.attention, plan.prefill_budget, plan.wave_widths) == ("gguf", "kernel", 128, (1, 2, 4))
    return planned_engine(default_model, config, plan)


@pytest.fixture(scope="module")
def workload(default_model, local):
    """10 jobs for 4 lanes: prompts of 1..150 tokens (several prefill chunks), greedy and seeded sampling with
    filters; each job's reference samples (tokens and log-probabilities) come from the single station's scheduler
    running all of them at once."""
    rng = np.random.default_rng(7)
    vocab = default_model.cfg.vocab_size
    tok = default_model.tokenizer
    story = tuple(tok.encode("The old lighthouse keeper climbed the spiral stairs every evening to light the lamp. "
                             * 6))
    specs = [
        Spec(tuple(tok.encode("The capital of France is")), 12, SamplingParams()),
        Spec(tuple(int(t) for t in rng.integers(0, vocab, 1)), 10, SamplingParams()),
        Spec(story[:70], 8, SamplingParams(temperature=0.8, seed=1)),
        Spec(tuple(int(t) for t in rng.integers(0, vocab, 33)), 12, SamplingParams(temperature=1.0, top_k=40, seed=2)),
        Spec(story[:120], 6, SamplingParams()),
        Spec(tuple(int(t) for t in rng.integers(0, vocab, 5)), 12, SamplingParams(temperature=0.7, top_p=0.9, seed=3)),
        Spec(story[3:35], 1, SamplingParams()),
        Spec(tuple(int(t) for t in rng.integers(0, vocab, 150)), 5, SamplingParams(temperature=1.2, seed=4)),
        Spec(story[10:40], 12, SamplingParams(temperature=0.9, top_k=5, top_p=0.8, seed=5)),
        Spec(tuple(int(t) for t in rng.integers(0, vocab, 64)), 9, SamplingParams()),
    ]
    eos = frozenset(tok.eos_ids)  # /generate stops on them, so the Scheduler runs here do too
    reference = run_jobs(local, specs, eos, continuous=True)
    return specs, reference


def tokens(samples: list[Sample]) -> list[int]:
    return [s.token for s in samples]


def host_config(procs: list[StationProcess], **kw) -> StationConfig:
    return StationConfig(**{"stations": ",".join(p.url for p in procs), "mesh_token": TOKEN, "continuous": True,
                            **SHAPE, **kw})


_FINGERPRINTS: dict[int, str] = {}


def model_fp(model) -> str:
    """The model's fingerprint, hashed once per model object (it reads every weight)."""
    if id(model) not in _FINGERPRINTS:
        _FINGERPRINTS[id(model)] = fingerprint(model)
    return _FINGERPRINTS[id(model)]


def connect(procs: list[StationProcess], model, **kw) -> MeshEngine:
    return host_connect(host_config(procs, **kw), model.cfg, model_fp(model))


def host_connect(config: StationConfig, cfg, model_fp: str) -> MeshEngine:
    """MeshEngine.connect as a host of `config` on a model of `cfg` runs it, with its plan."""
    return MeshEngine.connect(config, resolve_plan(config, cfg), cfg, model_fp)


@contextlib.contextmanager
def running_host(procs: list[StationProcess], model, **kw) -> Iterator[tuple[ServerThread, httpx.Client]]:
    """A mesh host over `procs` on a loopback port, ready."""
    app, station = create_host_app(host_config(procs, **kw), model=model)
    with ServerThread(app) as server, server.client(timeout=300) as client:
        wait_for(station.ready.is_set, 120, "the host did not get ready")
        yield server, client


def run_jobs(engine, specs: list[Spec], eos: frozenset[int], continuous: bool) -> list[list[Sample]]:
    """Each job's samples: its tokens with their log-probabilities and top alternatives."""
    sched = Scheduler(engine, continuous=continuous, max_queue=64, terminal_ids=frozenset())
    futures = [sched.submit(Job(tokens=list(s.prompt), max_new_tokens=s.max_new, sampling=s.sampling, stop_ids=eos))
               for s in specs]  # all queued before the decode thread starts: more jobs than lanes
    sched.start()
    try:
        return [f.result(timeout=300).samples for f in futures]
    finally:
        assert sched.drain(10)


@pytest.mark.parametrize(("pipeline", "continuous"), [(False, True), (True, True), (False, False)])
def test_the_mesh_gives_the_single_station_tokens(stations, default_model, workload, pipeline, continuous):
    specs, reference = workload
    engine = connect(stations["3"], default_model, mesh_pipeline=pipeline)
    try:
        assert engine.group_size == (2 if pipeline else 4)
        assert run_jobs(engine, specs, frozenset(default_model.tokenizer.eos_ids), continuous) == reference
        hops = [h for c in engine.clients for h in c.hops]
        assert {h.path for h in hops} == {"/forward", "/lm_head"}
        assert {h.station for h in hops} == {0, 1, 2}
    finally:
        engine.close()


def test_three_station_host_serves_the_single_station_tokens(stations, default_model, workload):
    specs, reference = workload
    with running_host(stations["3"], default_model) as (_, client):
        with ThreadPoolExecutor(len(specs)) as pool:  # all at once: more requests than lanes
            replies = list(pool.map(lambda s: client.post("/generate", json=s.body()), specs))
        for i, (r, ref) in enumerate(zip(replies, reference, strict=True)):
            assert r.status_code == 200, r.text
            assert r.json()["generated"] == tokens(ref), f"job {i}"
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["down"] == []
        assert [s["layers"] for s in health["stations"]] == SPLIT3
        # the OpenAI routes run unchanged on the mesh
        r = client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 12,
                                                 "temperature": 0, "logprobs": 1})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == default_model.tokenizer.decode(tokens(reference[0]))
        assert choice["logprobs"]["token_logprobs"] == [s.logprob for s in reference[0]]


def _long_specs(default_model) -> list[Spec]:
    tok = default_model.tokenizer
    prompts = ["Explain how a steam engine works.", "The history of the Roman Empire began when",
               "In the early morning the fishermen of the village", "A recipe for bread: first, take",
               "The train left the station at dawn and"]  # none meets EOS within 40 tokens
    return [Spec(tuple(tok.encode(p)), 40, SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=10 + i))
            for i, p in enumerate(prompts)]


def _generated(server: ServerThread) -> float:
    return metric(httpx.get(f"http://127.0.0.1:{server.port}/metrics").text, "jaxstation_generated_tokens_total")


def test_sigkill_and_restart_of_the_middle_station_loses_no_token(stations, default_model, local):
    specs = _long_specs(default_model)
    eos = frozenset(default_model.tokenizer.eos_ids)
    reference = [generate(local, s.prompt, s.max_new, s.sampling, eos) for s in specs]
    assert [len(r) for r in reference] == [40] * 5
    middle = stations["3"][1]
    with running_host(stations["3"], default_model, mesh_recover_s=120) as (server, client):
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(client.post, "/generate", json=s.body()) for s in specs]
            wait_for(lambda: _generated(server) >= 12, 120, "generation did not start", interval=0.05)
            epoch = httpx.get(middle.url + "/health").json()["epoch"]
            middle.kill()
            in_flight = sum(not f.done() for f in futures)
            middle.start().wait_ready()
            assert httpx.get(middle.url + "/health").json()["epoch"] != epoch
            replies = [f.result() for f in futures]
    assert in_flight == 5  # the kill caught every request mid-generation
    for i, (r, ref) in enumerate(zip(replies, reference, strict=True)):
        assert r.status_code == 200, r.text
        assert r.json()["generated"] == ref, f"job {i}"


def test_a_station_that_stays_down_fails_in_flight_requests_with_502_and_the_host_recovers(
        stations, default_model, local):
    specs = _long_specs(default_model)[:2]
    middle = stations["3"][1]
    with running_host(stations["3"], default_model, mesh_recover_s=2) as (server, client):
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(client.post, "/generate", json=s.body()) for s in specs]
            wait_for(lambda: _generated(server) >= 4, 120, "generation did not start", interval=0.05)
            middle.kill()
            replies = [f.result() for f in futures]
        for r in replies:
            assert r.status_code == 502, r.text
            message = r.json()["error"]["message"]
            assert middle.url in message and "7:19" in message and "did not come back within 2 s" in message
        health = client.get("/health")
        assert health.status_code == 200
        assert health.json()["status"] == "degraded" and health.json()["down"] == [middle.url]
        # the host is up: a request while the station is down fails the same way, quickly
        t0 = time.monotonic()
        r = client.post("/generate", json=specs[0].body())
        assert r.status_code == 502 and middle.url in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 30
        middle.start().wait_ready()
        r = client.post("/generate", json=specs[0].body())
        assert r.status_code == 200, r.text
        eos = frozenset(default_model.tokenizer.eos_ids)
        assert r.json()["generated"] == generate(local, specs[0].prompt, specs[0].max_new, specs[0].sampling, eos)
        assert client.get("/health").json()["status"] == "ok"


def test_stations_report_their_epoch_and_geometry(stations):
    first = stations["3"][0]
    h = httpx.get(first.url + "/health").json()
    assert h["status"] == "ok" and h["layers"] == "0:7" and len(h["epoch"]) == 16
    info = httpx.get(first.url + "/info", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert info["epoch"] == h["epoch"] and info["auth"] is True
    assert {k: info[k] for k in ("layers", "total_layers", "lanes", "max_seq", "chunk", "block", "dtype",
                                 "weights")} == {
        "layers": "0:7", "total_layers": 30, "lanes": 4, "max_seq": 512, "chunk": 32, "block": 128,
        "dtype": "float32", "weights": "gguf"}



# ---- refusals ----------------------------------------------------------------------------------------------------
def test_the_host_refuses_a_mesh_that_does_not_cover_every_layer_once(stations, default_model):
    s3 = stations["3"]
    cases = [
        ([s3[0], s3[2]], "layer gap: no station holds layers 7:19"),
        ([s3[0], s3[1]], "layer gap: no station holds layers 19:30"),
        ([s3[1], s3[2]], "layer gap: no station holds layers 0:7"),
        ([s3[0], s3[1], s3[1], s3[2]], f"layer overlap: station {s3[1].url} (layers 7:19) holds layers 7:19 again"),
        ([s3[0], s3[1], s3[2], s3[2]], f"layer overlap: station {s3[2].url} (layers 19:30) holds layers 19:30 again"),
    ]
    for procs, message in cases:
        with pytest.raises(MeshError) as e:
            connect(procs, default_model)
        assert message in str(e.value)


def test_the_host_refuses_stations_of_another_shape_model_or_dtype(stations, default_model):
    first = stations["3"][0]
    for kw, message in [({"lanes": 2}, "has lanes=4 but the host has lanes=2"),
                        ({"max_seq": 256}, "has max_seq=512 but the host has max_seq=256"),
                        ({"prefill_chunk": 64}, "has chunk=32 but the host has chunk=64"),
                        ({"dtype": "bfloat16"}, "has dtype='float32' but the host has dtype='bfloat16'"),
                        ({"dtype": "gguf-exact"}, "has weights='gguf' but the host has weights='gguf-exact'")]:
        with pytest.raises(MeshError, match=re.escape(f"station {first.url} (layers 0:7) {message}")):
            connect(stations["3"], default_model, **kw)
    tiny = tiny_model("tiny-llama3")
    with pytest.raises(MeshError, match=re.escape(f"station {first.url} (layers 0:7) serves a different model")):
        host_connect(host_config(stations["3"]), default_model.cfg, model_fp(tiny))


def test_the_host_refuses_a_wrong_or_missing_token(stations, default_model):
    first = stations["3"][0]
    for kw in ({"mesh_token": "not-the-token"}, {"mesh_token": None, "insecure_mesh": True}):
        with pytest.raises(MeshError, match=re.escape(f"station {first.url} refused /info: HTTP 401")):
            connect(stations["3"], default_model, **kw)
    with pytest.raises(ConfigError, match="MOONSHINE_MESH_TOKEN is not set.*--insecure-mesh"):
        connect(stations["3"], default_model, mesh_token=None)


def test_the_host_refuses_a_station_without_a_token_unless_insecure(default_model):
    tiny = tiny_model("tiny-llama3")
    shape = {**SHAPE, "max_seq": 256}  # within the tiny model's context
    station = MeshStation(StationConfig(layers="0:2", insecure_mesh=True, **shape), model=tiny)
    with ServerThread(create_station_app(station)) as server:
        wait_for(station.ready.is_set, 300, "the tiny station did not load")
        url = f"http://127.0.0.1:{server.port}"
        host = StationConfig(stations=url, mesh_token=TOKEN, **shape)
        with pytest.raises(MeshError, match="takes requests without a token.*--insecure-mesh"):
            host_connect(host, default_model.cfg, model_fp(default_model))
        with pytest.raises(MeshError, match="serves a different model"):  # insecure passes the token check only
            host_connect(dataclasses.replace(host, insecure_mesh=True), default_model.cfg, model_fp(default_model))


def test_the_cli_refuses_a_station_or_host_without_token_or_role(monkeypatch, capsys):
    monkeypatch.delenv("MOONSHINE_MESH_TOKEN", raising=False)
    assert cli.main(["station", "--layers", "0:7"]) == 2
    assert "MOONSHINE_MESH_TOKEN is not set" in capsys.readouterr().err
    assert cli.main(["host", "--stations", "http://127.0.0.1:9"]) == 2
    assert "MOONSHINE_MESH_TOKEN is not set" in capsys.readouterr().err
    monkeypatch.setenv("MOONSHINE_MESH_TOKEN", TOKEN)
    assert cli.main(["station"]) == 2
    assert "needs its layer range: --layers A:B" in capsys.readouterr().err
    assert cli.main(["station", "--layers", "7:3"]) == 2
    assert "--layers='7:3'" in capsys.readouterr().err  # named as typed
    assert cli.main(["host"]) == 2
    assert "needs its stations" in capsys.readouterr().err
    assert cli.main(["host", "--stations", "127.0.0.1:8000"]) == 2
    assert "--stations holds '127.0.0.1:8000', which is not an http(s):// URL" in capsys.readouterr().err


def _post(url: str, path: str, body: bytes, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Content-Type": CONTENT_TYPE, **({"Authorization": f"Bearer {token}"} if token else {})}
    return httpx.post(url + path, content=body, headers=headers, timeout=60)


def _decode_wave(first: bool, **override) -> tuple[dict, dict]:
    meta = {"wave": "decode", "n_blocks": 1}
    arrays = {"lanes": np.arange(4, dtype=np.int32), "positions": np.full((4, 1), 255, np.int32)}
    arrays["tokens" if first else "x"] = np.zeros((4, 1), np.int32) if first else np.zeros((4, 1, 576), np.float32)
    for k, v in override.items():
        (meta if k in ("wave", "n_blocks") else arrays)[k] = v
    return {k: v for k, v in meta.items() if v is not None}, {k: v for k, v in arrays.items() if v is not None}


def test_stations_refuse_bad_tokens_and_payloads_naming_the_field(stations):
    first, middle, last = stations["3"]
    ok_meta, ok_arrays = _decode_wave(False)
    r = _post(middle.url, "/forward", encode(ok_meta, ok_arrays))
    assert r.status_code == 200 and decode(r.content)[1]["x"].shape == (4, 1, 576)
    assert decode(r.content)[0]["epoch"] == r.headers["X-Mesh-Epoch"]
    for token in (None, "wrong", TOKEN + "x"):
        r = _post(middle.url, "/forward", encode(ok_meta, ok_arrays), token=token)
        assert r.status_code == 401 and r.json()["error"]["field"] == "authorization"
    assert httpx.get(middle.url + "/info").status_code == 401

    bf16 = np.zeros((4, 1, 576), DTYPES["bfloat16"])
    bad = [
        (middle, "/forward", _decode_wave(False, wave=None), "wave"),
        (middle, "/forward", _decode_wave(False, n_blocks=5), "n_blocks"),
        (middle, "/forward", _decode_wave(False, n_blocks=0), "n_blocks"),
        (middle, "/forward", _decode_wave(False, x=bf16), "x"),
        (middle, "/forward", _decode_wave(False, x=np.zeros((4, 1, 64), np.float32)), "x"),
        (middle, "/forward", _decode_wave(False, tokens=np.zeros((4, 1), np.int32)), "arrays"),
        (middle, "/forward", _decode_wave(False, lanes=np.array([1, 2, 3, 4], np.int32)), "lanes"),
        (middle, "/forward", _decode_wave(False, lanes=np.array([0, 2, 1, 3], np.int32)), "lanes"),
        (middle, "/forward", _decode_wave(False, lanes=np.arange(3, dtype=np.int32)), "lanes"),
        (middle, "/forward", _decode_wave(False, lanes=np.arange(4, dtype=np.uint32)), "lanes"),
        (middle, "/forward", _decode_wave(False, positions=np.full((4, 1), 512, np.int32)), "positions"),
        (middle, "/forward", _decode_wave(False, positions=np.full((4, 1), -1, np.int32)), "positions"),
        (middle, "/forward", _decode_wave(False, wave="prefill"), "lanes"),
        (first, "/forward", _decode_wave(True, tokens=np.full((4, 1), 49152, np.int32)), "tokens"),
        (first, "/forward", ({"wave": "prefill", "n_blocks": 1},
                             {"lanes": np.array([0], np.int32), "positions": np.arange(1, 33, dtype=np.int32)[None],
                              "tokens": np.zeros((1, 32), np.int32)}), "positions"),
        (middle, "/lm_head", ({"wave": "decode"}, {"x": np.zeros((4, 576), np.float32)}), "route"),
    ]
    samp = {"temperature": np.zeros(4, np.float32), "top_k": np.zeros(4, np.int32), "top_p": np.ones(4, np.float32),
            "min_p": np.zeros(4, np.float32), "seed": np.zeros(4, np.uint32), "counter": np.zeros(4, np.int32)}
    head_ok = {"x": np.zeros((4, 576), np.float32), **samp}
    r = _post(last.url, "/lm_head", encode({"wave": "decode"}, head_ok))
    assert r.status_code == 200 and decode(r.content)[1]["tokens"].shape == (4,)
    bad += [
        (last, "/lm_head", ({"wave": "decode"}, {**head_ok, "temperature": np.full(4, -1, np.float32)}), "temperature"),
        (last, "/lm_head", ({"wave": "decode"}, {**head_ok, "top_p": np.zeros(4, np.float32)}), "top_p"),
        (last, "/lm_head", ({"wave": "decode"}, {**head_ok, "seed": np.zeros(4, np.int32)}), "seed"),
        (last, "/lm_head", ({"wave": "prefill"}, head_ok), "x"),
        (last, "/lm_head", ({"wave": "decode", "logits": "yes"}, head_ok), "logits"),
        (middle, "/score", ({}, {"x": np.zeros((32, 576), np.float32), "targets": np.zeros(32, np.int32)}), "route"),
        (last, "/score", ({}, {"x": np.zeros((32, 576), np.float32), "targets": np.full(32, -1, np.int32)}),
         "targets"),
        (last, "/score", ({}, {"x": np.zeros((31, 576), np.float32), "targets": np.zeros(32, np.int32)}), "x"),
    ]
    for station, path, (meta, arrays), field in bad:
        r = _post(station.url, path, encode(meta, arrays))
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["field"] == field, r.text
        assert r.json()["epoch"] == r.headers["X-Mesh-Epoch"]

    body = encode(ok_meta, ok_arrays)
    for raw, field in [(body[:-10], "x"), (body + b"\0\0\0\0", "body"), (b"garbage", "header"),
                       (b'{"meta": {}, "arrays": [], "code": "print(1)"}\n', "header")]:
        r = _post(middle.url, "/forward", raw)
        assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text
    r = _post(middle.url, "/forward", b"\0" * (16 << 20))
    assert r.status_code == 413


def test_stations_answer_ready_metrics_and_json_404_405(stations):
    """/ready is open (a start-up probe), /metrics counts steps and needs the token, unknown routes answer JSON."""
    middle = stations["3"][1]
    ready = httpx.get(middle.url + "/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready" and ready.json()["layers"] == "7:19"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(middle.url + "/metrics").status_code == 401

    def forwards() -> tuple[float, float]:
        text = httpx.get(middle.url + "/metrics", headers=auth).text
        return (metric(text, "jaxstation_station_requests_total", {"route": "forward", "outcome": "ok"}),
                metric(text, "jaxstation_station_step_seconds_count", {"route": "forward"}))

    before = forwards()
    meta, arrays = _decode_wave(False)
    assert _post(middle.url, "/forward", encode(meta, arrays)).status_code == 200
    assert _post(middle.url, "/forward", encode({"wave": "decode"}, arrays)).status_code == 400
    assert forwards() == (before[0] + 1, before[1] + 1)
    text = httpx.get(middle.url + "/metrics", headers=auth).text
    assert metric(text, "jaxstation_station_requests_total", {"route": "forward", "outcome": "invalid"}) >= 1

    missing = httpx.get(middle.url + "/nowhere", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "no route GET /nowhere"
    wrong = httpx.get(middle.url + "/forward", headers=auth)
    assert wrong.status_code == 405 and "POST" in wrong.json()["error"]["message"]


def test_prompt_logprobs_through_the_mesh_equal_the_local_engine(stations, default_model, local):
    """The scheduler's scored prefill (echo / prompt logprobs): /score on the last station, bit for bit."""
    rng = np.random.default_rng(11)
    prompt = [int(t) for t in rng.integers(0, default_model.cfg.vocab_size, 45)]
    engine = connect(stations["3"], default_model)
    try:
        for start in (0, SHAPE["prefill_chunk"]):
            got_sample, got = engine.prefill_scored(2, prompt, start, SamplingParams())
            want_sample, want = local.prefill_scored(2, prompt, start, SamplingParams())
            assert got == want and got_sample == want_sample  # Samples: token, logprob and top, as floats
        assert len(got) == 12 and [s.token for s in got] == prompt[33:]
    finally:
        engine.close()
