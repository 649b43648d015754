"""The /generate station over real sockets: validation, parity with the serial engine, concurrency, disconnects,
backpressure, readiness, metrics, step failures and SIGTERM draining.

Three stations share the default model and one engine shape (4 lanes, 512 positions, chunk 32, block 128), so the
compiled steps are built once: a continuous-batching one on loopback TCP, a serialize-all one on a Unix socket, and a
serialize-all one with a one-job queue for the 503 test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import COMPILE_CACHE_ENV, SERVE_SHAPE_FLAGS, station_plan
from server_util import ServerThread, free_port, metric, queue_held_full, raw_post, station_process, wait_for

from jaxstation.app import create_app
from jaxstation.config.plan import planned_engine
from jaxstation.config.settings import StationConfig
from jaxstation.engine.engine import generate
from jaxstation.engine.rows import SamplingParams
from jaxstation.model.loader import LoadedModel
from jaxstation.server.station import Station

SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}
BODY_LIMIT = 8192
READY_S = 300


def make_station(model: LoadedModel, **overrides) -> Station:
    return Station(StationConfig(**SHAPE, max_body_bytes=BODY_LIMIT, drain_s=5, **overrides), model=model)


def wait_ready(client: httpx.Client) -> None:
    wait_for(lambda: client.get("/ready").status_code == 200, READY_S, "the station did not turn ready", 0.1)


@pytest.fixture(scope="module")
def tcp(default_model: LoadedModel):
    """The continuous-batching station on a loopback port."""
    station = make_station(default_model, continuous=True)
    with ServerThread(create_app(station)) as server, server.client() as client:
        wait_ready(client)
        yield station, server, client


@pytest.fixture(scope="module")
def uds(default_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory):
    """The serialize-all station on a Unix socket."""
    path = str(tmp_path_factory.mktemp("uds") / "station.sock")
    station = make_station(default_model, continuous=False)
    with ServerThread(create_app(station), uds=path) as server, server.client() as client:
        wait_ready(client)
        yield station, server, client


@pytest.fixture(params=["tcp", "uds"])
def any_station(request: pytest.FixtureRequest):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def reference(default_model: LoadedModel):
    """Serial runs on a separate engine of the stations' shape and plan (the same programs: packed prompts, narrow
    waves, the decode attention kernel), memoized: the parity reference."""
    engine = planned_engine(default_model, StationConfig(**SHAPE), station_plan(StationConfig(**SHAPE)))
    eos = frozenset(default_model.tokenizer.eos_ids)
    cache: dict[str, list[int]] = {}

    def run(body: dict) -> list[int]:
        key = json.dumps(body, sort_keys=True)
        if key not in cache:
            sampling = SamplingParams(temperature=body.get("temperature", 0.0), top_k=body.get("top_k") or 0,
                                      top_p=body.get("top_p") or 1.0, seed=body.get("seed") or 0)
            stop = eos | frozenset(body.get("stop_token_ids") or ())
            cache[key] = generate(engine, body["tokens"], body["max_new_tokens"], sampling, stop)
        return cache[key]

    return run


def requests_total(text: str, outcome: str) -> float:
    return metric(text, "jaxstation_requests_total", {"outcome": outcome})


# ---- validation --------------------------------------------------------------------------------------------------
VOCAB = 49152  # SmolLM2's; checked against the model in test_vocab_matches
OK = {"tokens": [1, 2, 3], "max_new_tokens": 4}
CASES = [
    ("not json", b"{not json", 400, "body"),
    ("json array", [1, 2, 3], 400, "body"),
    ("nan", b'{"tokens": [1], "max_new_tokens": 2, "temperature": NaN}', 400, "body"),
    ("missing tokens", {"max_new_tokens": 4}, 422, "tokens"),
    ("missing max_new_tokens", {"tokens": [1]}, 422, "max_new_tokens"),
    ("tokens not a list", {**OK, "tokens": "hello"}, 422, "tokens"),
    ("tokens hold a string", {**OK, "tokens": [1, "2"]}, 422, "tokens"),
    ("tokens hold a float", {**OK, "tokens": [1.5]}, 422, "tokens"),
    ("tokens hold a bool", {**OK, "tokens": [True]}, 422, "tokens"),
    ("empty tokens", {**OK, "tokens": []}, 422, "tokens"),
    ("token = vocab", {**OK, "tokens": [1, VOCAB]}, 422, "tokens"),
    ("negative token", {**OK, "tokens": [-1]}, 422, "tokens"),
    ("max_new_tokens a string", {**OK, "max_new_tokens": "4"}, 422, "max_new_tokens"),
    ("max_new_tokens 0", {**OK, "max_new_tokens": 0}, 422, "max_new_tokens"),
    ("prompt + max_new over max_seq", {"tokens": [1] * 500, "max_new_tokens": 13}, 422, "max_new_tokens"),
    ("temperature < 0", {**OK, "temperature": -0.1}, 422, "temperature"),
    ("temperature a string", {**OK, "temperature": "hot"}, 422, "temperature"),
    ("top_p 0", {**OK, "top_p": 0}, 422, "top_p"),
    ("top_p > 1", {**OK, "top_p": 1.5}, 422, "top_p"),
    ("top_k < 0", {**OK, "top_k": -1}, 422, "top_k"),
    ("top_k a float", {**OK, "top_k": 2.5}, 422, "top_k"),
    ("seed negative", {**OK, "seed": -1}, 422, "seed"),
    ("stop id out of range", {**OK, "stop_token_ids": [VOCAB]}, 422, "stop_token_ids"),
    ("stop_at_sentence_end not bool", {**OK, "stop_at_sentence_end": "yes"}, 422, "stop_at_sentence_end"),
    ("resume not bool", {**OK, "resume": 1}, 422, "resume"),
    ("unknown field", {**OK, "max_tokens": 4}, 422, "max_tokens"),
    ("presence_penalty > 2", {**OK, "presence_penalty": 2.5}, 422, "presence_penalty"),
    ("frequency_penalty a string", {**OK, "frequency_penalty": "1"}, 422, "frequency_penalty"),
    ("repetition_penalty 0", {**OK, "repetition_penalty": 0}, 422, "repetition_penalty"),
    ("logit_bias id past the vocabulary", {**OK, "logit_bias": {str(VOCAB): 1}}, 422, "logit_bias"),
    ("logit_bias key not an id", {**OK, "logit_bias": {"-1": 1}}, 422, "logit_bias"),
    ("logit_bias value > 100", {**OK, "logit_bias": {"5": 101}}, 422, "logit_bias"),
    ("logit_bias over 300 entries", {**OK, "logit_bias": {str(i): 1 for i in range(301)}}, 422, "logit_bias"),
    ("min_tokens > max_new_tokens", {**OK, "min_tokens": 5}, 422, "min_tokens"),
    ("min_tokens < 0", {**OK, "min_tokens": -1}, 422, "min_tokens"),
    ("ignore_eos not bool", {**OK, "ignore_eos": "true"}, 422, "ignore_eos"),
    ("over the size limit", {**OK, "tokens": [1] * (BODY_LIMIT // 2)}, 413, "body"),
]


def test_vocab_matches(default_model: LoadedModel) -> None:
    assert default_model.cfg.vocab_size == VOCAB


@pytest.mark.parametrize("body,status,field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_validation(any_station, body, status: int, field: str) -> None:
    _, _, client = any_station
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post("/generate", content=content)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["message"]


def test_oversize_chunked_body_without_content_length(any_station) -> None:
    _, _, client = any_station
    r = client.post("/generate", content=iter([b'{"tokens": [', b"1, " * BODY_LIMIT, b"1]}"]))
    assert r.status_code == 413 and r.json()["error"]["field"] == "body"


def test_serves_after_bad_input_and_matches_serial(any_station, reference) -> None:
    """After every rejected body above, the same connection pool still gets a correct greedy reply."""
    _, _, client = any_station
    body = {"tokens": [1, 504, 3458, 314, 1345, 30], "max_new_tokens": 8}
    r = client.post("/generate", json={**body, "resume": True, "seed": None, "top_k": None, "top_p": None})
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["generated"] == reference(body)
    assert reply["prompt_tokens"] == len(body["tokens"])
    assert reply["finish_reason"] in ("stop", "length")
    assert set(reply["timing"]) == {"queue_s", "ttft_s", "total_s", "cached_tokens"}
    assert reply["timing"]["cached_tokens"] == 0  # shorter than a prefill chunk: nothing to reuse


def test_token_controls(tcp) -> None:
    """A stop id biased to win every step (EOS, 2, or a stop_token_ids entry): held back by min_tokens, then it ends
    the request; with ignore_eos, EOS does not."""
    _, _, client = tcp
    body = {"tokens": [1, 504, 3458, 314, 1345, 30], "max_new_tokens": 6, "logit_bias": {"2": 100}}
    r = client.post("/generate", json={**body, "min_tokens": 3}).json()
    assert (len(r["generated"]), r["finish_reason"]) == (3, "stop") and 2 not in r["generated"]
    r = client.post("/generate", json={**body, "ignore_eos": True}).json()
    assert (r["generated"], r["finish_reason"]) == ([2] * 6, "length")
    r = client.post("/generate", json={**body, "logit_bias": {"11": 100}, "stop_token_ids": [11], "min_tokens": 4,
                                       "ignore_eos": True, "presence_penalty": -2, "repetition_penalty": 0.5}).json()
    assert (len(r["generated"]), r["finish_reason"]) == (4, "stop") and 11 not in r["generated"]


def test_prompt_plus_max_new_equal_to_max_seq_is_served(tcp, reference) -> None:
    _, _, client = tcp
    body = {"tokens": [(7 * i) % 5000 + 1 for i in range(500)], "max_new_tokens": 12}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["generated"] == reference(body)


# ---- concurrency -------------------------------------------------------------------------------------------------
def _mixed_bodies() -> list[dict]:
    bodies = []
    for i in range(8):
        body = {"tokens": [(31 * i + 17 * j) % 4000 + 1 for j in range(3 + 9 * i)], "max_new_tokens": 6 + i % 3}
        if i % 2:
            body |= {"temperature": 0.8, "seed": 1000 + i, "top_p": 0.9}
        if i == 4:
            body |= {"top_k": 5, "temperature": 1.0, "seed": 7}
        bodies.append(body)
    return bodies


@pytest.mark.parametrize("mode", ["tcp", "uds"], ids=["continuous", "serialize-all"])
def test_concurrent_requests_equal_serial_runs(mode: str, request: pytest.FixtureRequest, reference) -> None:
    _, _, client = request.getfixturevalue(mode)
    bodies = _mixed_bodies()
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda b: client.post("/generate", json=b), bodies))
    for body, r in zip(bodies, replies, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["generated"] == reference(body), body


# ---- disconnects, backpressure, failures -------------------------------------------------------------------------
def test_disconnect_cancels_the_job(tcp) -> None:
    station, server, client = tcp
    before = requests_total(client.get("/metrics").text, "cancelled")
    sock = raw_post(server.address, "/generate", json.dumps({"tokens": [1, 2, 3], "max_new_tokens": 400}).encode())
    wait_for(lambda: station.scheduler.busy_lanes == 1, 10, "the request did not take a lane")
    sock.close()
    wait_for(lambda: station.scheduler.busy_lanes == 0, 5, "the lane was not freed")
    assert requests_total(client.get("/metrics").text, "cancelled") == before + 1


def test_queue_full_gives_503_with_retry_after(default_model: LoadedModel) -> None:
    station = make_station(default_model, continuous=False, max_queue=1)
    with ServerThread(create_app(station)) as server, server.client() as client:
        wait_ready(client)
        with queue_held_full(station, server):
            r = client.post("/generate", json=OK)
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
            assert "queue is full" in r.json()["error"]["message"]
            assert requests_total(client.get("/metrics").text, "rejected") == 1
        assert client.post("/generate", json=OK).status_code == 200


def test_ready_only_after_warmup(default_model: LoadedModel) -> None:
    gate = threading.Event()
    config = StationConfig(**SHAPE, continuous=True)
    station = Station(config, model=default_model, before_warmup=lambda: gate.wait(30))
    with ServerThread(create_app(station)) as server, server.client() as client:
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 503
        r = client.post("/generate", json=OK)
        assert r.status_code == 503 and "Retry-After" in r.headers
        gate.set()
        wait_ready(client)
        assert client.post("/generate", json=OK).status_code == 200


def test_metrics_increment(tcp) -> None:
    _, _, client = tcp
    before = client.get("/metrics").text
    r = client.post("/generate", json={"tokens": [5, 6, 7, 8], "max_new_tokens": 3})
    assert r.status_code == 200
    client.post("/generate", json={"tokens": []})
    after = client.get("/metrics").text
    n = len(r.json()["generated"])
    assert requests_total(after, "ok") == requests_total(before, "ok") + 1
    assert requests_total(after, "invalid") == requests_total(before, "invalid") + 1
    assert metric(after, "jaxstation_generated_tokens_total") == metric(before, "jaxstation_generated_tokens_total") + n
    assert metric(after, "jaxstation_prompt_tokens_total") == metric(before, "jaxstation_prompt_tokens_total") + 4
    ttft_count = "jaxstation_time_to_first_token_seconds_count"
    assert metric(after, ttft_count) == metric(before, ttft_count) + 1
    for name in ("jaxstation_queue_depth", "jaxstation_busy_lanes", "jaxstation_inter_token_latency_seconds_count",
                 "jaxstation_step_seconds_count"):
        assert name in after


def test_step_failure_gives_500_then_serves(tcp, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    station, _, client = tcp
    real_decode = station.engine.decode
    calls = []

    def decode_failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected decode failure")
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(station.engine, "decode", decode_failing_once)
    body = {"tokens": [1, 504, 3458, 314, 1345, 30], "max_new_tokens": 8}
    r = client.post("/generate", json=body)
    assert r.status_code == 500 and "injected decode failure" in r.json()["error"]["message"]
    r = client.post("/generate", json=body)
    assert r.status_code == 200 and r.json()["generated"] == reference(body)
    assert client.get("/health").status_code == 200


# ---- SIGTERM -----------------------------------------------------------------------------------------------------
def status_or_refused(call) -> int | str:
    try:
        return call().status_code
    except httpx.TransportError:  # the listener closed once the drain finished
        return "refused"


def test_sigterm_drains_in_flight_then_exits_0(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MOONSHINE_CONTINUOUS_BATCH": "1"}
    cmd = [sys.executable, "-m", "jaxstation", "serve", "--port", str(port), *SERVE_SHAPE_FLAGS, "--drain-s", "30"]
    with station_process(cmd, port, tmp_path / "serve.log", 90, env=env, cwd=Path(__file__).resolve().parents[1]) \
            as (proc, client):
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(client.post, "/generate", json={"tokens": [1, 2, 3], "max_new_tokens": 40,
                                                                     "stop_token_ids": None})
            wait_for(lambda: metric(client.get("/metrics").text, "jaxstation_busy_lanes") == 1, 10,
                     "the request did not start")
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: status_or_refused(lambda: client.get("/ready")) != 200, 5, "/ready stayed 200")
            assert status_or_refused(lambda: client.post("/generate", json=OK)) in (503, "refused")
            r = in_flight.result(60)
        assert r.status_code == 200, r.text
        assert r.json()["finish_reason"] in ("stop", "length")
        assert proc.wait(30) == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_compiling_ends_the_process_cleanly(sig: signal.Signals, tmp_path: Path) -> None:
    """Cloud Run sends SIGTERM to instances still starting: the process exits 0 at once, with no abort from the
    loading thread (it may be inside XLA's compiler)."""
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "jaxstation", "serve", "--port", str(port), "--lanes", "2", "--max-seq", "256"]
    env = {k: v for k, v in os.environ.items() if k != COMPILE_CACHE_ENV}  # the steps must compile, not be read
    env["JAX_PLATFORMS"] = "cpu"
    with open(log, "w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=Path(__file__).resolve().parents[1])
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
                def weights_loaded() -> bool:  # then the steps compile
                    assert proc.poll() is None, log.read_text()
                    try:
                        text = client.get("/metrics").text
                    except httpx.TransportError:
                        return False
                    return metric(text, "jaxstation_startup_seconds", {"phase": "weight_load"}) > 0

                wait_for(weights_loaded, 120, "the weights did not load", 0.05)
                assert client.get("/ready").json() == {"status": "loading"}
            proc.send_signal(sig)
            assert proc.wait(30) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert "stopped while loading; exiting 0" in text
    assert "terminate called" not in text and "Traceback" not in text, text


# ---- settings and CLI (no model run) -----------------------------------------------------------------------------
def test_settings_resolve_flags_over_env_over_defaults() -> None:
    from jaxstation.cli import build_parser
    from jaxstation.config.settings import resolve

    assert resolve(None, {}) == StationConfig()
    env = {"PORT": "9000", "MOONSHINE_BATCH_LANES": "2", "MOONSHINE_CONTINUOUS_BATCH": "yes",
           "MOONSHINE_MAX_SEQ": "1024", "MOONSHINE_MAX_BODY_BYTES": "100"}
    cfg = resolve(None, env)
    assert (cfg.port, cfg.lanes, cfg.continuous, cfg.max_seq, cfg.max_body_bytes) == (9000, 2, True, 1024, 100)
    args = build_parser().parse_args(["serve", "--lanes", "4", "--no-continuous-batch", "--port", "8080"])
    cfg = resolve(args, env)
    assert (cfg.port, cfg.lanes, cfg.continuous, cfg.max_seq) == (8080, 4, False, 1024)


@pytest.mark.parametrize("env,message", [
    ({"MOONSHINE_MAX_SEQ": "1000"}, "MOONSHINE_MAX_SEQ=1000 must be a multiple of MOONSHINE_PREFILL_CHUNK=32"),
    ({"MOONSHINE_CONTINUOUS_BATCH": "maybe"}, "MOONSHINE_CONTINUOUS_BATCH='maybe' is not a boolean"),
    ({"MOONSHINE_BATCH_LANES": "eight"}, "MOONSHINE_BATCH_LANES='eight' is not an integer"),
    ({"MOONSHINE_BATCH_LANES": "0"}, "MOONSHINE_BATCH_LANES=0 must be >= 1"),
    ({"MOONSHINE_DTYPE": "float16"}, "MOONSHINE_DTYPE='float16' must be one of float32, bfloat16"),
])
def test_settings_errors_name_the_variable(env: dict, message: str) -> None:
    from jaxstation.config.settings import ConfigError, resolve

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        resolve(None, env)


def test_memory_check_names_what_to_lower(default_model: LoadedModel) -> None:
    from jaxstation.config.memory import check_memory
    from jaxstation.config.settings import ConfigError

    cfg = default_model.cfg
    check_memory(cfg, StationConfig(**SHAPE), "gguf", available=1 << 40)
    with pytest.raises(ConfigError, match="KV arena needs .* Lower MOONSHINE_BATCH_LANES .* or MOONSHINE_MAX_SEQ"):
        check_memory(cfg, StationConfig(**SHAPE), "gguf", available=1 << 20)
    with pytest.raises(ConfigError, match="exceeds the model's max_position"):
        check_memory(cfg, StationConfig(max_seq=cfg.max_position + 128), "gguf", available=1 << 40)


def test_cli_serve_rejects_bad_settings(capsys: pytest.CaptureFixture) -> None:
    from jaxstation.cli import main

    assert main(["serve", "--max-seq", "1000"]) == 2
    assert "--max-seq=1000 must be a multiple" in capsys.readouterr().err


@pytest.mark.parametrize("method,path,status,message", [
    ("GET", "/nowhere", 404, "no route GET /nowhere"),
    ("GET", "/generate", 405, "GET is not allowed on /generate (allowed: POST)"),
])
def test_unmatched_route_and_method_are_json(tcp, method: str, path: str, status: int, message: str) -> None:
    _, _, client = tcp
    r = client.request(method, path)
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": message, "field": None}}
    if status == 405:
        assert r.headers["allow"] == "POST"


def test_unmatched_openai_route_is_openai_json(tcp) -> None:
    _, _, client = tcp
    r = client.post("/v1/embeddings", json={})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "no route POST /v1/embeddings", "type": "invalid_request_error",
                                  "param": None, "code": "not_found"}}
