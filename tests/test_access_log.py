"""Request logging: one access line per request (200, 4xx with the refused field, 5xx), and the JSON mode.

The in-process station's lines are read from the `jaxstation.access` logger; the JSON mode runs `jaxstation serve
--log-format json` as a subprocess and parses every line it prints. Neither may ever show a prompt or the API key.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

import pytest
from conftest import SERVE_SHAPE_FLAGS
from server_util import ServerThread, free_port, station_process, wait_for

from jaxstation.app import create_app
from jaxstation.config.settings import ConfigError, StationConfig, resolve
from jaxstation.model.loader import LoadedModel
from jaxstation.server.access_log import JsonFormatter
from jaxstation.server.station import Station

SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}
SECRET_PROMPT = "The orange submarine whispers"
API_KEY = "s3cret-key-123"


@pytest.fixture(scope="module")
def served(default_model: LoadedModel):
    st = Station(StationConfig(**SHAPE, continuous=True, drain_s=5), model=default_model)
    with ServerThread(create_app(st)) as server, server.client(timeout=120) as http:
        wait_for(lambda: http.get("/ready").status_code == 200, 120, "the station did not turn ready", 0.1)
        yield st, http


class Lines(logging.Handler):
    """Collects the access logger's records (from the server's thread), but /ready's."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.http_request["requestUrl"] != "/ready":  # the fixture's readiness polls may trail in
            self.records.append(record)

    def wait(self, n: int) -> list[logging.LogRecord]:
        """The access line is written once the reply is sent, so it may trail the client by a moment."""
        wait_for(lambda: len(self.records) >= n, 10, f"{n} access lines")
        return self.records


