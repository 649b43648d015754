"""LoRA adapters in the step: exact against merged weights, bit-identical wherever a row runs, refused at load when
they do not fit; and over HTTP: `model` selects an adapter on every route (the official `openai` and `anthropic`
SDKs), /v1/models lists them, /generate takes `lora`, the runtime load and unload routes exist behind
--allow-runtime-lora, and the chat page's picker (headless Chromium, tests/browser_util.py) lists the adapters with
their parent and sends the picked one's name as the request's `model`.

Adapters are written here with numpy and safetensors in PEFT's layout (tests/adapter_util.py). The merged checks run
on the tiny Llama fixture in float32; the invariance checks on the default model as a station runs it (its GGUF
blocks on the CPU kernel, unrolled), with three LoRA slots. The HTTP checks run one continuous-batching station on
the default model with --lora-modules x=<dir>, --max-loras 3, --max-lora-rank 16 and --allow-runtime-lora: the
engine's settings, so it runs the programs the engine checks compiled in this process. A recording middleware
(tests/browser_util.py) keeps the chat and /tokenize requests it receives.
"""

from __future__ import annotations

import argparse
import json
import math

import anthropic
import numpy as np
import pytest
from adapter_util import random_lora, write_gguf_lora, write_merged, write_peft
from browser_util import Recorder, answer_meta, ask, finished, open_page, sent_to, wait
from conftest import FIXTURES, TESTS, engine_config, station_plan, tiny_model
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select
from server_util import ServerThread, wait_for
from test_cli import run_cli

from jaxstation.app import create_app
from jaxstation.config.plan import planned_engine
from jaxstation.config.settings import ConfigError, StationConfig, add_arguments, resolve
from jaxstation.engine.engine import Engine
from jaxstation.engine.prefix_cache import PrefixCache
from jaxstation.engine.rows import DecodeRow, PromptPiece, SamplingParams
from jaxstation.model.layers import lora_shapes, project
from jaxstation.model.loader import LoadedModel, load_hf_dir
from jaxstation.model.lora import empty_layer, slot_arrays, write_slot
from jaxstation.model.lora_files import AdapterError, read_adapter
from jaxstation.server.adapters import Adapters
from jaxstation.server.station import Station

GREEDY = SamplingParams()
TINY = {"lanes": 4, "max_seq": 128, "chunk": 16, "block": 32}
# the default model's LoRA engine and station: packed steps of 16, 32 and 64 rows (every prompt here fits in 64)
LORA_BUDGET = 64


# ---- the tiny Llama in float32: the adapter against its merged weights ----------------------------------------------

@pytest.fixture(scope="module")
def tiny_lora(tmp_path_factory):
    """The tiny Llama, a rank-4 adapter on every projection (PEFT and GGUF files), and the model with it merged."""
    tmp = tmp_path_factory.mktemp("tiny-lora")
    base = tiny_model("tiny-llama3")
    lora = random_lora(base.cfg, rank=4, seed=1, b_std=0.3)
    peft = write_peft(tmp / "peft", lora, rank=4, alpha=8.0)
    merged_dir = write_merged(FIXTURES / "tiny-llama3", tmp / "merged", lora, scale=8.0 / 4)
    cfg, params = load_hf_dir(merged_dir)
    merged = LoadedModel(cfg=cfg, params=params, tokenizer=None, source=merged_dir)
    return base, lora, peft, merged, tmp


