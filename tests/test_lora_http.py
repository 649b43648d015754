"""LoRA adapters over HTTP: `model` selects an adapter on every route (the official `openai` and `anthropic` SDKs),
/v1/models lists them, /generate takes `lora`, and the runtime load and unload routes exist behind
--allow-runtime-lora. The chat page's picker, in headless Chromium (tests/browser_util.py), lists the adapters with
their parent and sends the picked one's name as the request's `model`.

One continuous-batching station on the default model serves the module, with --lora-modules x=<dir>, --max-loras 3,
--max-lora-rank 16 and --allow-runtime-lora: the settings of tests/test_lora.py's engine, so it runs that engine's
compiled programs. A recording middleware (tests/browser_util.py) keeps the chat and /tokenize requests it receives.
"""

from __future__ import annotations

import anthropic
import pytest
from adapter_util import random_lora, write_peft
from browser_util import Recorder, answer_meta, ask, finished, open_page, sent_to, wait
from conftest import engine_config
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select
from server_util import ServerThread, wait_for

from jaxstation.app import create_app
from jaxstation.config.settings import StationConfig
from jaxstation.model.loader import LoadedModel
from jaxstation.server.station import Station

SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}
MODEL = "SmolLM2-135M-Instruct.Q4_1"
ASK = "What is the capital of France?"
NEW = 8


@pytest.fixture(scope="module")
def served(default_model: LoadedModel, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-http")
    cfg = default_model.cfg
    x = write_peft(tmp / "x", random_lora(cfg, rank=16, seed=10, b_std=0.2), rank=16, alpha=32.0)
    y = write_peft(tmp / "y", random_lora(cfg, rank=8, seed=12, b_std=0.3), rank=8, alpha=16.0)
    big = write_peft(tmp / "big", random_lora(cfg, rank=32, seed=13, modules=("q",)), rank=32, alpha=32.0)
    config = engine_config(continuous=True, drain_s=5, lora_modules=(("x", str(x)),), max_loras=3, max_lora_rank=16,
                           speculative="ngram", allow_runtime_lora=True)
    station = Station(config, model=default_model)
    app, sent = create_app(station), []
    app.add_middleware(Recorder, sent=sent)
    with ServerThread(app) as server, server.client() as http:
        wait_for(lambda: station.load_error or http.get("/ready").status_code == 200, 900,
                 "the station did not turn ready", 0.1)
        assert station.load_error is None
        yield station, server, http, {"x": x, "y": y, "big": big}, sent


def openai_client(server: ServerThread):
    import openai
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=120)


def completion(server: ServerThread, model: str) -> str:
    out = openai_client(server).completions.create(model=model, prompt=ASK, max_tokens=NEW, temperature=0)
    return out.choices[0].text


def chat(server: ServerThread, model: str) -> str:
    out = openai_client(server).chat.completions.create(model=model, messages=[{"role": "user", "content": ASK}],
                                                        max_tokens=NEW, temperature=0)
    return out.choices[0].message.content


def test_models_lists_adapters_with_their_parent(served):
    _, _, http, paths, _ = served
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert cards[MODEL].get("parent") is None
    assert cards["x"]["parent"] == MODEL and cards["x"]["root"] == str(paths["x"])


def test_the_chat_page_picks_an_adapter(served, browser: WebDriver):
    """The page's picker lists the model, then adapter x under its parent; picked, x goes out as the turn's `model`
    (and its /tokenize's), and the station's answer streams in. The station has no API key: the page asks for none."""
    _, server, _, _, sent = served
    page = open_page(browser, server.port)
    adapters = "#model optgroup[label='LoRA adapters'] option"
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, adapters), "no adapter listed")
    picker = Select(page.find_element(By.ID, "model"))
    assert [(o.get_attribute("value"), o.text) for o in picker.options] == [
        (MODEL, MODEL), ("x", f"x (LoRA adapter of {MODEL})")]
    picker.select_by_value("x")
    ask(page, ASK, NEW)
    finished(page)
    body = sent_to(sent, "/v1/chat/completions")[-1]
    assert body["model"] == "x" and sent_to(sent, "/tokenize")[-1]["model"] == "x"
    assert body["messages"] == [{"role": "user", "content": ASK}] and body["max_tokens"] == NEW
    assert answer_meta(page).endswith(f"completion {NEW}")
    assert page.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text.strip(), "the answer is empty"