@pytest.fixture
def lines():
    handler = Lines()
    logger = logging.getLogger("jaxstation.access")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def test_access_lines_for_200_4xx_and_5xx(served, lines, monkeypatch: pytest.MonkeyPatch) -> None:
    st, http = served
    r = http.post("/v1/completions", json={"prompt": SECRET_PROMPT, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    usage = r.json()["usage"]
    r = http.post("/generate", json={"tokens": [1, 2, 3, 4], "max_new_tokens": 2})
    assert r.status_code == 200
    assert http.post("/v1/completions", json={"prompt": SECRET_PROMPT, "max_tokens": 0}).status_code == 400
    assert http.post("/generate", json={"tokens": [1], "max_new_tokens": 0}).status_code == 422
    assert http.get("/no/such/route").status_code == 404

    real_decode = st.engine.decode

    def decode_failing_once(*args, **kwargs):
        monkeypatch.setattr(st.engine, "decode", real_decode)
        raise RuntimeError("injected decode failure")

    monkeypatch.setattr(st.engine, "decode", decode_failing_once)
    assert http.post("/v1/completions", json={"prompt": SECRET_PROMPT, "max_tokens": 3}).status_code == 500

    records = lines.wait(6)
    msgs = [r.getMessage() for r in records]
    assert msgs[0].startswith("POST /v1/completions 200 ") and msgs[0].endswith(
        f"prompt_tokens={usage['prompt_tokens']} generated_tokens=3")
    assert msgs[1].startswith("POST /generate 200 ") and msgs[1].endswith("prompt_tokens=4 generated_tokens=2")
    assert msgs[2].startswith("POST /v1/completions 400 ") and msgs[2].endswith(" refused=max_tokens")
    assert msgs[3].startswith("POST /generate 422 ") and msgs[3].endswith(" refused=max_new_tokens")
    assert msgs[4].startswith("GET /no/such/route 404 ") and "refused" not in msgs[4]
    assert msgs[5].startswith("POST /v1/completions 500 ")
    assert [r.levelno for r in records[:6]] == [logging.INFO] * 2 + [logging.WARNING] * 3 + [logging.ERROR]
    for r in records:
        assert " ms" in r.getMessage() and float(r.http_request["latency"].rstrip("s")) >= 0
        assert SECRET_PROMPT not in r.getMessage()
    assert records[0].http_request["status"] == 200 and records[0].http_request["requestUrl"] == "/v1/completions"


def test_streamed_reply_logs_what_it_streamed(served, lines) -> None:
    _, http = served
    with http.stream("POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                      "stream": True}) as r:
        assert r.status_code == 200
        body = r.read().decode()
    assert body.rstrip().endswith("data: [DONE]")
    (record,) = lines.wait(1)
    assert record.getMessage().endswith("prompt_tokens=1 generated_tokens=4"), record.getMessage()


def test_json_formatter_gives_cloud_run_fields() -> None:
    record = logging.LogRecord("jaxstation.access", logging.WARNING, __file__, 1, "POST /x 400 1.0 ms refused=y",
                               None, None)
    record.http_request = {"requestMethod": "POST", "requestUrl": "/x", "status": 400, "latency": "0.001000s"}
    record.access = {"refused": "y"}
    entry = json.loads(JsonFormatter().format(record))
    assert entry["severity"] == "WARNING" and entry["message"] == "POST /x 400 1.0 ms refused=y"
    assert entry["httpRequest"]["status"] == 400 and entry["refused"] == "y"
    plain = json.loads(JsonFormatter().format(logging.LogRecord("jaxstation", logging.INFO, __file__, 1, "ready %d",
                                                                (4,), None)))
    assert plain["severity"] == "INFO" and plain["message"] == "ready 4" and "httpRequest" not in plain


def test_log_format_setting() -> None:
    assert resolve(None, {"MOONSHINE_LOG_FORMAT": "json"}).log_format == "json"
    assert resolve(None, {}).log_format == "text"
    with pytest.raises(ConfigError, match="MOONSHINE_LOG_FORMAT='xml' must be one of text, json"):
        resolve(None, {"MOONSHINE_LOG_FORMAT": "xml"})


def test_serve_json_mode_prints_one_json_object_per_line(tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "jaxstation", "serve", "--port", str(port), *SERVE_SHAPE_FLAGS,
           "--log-format", "json"]
    log = tmp_path / "serve.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MOONSHINE_API_KEY": API_KEY}
    with station_process(cmd, port, log, 120, env=env, cwd=Path(__file__).resolve().parents[1]) as (proc, client):
        auth = {"Authorization": f"Bearer {API_KEY}"}
        body = {"prompt": SECRET_PROMPT, "max_tokens": 2, "temperature": 0}
        r = client.post("/v1/completions", json=body, headers=auth)
        assert r.status_code == 200
        usage = r.json()["usage"]
        assert client.post("/v1/completions", json=body).status_code == 401
        assert client.post("/v1/completions", json={**body, "n": 99}, headers=auth).status_code == 400
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    text = log.read_text()
    entries = [json.loads(line) for line in text.splitlines() if line.strip()]  # every line is one JSON object
    assert all(isinstance(e, dict) and e["severity"] and "message" in e for e in entries)
    access = [e for e in entries if "httpRequest" in e and e["httpRequest"]["requestUrl"] == "/v1/completions"]
    assert [(e["httpRequest"]["status"], e["severity"]) for e in access] == [
        (200, "INFO"), (401, "WARNING"), (400, "WARNING")]
    assert access[0]["prompt_tokens"] == usage["prompt_tokens"] and access[0]["generated_tokens"] == 2
    assert access[2]["refused"] == "n" and "refused" not in access[1]
    assert any("ready" in e["message"] for e in entries)  # the station's own lines are JSON too
    assert API_KEY not in text and SECRET_PROMPT not in text


def test_probes_log_at_debug_whatever_their_status(caplog: pytest.LogCaptureFixture) -> None:
    """A load balancer polls /ready while the station loads: its 503s are expected, and must not flood the log."""
    from jaxstation.server.access_log import access_line

    with caplog.at_level(logging.DEBUG, logger="jaxstation.access"):
        for path, status in (("/ready", 503), ("/ready", 200), ("/health", 503), ("/health", 200)):
            access_line({"method": "GET", "path": path}, status, 0.001, None, None, None)
        access_line({"method": "GET", "path": "/metrics"}, 200, 0.001, None, None, None)
        access_line({"method": "POST", "path": "/generate"}, 503, 0.001, None, None, None)
    levels = [(r.getMessage().split()[1], r.levelname) for r in caplog.records]
    assert levels == [("/ready", "DEBUG"), ("/ready", "DEBUG"), ("/health", "DEBUG"), ("/health", "DEBUG"),
                      ("/metrics", "INFO"), ("/generate", "WARNING")]