def run_logits(engine: Engine, prompt: list[int], steps: int, lora: int, lane: int = 0
               ) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and the logits behind each, one request alone on `lane`: prefill chunk by chunk, then decode."""
    engine.begin(lane, prompt, GREEDY, frozenset(), lora)
    for start in range(0, len(prompt), engine.chunk):
        sample, logits = engine.prefill(lane, prompt, start, GREEDY, return_logits=True)
    tokens, all_logits = [sample.token], [np.asarray(logits)[0]]
    for n in range(1, steps + 1):
        rows: list[DecodeRow | None] = [None] * engine.lanes
        rows[lane] = DecodeRow(tokens[-1], len(prompt) + n - 1, GREEDY, n)
        samples, logits = engine.decode(rows, return_logits=True)
        tokens.append(samples[lane].token)
        all_logits.append(np.asarray(logits)[lane])
    return tokens, all_logits


def test_float32_adapter_equals_merged_weights(tiny_lora):
    base, lora, peft, merged, _ = tiny_lora
    engine = Engine(base, **TINY, max_loras=2, max_lora_rank=8)
    engine.write_lora(1, read_adapter(peft, base.cfg, 8).slots(base.cfg, 8))
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 256, 21)]
    tokens, logits = run_logits(engine, prompt, 10, lora=1)
    want_tokens, want_logits = run_logits(Engine(merged, **TINY), prompt, 10, lora=0)
    base_tokens, _ = run_logits(engine, prompt, 10, lora=0, lane=1)
    assert tokens == want_tokens
    assert tokens != base_tokens  # the adapter changes the output: the comparison above means something
    np.testing.assert_allclose(np.stack(logits), np.stack(want_logits), atol=1e-4, rtol=0)


def test_an_adapter_peft_wrote_gives_pefts_tokens_and_logits(tiny_lora):
    """tests/data/peft-tiny-llama3: saved by PEFT 0.21 itself (rsLoRA, rank 4, every projection;
    scripts/make_peft_adapter.py), with the logits PEFT's model computed for its greedy continuation."""
    base = tiny_lora[0]
    path = TESTS / "data" / "peft-tiny-llama3"
    with np.load(path / "reference.npz") as ref:
        prompt, want_tokens, want_logits = ref["prompt"].tolist(), ref["tokens"].tolist(), ref["logits"]
    engine = Engine(base, **TINY, max_loras=1, max_lora_rank=4)
    engine.write_lora(1, read_adapter(path, base.cfg, 4).slots(base.cfg, 4))
    tokens, logits = run_logits(engine, prompt, len(want_tokens) - 1, lora=1)
    assert tokens == want_tokens
    np.testing.assert_allclose(np.stack(logits), want_logits, atol=1e-4, rtol=0)
    assert run_logits(engine, prompt, len(want_tokens) - 1, lora=0, lane=1)[0] != want_tokens


def test_gguf_lora_file_reads_as_its_peft_twin(tiny_lora):
    """llama.cpp's GGUF LoRA layout (B's q/k rows permuted for a llama file, alpha in the metadata) gives the very
    arrays of the PEFT directory it was converted from, and so the same bits."""
    base, lora, peft, _, tmp = tiny_lora
    gguf_path = write_gguf_lora(tmp / "adapter.gguf", base.cfg, lora, alpha=8.0)
    from_peft, from_gguf = read_adapter(peft, base.cfg, 8), read_adapter(gguf_path, base.cfg, 8)
    for a, b in zip(from_peft.layers, from_gguf.layers, strict=True):
        assert a.keys() == b.keys()
        for m in a:
            assert np.array_equal(a[m][0], b[m][0]) and np.array_equal(a[m][1], b[m][1])
    engine = Engine(base, **TINY, max_loras=2, max_lora_rank=8)
    engine.write_lora(1, from_peft.slots(base.cfg, 8))
    engine.write_lora(2, from_gguf.slots(base.cfg, 8))
    prompt = list(range(5, 30))
    t1, l1 = run_logits(engine, prompt, 6, lora=1)
    t2, l2 = run_logits(engine, prompt, 6, lora=2, lane=3)
    assert t1 == t2 and all(np.array_equal(a, b) for a, b in zip(l1, l2, strict=True))


def test_rslora_and_alpha_scale_fold_into_b(tmp_path, tiny_lora):
    cfg = tiny_lora[0].cfg
    lora = random_lora(cfg, rank=4, seed=2, modules=("q", "down"))
    plain = read_adapter(write_peft(tmp_path / "plain", lora, rank=4, alpha=16.0), cfg, 8)
    rs = read_adapter(write_peft(tmp_path / "rs", lora, rank=4, alpha=16.0, rslora=True), cfg, 8)
    a, b = lora[1, "down"]
    assert np.array_equal(plain.layers[1]["down"][1], b * np.float32(16.0 / 4))
    assert np.array_equal(rs.layers[1]["down"][1], b * np.float32(16.0 / math.sqrt(4)))
    assert np.array_equal(rs.layers[1]["down"][0], a) and set(rs.layers[0]) == {"q", "down"}