def test_model_selects_the_adapter_on_every_route(served):
    station, server, http, *_ = served
    base, adapted = completion(server, MODEL), completion(server, "x")
    assert adapted != base
    assert completion(server, "claude-haiku-4-5") == base  # any other name runs the base model, as before
    # /generate with lora gives the completion's tokens
    tokens = http.post("/tokenize", json={"prompt": ASK}).json()["tokens"]
    reply = http.post("/generate", json={"tokens": tokens, "max_new_tokens": NEW, "lora": "x"})
    assert reply.status_code == 200
    assert station.model.tokenizer.decode(reply.json()["generated"]) == adapted
    # chat, Responses and Messages: the same conversation, the same adapter, the same words
    chat_x = chat(server, "x")
    assert chat_x != chat(server, MODEL)
    responses = openai_client(server).responses.create(model="x", input=ASK, max_output_tokens=NEW, temperature=0)
    assert responses.output_text == chat_x
    messages = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0)
    reply = messages.messages.create(model="x", max_tokens=NEW, messages=[{"role": "user", "content": ASK}],
                                     extra_body={"temperature": 0})  # the SDK takes temperature only this way
    assert reply.content[0].text == chat_x


def test_generate_unknown_lora_is_404(served):
    _, _, http, *_ = served
    reply = http.post("/generate", json={"tokens": [1, 2, 3], "max_new_tokens": 2, "lora": "nope"})
    assert reply.status_code == 404
    assert reply.json()["error"]["field"] == "lora" and "'nope'" in reply.json()["error"]["message"]


def test_load_and_unload_at_runtime(served):
    _, server, http, paths, _ = served
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": str(paths["y"])}).json() == {
        "lora_name": "y", "status": "loaded"}
    assert "y" in {c["id"] for c in http.get("/v1/models").json()["data"]}
    adapted = completion(server, "y")
    assert adapted not in (completion(server, "x"), completion(server, MODEL))
    # taken name; no free slot; a file that does not fit: refused in OpenAI's shape, naming the field
    taken = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(paths["y"])})
    assert taken.status_code == 409 and taken.json()["error"]["param"] == "lora_name"
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "w", "lora_path": str(paths["y"])}).status_code == 200
    full = http.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": str(paths["y"])})
    assert full.status_code == 409 and "--max-loras" in full.json()["error"]["message"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "y"}).json()["status"] == "unloaded"
    big = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(paths["big"])})
    assert big.status_code == 400 and big.json()["error"]["param"] == "lora_path"
    assert str(paths["big"]) in big.json()["error"]["message"] and "rank 32" in big.json()["error"]["message"]
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "y"})
    assert gone.status_code == 404
    assert gone.json()["error"]["type"] == "invalid_request_error" and gone.json()["error"]["param"] == "lora_name"
    assert completion(server, "y") == completion(server, MODEL)  # an unloaded name is any other name
    # loaded again (into the slot it left): the same words
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": str(paths["y"])}).status_code == 200
    assert completion(server, "y") == adapted
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "y"}).json()["error"]["param"] == "lora_path"


def test_runtime_routes_need_the_flag(tmp_path):
    """Without --allow-runtime-lora the routes are not served: 404, as vLLM without its variable. (This station's
    model path does not exist, so it fails to load at once; the routes answer all the same.)"""
    station = Station(StationConfig(**SHAPE, model=str(tmp_path / "none.gguf"), max_loras=1))
    with ServerThread(create_app(station)) as server, server.client() as http:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            reply = http.post(path, json={"lora_name": "x", "lora_path": str(tmp_path)})
            assert reply.status_code == 404 and "error" in reply.json()
        assert http.get("/v1/models").status_code == 200


def test_prefix_reuse_never_crosses_adapters(served):
    _, _, http, *_ = served
    prompt = list(range(1000, 1040))  # 40 tokens: one 32-token chunk to reuse

    def cached(lora: str | None) -> int:
        body = {"tokens": prompt, "max_new_tokens": 2, **({"lora": lora} if lora else {})}
        reply = http.post("/generate", json=body)
        assert reply.status_code == 200
        return reply.json()["timing"]["cached_tokens"]

    assert cached("x") == 0
    assert cached("x") == 32  # the same adapter reuses its prefix
    assert cached(None) == 0  # the base model does not reuse the adapter's KV
    assert cached(None) == 32