def refusal(path, cfg, max_rank: int = 8) -> str:
    with pytest.raises(AdapterError) as e:
        read_adapter(path, cfg, max_rank)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_refused_at_load_naming_file_tensor_and_reason(tmp_path, tiny_lora):
    cfg = tiny_lora[0].cfg
    lora = random_lora(cfg, rank=4, seed=4, modules=("q", "v"))
    # a shape that does not fit the base
    wrong = dict(lora)
    wrong[1, "v"] = (lora[1, "v"][0][:, :-1], lora[1, "v"][1])
    msg = refusal(write_peft(tmp_path / "shape", wrong, rank=4, alpha=8.0), cfg)
    assert str(tmp_path / "shape") in msg and "model.layers.1.self_attn.v_proj.lora_A.weight" in msg
    assert "shape (4, 63)" in msg
    # an unknown target module: in the config, and as a tensor
    msg = refusal(write_peft(tmp_path / "conf", lora, rank=4, alpha=8.0, target_modules=["q_proj", "lm_head"]), cfg)
    assert "adapter_config.json" in msg and "'target_modules'" in msg and "unknown target module 'lm_head'" in msg
    path = write_peft(tmp_path / "tensor", lora, rank=4, alpha=8.0)
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(path / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight"] = lora[0, "q"][0]
    save_file(tensors, str(path / "adapter_model.safetensors"))
    msg = refusal(path, cfg)
    assert "adapter_model.safetensors" in msg and "layers.0.self_attn.qkv_proj.lora_A.weight" in msg
    assert "unknown target module 'qkv_proj'" in msg
    # another architecture (a GGUF LoRA file says which it was made for)
    msg = refusal(write_gguf_lora(tmp_path / "qwen.gguf", cfg, lora, 8.0, arch="qwen2"), cfg)
    assert "qwen.gguf" in msg and "'general.architecture'" in msg and "'qwen2'" in msg and "'llama'" in msg
    # a layer the base does not have
    deep = {**lora, (5, "q"): lora[0, "q"]}
    msg = refusal(write_peft(tmp_path / "deep", deep, rank=4, alpha=8.0), cfg)
    assert "model.layers.5.self_attn.q_proj.lora_A.weight" in msg and "the base has 2 layers" in msg
    # a rank above --max-lora-rank, in either format
    msg = refusal(write_peft(tmp_path / "rank", lora, rank=4, alpha=8.0), cfg, max_rank=2)
    assert "'r'" in msg and "rank 4" in msg and "--max-lora-rank 2" in msg
    msg = refusal(write_gguf_lora(tmp_path / "rank.gguf", cfg, lora, 8.0), cfg, max_rank=2)
    assert "blk.0.attn_q.weight.lora_a" in msg and "rank 4 is above --max-lora-rank 2" in msg
    # DoRA changes what the adapter computes
    msg = refusal(write_peft(tmp_path / "dora", lora, rank=4, alpha=8.0, use_dora=True), cfg)
    assert "'use_dora'" in msg
    assert json.loads((tmp_path / "dora" / "adapter_config.json").read_text())["use_dora"] is True


# ---- the default model, as a station runs it: bit-identical wherever a row runs -------------------------------------

@pytest.fixture(scope="module")
def lora_engine(default_model, tmp_path_factory):
    """`engine`'s shape and settings (packed admission up to 64 rows, n-gram verify steps) with three LoRA slots of
    rank 16, and adapters X (rank 16) and Y (rank 8, attention only) written as PEFT directories."""
    config = engine_config(speculative="ngram", max_loras=3, max_lora_rank=16, prefill_budget=LORA_BUDGET)
    engine = planned_engine(default_model, config, station_plan(config))
    tmp = tmp_path_factory.mktemp("lora")
    cfg = default_model.cfg
    x = write_peft(tmp / "x", random_lora(cfg, rank=16, seed=10, b_std=0.2), rank=16, alpha=32.0)
    y = write_peft(tmp / "y", random_lora(cfg, rank=8, seed=11, modules=("q", "k", "v", "o"), b_std=0.3), rank=8,
                   alpha=8.0)
    adapters = Adapters(engine, in_use=set)
    adapters.load("x", str(x))
    adapters.load("y", str(y))
    return engine, adapters


Run = dict[int, tuple[list[int], list]]  # lane -> (prompt, samples)


def rows_of(engine: Engine, state: Run) -> list[DecodeRow | None]:
    rows: list[DecodeRow | None] = [None] * engine.lanes
    for lane, (prompt, samples) in state.items():
        rows[lane] = DecodeRow(samples[-1].token, len(prompt) + len(samples) - 1, GREEDY, len(samples))
    return rows


def admit(engine: Engine, state: Run, requests: dict[int, tuple[list[int], int]], cut: int = 0) -> None:
    """Begin each request (lane -> (prompt, LoRA slot)) and feed its prompt in one packed step beside the decode rows
    of the lanes running; with `cut`, the first `cut` tokens of every prompt in a packed step of their own first."""
    for lane, (prompt, lora) in requests.items():
        engine.begin(lane, prompt, GREEDY, frozenset(), lora)
    if cut:
        engine.pack([PromptPiece(lane, prompt, 0, cut, GREEDY) for lane, (prompt, _) in requests.items()],
                    [None] * engine.lanes)
    pieces = [PromptPiece(lane, prompt, cut, len(prompt) - cut, GREEDY) for lane, (prompt, _) in requests.items()]
    samples = engine.pack(pieces, rows_of(engine, state))
    for lane in state:
        state[lane][1].append(samples[lane])
    for lane, (prompt, _) in requests.items():
        state[lane] = (prompt, [samples[lane]])


def decode(engine: Engine, state: Run, steps: int) -> None:
    for _ in range(steps):
        samples, _ = engine.decode(rows_of(engine, state))
        for lane in state:
            state[lane][1].append(samples[lane])


def trace(state: Run, lane: int, n: int) -> list[tuple[int, float, tuple]]:
    samples = state[lane][1][:n]
    assert len(samples) == n
    return [(s.token, s.logprob, s.top) for s in samples]


PROMPT_X = [1, 504, 3458, 282, 4649, 314, 2, 1, 9690, 198, 1780, 2365, 282, 253, 1663, 28, 2, 198]
PROMPT_B = [1, 9690, 198, 19556, 16538, 253, 5873, 30, 2, 198, 1, 520, 9531, 198]
STEPS = 8


def alone(engine: Engine, prompt: list[int], lora: int, lane: int, cut: int = 0) -> Run:
    state: Run = {}
    admit(engine, state, {lane: (prompt, lora)}, cut)
    decode(engine, state, STEPS)
    return state


def test_a_rows_bits_are_its_own_beside_any_others(lora_engine):
    engine, adapters = lora_engine
    x, y = adapters.get("x").slot, adapters.get("y").slot
    want = trace(alone(engine, PROMPT_X, x, lane=0), 0, STEPS + 1)
    base = trace(alone(engine, PROMPT_X, 0, lane=0), 0, STEPS + 1)
    assert [t for t, *_ in want] != [t for t, *_ in base]  # the adapter changes the tokens
    assert trace(alone(engine, PROMPT_X, x, lane=3), 3, STEPS + 1) == want  # another lane
    assert trace(alone(engine, PROMPT_X, x, lane=2, cut=7), 2, STEPS + 1) == want  # the prompt cut in two
    # beside rows of Y and base rows, entering in a packed step beside their decode rows
    state: Run = {}
    admit(engine, state, {0: (PROMPT_B, y), 1: (PROMPT_B, 0)})
    decode(engine, state, 2)
    admit(engine, state, {2: (PROMPT_X, x), 3: (PROMPT_X[3:], x)})
    decode(engine, state, STEPS)
    assert trace(state, 2, STEPS + 1) == want
    # and the base and Y rows beside them are the rows they are alone
    assert trace(state, 1, STEPS + 1) == trace(alone(engine, PROMPT_B, 0, lane=1), 1, STEPS + 1)
    assert trace(state, 0, STEPS + 1) == trace(alone(engine, PROMPT_B, y, lane=0), 0, STEPS + 1)


def test_unloaded_and_loaded_again_gives_the_same_bits(lora_engine):
    engine, adapters = lora_engine
    first, y = adapters.get("x"), adapters.get("y")
    want = trace(alone(engine, PROMPT_X, first.slot, lane=1), 1, STEPS + 1)
    assert adapters.unload("x") == first and adapters.get("x") is None
    other = adapters.load("y-again", y.path)  # takes X's slot
    assert other.slot == first.slot
    again = adapters.load("x", first.path)
    assert again.slot not in (first.slot, y.slot) and again.load not in (first.load, other.load)
    assert trace(alone(engine, PROMPT_X, again.slot, lane=0), 0, STEPS + 1) == want
    assert trace(alone(engine, PROMPT_B, other.slot, lane=2), 2, 4) == trace(alone(engine, PROMPT_B, y.slot, lane=3),
                                                                              3, 4)


def test_verify_steps_run_each_rows_adapter(lora_engine):
    """An n-gram verify step with drafts of X's own tokens (and a base row beside it) gives plain decoding's
    samples."""
    engine, adapters = lora_engine
    x = adapters.get("x").slot
    plain = alone(engine, PROMPT_X, x, lane=0)[0][1]
    base = alone(engine, PROMPT_B, 0, lane=1)[1][1]
    state: Run = {}
    admit(engine, state, {2: (PROMPT_X, x), 3: (PROMPT_B, 0)})
    rows = rows_of(engine, state)
    rows[2] = DecodeRow(plain[0].token, len(PROMPT_X), GREEDY, 1, drafts=(plain[1].token, plain[2].token))
    rows[3] = DecodeRow(base[0].token, len(PROMPT_B), GREEDY, 1)
    runs = engine.verify(rows)  # four rows: the engine's lanes
    assert [(s.token, s.logprob) for s in runs[2]] == [(s.token, s.logprob) for s in plain[1:4]]
    assert [(s.token, s.logprob) for s in runs[3]] == [(base[1].token, base[1].logprob)]


@pytest.mark.parametrize("model_fixture", ["exact_model", "integer_model"])
def test_on_gguf_blocks_the_delta_is_added_in_float32(model_fixture, request):
    """On the CPU kernel's stored GGUF blocks (float32-exact, and the integer products) a row's output is the
    kernel's, plus B A x computed in float32; a base row's is the kernel's, bit for bit."""
    model = request.getfixturevalue(model_fixture)
    cfg, layer = model.cfg, model.params.layers[0]
    lora = random_lora(cfg, rank=8, seed=5, modules=("q", "k", "v"))
    arrays = slot_arrays({m: (a, b) for (i, m), (a, b) in lora.items() if i == 0}, lora_shapes(cfg), 8)
    stacks = write_slot(empty_layer(lora_shapes(cfg), 2, 8), np.int32(1), arrays)
    x = np.random.default_rng(6).normal(0, 1, (3, 1, cfg.hidden_size)).astype(np.float32)
    plain = np.asarray(project(x, layer.wqkv, None, None))
    out = np.asarray(project(x, layer.wqkv, stacks.wqkv, np.array([1, 0, 1], np.int32)))
    assert np.array_equal(out[1], plain[1])
    delta = np.concatenate([x[:, 0].astype(np.float64) @ lora[0, m][0].T.astype(np.float64) @ lora[0, m][1].T
                            for m in ("q", "k", "v")], axis=-1)
    for row in (0, 2):
        np.testing.assert_allclose(out[row, 0] - plain[row, 0], delta[row], rtol=0, atol=2e-5)


def test_prefix_reuse_keys_on_the_adapter():
    cache = PrefixCache(lanes=2, chunk=4)
    prompt = list(range(20))
    cache.store(0, prompt[:16], version=7, adapter=3)
    assert not cache.pick(prompt, [0, 1], [7, 0], adapter=0).hit
    assert not cache.pick(prompt, [0, 1], [7, 0], adapter=4).hit
    pick = cache.pick(prompt, [0, 1], [7, 0], adapter=3)
    assert (pick.lane, pick.reused) == (0, 16)


def test_settings_name_what_the_user_typed():
    parser = argparse.ArgumentParser()
    add_arguments(parser, "serve")
    args = parser.parse_args(["--lora-modules", "a=/x/a", "b=/x/b.gguf", "--max-lora-rank", "8"])
    config = resolve(args, env={"MOONSHINE_ALLOW_RUNTIME_LORA": "on"}, command="serve")
    assert config.lora_modules == (("a", "/x/a"), ("b", "/x/b.gguf")) and config.max_lora_rank == 8
    assert config.lora_slots == 2 and config.allow_runtime_lora
    assert resolve(None, env={"MOONSHINE_ALLOW_RUNTIME_LORA": "1"}, command="serve").lora_slots == 1
    assert resolve(None, env={}, command="serve").lora_slots == 0
    with pytest.raises(ConfigError, match="--lora-modules='a': 'a' must be name=path"):
        resolve(parser.parse_args(["--lora-modules", "a"]), env={}, command="serve")
    with pytest.raises(ConfigError, match="MOONSHINE_LORA_MODULES names 2 adapters, more than --max-loras=1"):
        resolve(parser.parse_args(["--max-loras", "1"]), env={"MOONSHINE_LORA_MODULES": "a=/p,b=/q"},
                command="serve")


def test_serve_refuses_an_adapter_that_does_not_fit_in_one_line(tmp_path, default_model):
    """`serve --lora-modules` with an adapter above --max-lora-rank stops the started server with one line naming
    the setting, the file, the field and the reason (exit 1, as a tensor that fails to load)."""
    path = write_peft(tmp_path / "big", random_lora(default_model.cfg, 32, seed=7, modules=("q",)), rank=32,
                      alpha=32.0)
    r = run_cli("serve", "--port", "0", "--lanes", "2", "--max-seq", "256", "--lora-modules", f"big={path}",
                timeout=300)
    out = r.stderr + r.stdout
    assert r.returncode == 1 and "Traceback" not in out, out
    message = (f"--lora-modules big={path}: {path / 'adapter_config.json'}: field 'r': rank 32 is outside "
               "[1, --max-lora-rank 16]")
    assert len([line for line in r.stderr.splitlines() if message in line]) == 1, out


# ---- over HTTP: one station at the engine's settings ------------------------------------------------------------
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
                           speculative="ngram", allow_runtime_lora=True, prefill_budget=LORA_BUDGET)
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
