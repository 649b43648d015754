"""Model families beyond Llama (tests/fixtures/README.md), each from HF safetensors and from the same weights as a GGUF
file: Qwen2 (biases on q, k and v), Qwen3 (an RMSNorm over each head's q and k; a head dimension of 32 where
hidden / heads is 16), Gemma 2 (norms as 1 + w, before and after attention and MLP, scaled embeddings, GeGLU, soft caps
on scores and logits, a sliding window on alternate layers, query_pre_attn_scalar) and Gemma 3 (q/k norms, a global
layer then two local ones with RoPE bases of their own, linear RoPE scaling on the global one).

Against transformers: logits within 1e-4 from the full forward, the engine's prefill and its greedy continuation;
the station's own promises: a request's bits alone equal its bits beside three others (every narrow width), in
float32 and int8; and a real station serves each file over HTTP, /generate and the OpenAI chat route, with the
tokenizer and chat template the checkpoint carries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from conftest import FIXTURES, oracle_logits, prefill_all, run_wave, tiny_reference
from mesh_util import TOKEN, start_mesh
from server_util import ServerThread, wait_for

from jaxstation.app import create_app
from jaxstation.config.plan import resolve_plan
from jaxstation.config.settings import StationConfig
from jaxstation.engine.engine import Engine, generate
from jaxstation.engine.jobs import Job
from jaxstation.engine.rows import SamplingParams
from jaxstation.engine.scheduler import Scheduler
from jaxstation.mesh.host_engine import MeshEngine
from jaxstation.mesh.stage import fingerprint
from jaxstation.model.config import ModelConfig
from jaxstation.model.loader import CheckpointError, LoadedModel, load_model
from jaxstation.server.station import Station

FAMILIES = ("tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3")
TOLERANCE = 1e-4


def path_of(name: str, fmt: str) -> str:
    return str(FIXTURES / name / "model.gguf") if fmt == "gguf" else str(FIXTURES / name)


def load(name: str, fmt: str, weights: str = "float32", loop: str = "unroll", matmul: str = "kernel") -> LoadedModel:
    return load_model(path_of(name, fmt), weights, loop, matmul)


def test_each_config_declares_its_family() -> None:
    qwen2, qwen3 = load("tiny-qwen2", "safetensors"), load("tiny-qwen3", "safetensors")
    assert qwen2.cfg.qkv_bias and not qwen2.cfg.qk_norm and qwen2.cfg.tie_word_embeddings
    assert qwen2.cfg.head_dim == 16 and qwen2.params.layers[0].bqkv.shape == (16 * (4 + 2 * 2),)
    assert qwen3.cfg.qk_norm and not qwen3.cfg.qkv_bias and not qwen3.cfg.tie_word_embeddings
    assert qwen3.cfg.head_dim == 32 and qwen3.params.layers[0].q_norm.shape == (32,)
    gemma2, gemma3 = load("tiny-gemma2", "safetensors").cfg, load("tiny-gemma3", "safetensors").cfg
    assert gemma2.local_layers == (True, False) and gemma2.sliding_window == 8 and gemma2.local_rope_theta is None
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.hidden_act) == (3.0, 5.0, "gelu_tanh")
    assert gemma3.local_layers == (False, True, True) and gemma3.local_rope_theta == 10000.0
    assert gemma3.rope_linear_factor == 4.0 and gemma3.qk_norm and gemma3.attn_softcap is None
    for cfg in (gemma2, gemma3):
        assert cfg.embed_scale == 8.0 and cfg.sandwich_norms and cfg.query_scale == 24 ** -0.5
    for name in FAMILIES:  # the GGUF file declares the same model (its numbers stored as float32, its norms as 1 + w)
        hf, gguf = load(name, "safetensors").cfg, load(name, "gguf").cfg
        f32 = {f: float(np.float32(getattr(hf, f))) for f in ("rms_norm_eps", "query_scale") if getattr(hf, f)}
        assert gguf == dataclasses.replace(hf, **f32, norm_offset=0.0)


# the station's CPU layout from the GGUF file, the stacked walk on XLA's dot from safetensors
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize(("fmt", "loop", "matmul"), [("gguf", "unroll", "kernel"), ("safetensors", "scan", "xla")])
def test_logits_match_transformers(name: str, fmt: str, loop: str, matmul: str) -> None:
    model, ref = load(name, fmt, loop=loop, matmul=matmul), tiny_reference(name)
    full = np.asarray(oracle_logits(model, jnp.asarray(ref["input_ids"])))
    err = float(np.abs(full - ref["logits"]).max())
    assert err <= TOLERANCE, f"{name} {fmt} {loop}/{matmul}: max |logit - transformers| {err}"


@pytest.mark.parametrize("name", FAMILIES)
def test_both_files_hold_the_same_weights(name: str) -> None:
    """So the engine and HTTP checks below, each on one of the two files, hold for both."""
    hf, gguf = load(name, "safetensors").params, load(name, "gguf").params
    assert jax.tree_util.tree_structure(hf) == jax.tree_util.tree_structure(gguf)
    for a, b in zip(jax.tree_util.tree_leaves(hf), jax.tree_util.tree_leaves(gguf), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# each family through the engine from one file, and over HTTP from the other
ENGINE_FILES = [("tiny-qwen2", "safetensors"), ("tiny-qwen3", "gguf"), ("tiny-gemma2", "gguf"),
                ("tiny-gemma3", "safetensors")]
HTTP_FILES = [(n, "gguf" if f == "safetensors" else "safetensors") for n, f in ENGINE_FILES]


@pytest.fixture(scope="module", params=ENGINE_FILES, ids="-".join)
def engine(request) -> Engine:
    name, fmt = request.param
    # Gemma 2 in the stacked walk: its layers' windows are looked up by the traced layer index
    return family_engine(load(name, fmt, loop="scan" if name == "tiny-gemma2" else "unroll"))


def family_engine(model: LoadedModel) -> Engine:
    """The engine the HTTP test's station builds: four lanes on the CPU kernels (the decode attention kernel, or the
    blocked walk for soft-capped scores), narrow waves and 16-row packed steps, so that the station reads these
    programs from the run's compilation cache."""
    attention = "blocked" if model.cfg.attn_softcap else "kernel"
    return Engine(model, lanes=4, max_seq=64, chunk=8, block=16, attention=attention, prefill_budget=16)


def test_the_engine_prefills_and_continues_as_transformers(engine: Engine) -> None:
    name = engine.model.source.parent.name if engine.model.source.is_file() else engine.model.source.name
    ref = tiny_reference(name)
    ids, n = ref["input_ids"].tolist(), int(ref["greedy_prompt_len"])
    for length in (5, 20, 37):
        _, logits = prefill_all(engine, 1, ids[:length], SamplingParams(), return_logits=True)
        assert np.abs(np.asarray(logits)[-1] - ref["logits"][length - 1]).max() <= TOLERANCE, length
    assert generate(engine, ids[:n], 16, SamplingParams(), lane=2) == ref["greedy_ids"].tolist()


def _alone_and_among_others(engine: Engine) -> None:
    """A seeded request's tokens and logits alone (a 1-row wave), beside one other (2 rows) and beside three (4 rows),
    its neighbours' prompts of random lengths, some past the window."""
    rng = np.random.default_rng(7)
    vocab = engine.cfg.vocab_size
    target = (rng.integers(3, vocab, 13).tolist(), SamplingParams(temperature=0.8, top_p=0.9, seed=3))
    alone = run_wave(engine, {2: target}, steps=6)[2]
    others = {lane: (rng.integers(3, vocab, int(rng.integers(2, 30))).tolist(), SamplingParams())
              for lane in (0, 1, 3)}
    for neighbours in ({1: others[1]}, others):
        among = run_wave(engine, {2: target, **neighbours}, steps=6)[2]
        assert alone[0] == among[0], len(neighbours)
        for a, b in zip(alone[1], among[1], strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_request_alone_equals_it_among_others(engine: Engine) -> None:
    assert engine.wave_widths == (1, 2, 4)
    _alone_and_among_others(engine)


def test_int8_a_request_alone_equals_it_among_others() -> None:
    _alone_and_among_others(family_engine(load("tiny-gemma3", "safetensors", "int8")))


@pytest.mark.parametrize(("name", "fmt"), HTTP_FILES)
def test_a_station_serves_the_family_over_http(name: str, fmt: str) -> None:
    ref = tiny_reference(name)
    n = int(ref["greedy_prompt_len"])
    # a float32 arena: transformers' reference keeps its keys and values in float32
    station = Station(StationConfig(model=path_of(name, fmt), lanes=4, max_seq=64, prefill_chunk=8, kv_block=16,
                                    prefill_budget="16", layer_loop="scan" if name == "tiny-gemma2" else "auto",
                                    continuous=True, drain_s=5, kv_dtype="float32"))
    with ServerThread(create_app(station)) as server, server.client(timeout=120) as http:
        wait_for(lambda: http.get("/ready").status_code == 200, 120, "the station did not turn ready", 0.1)
        r = http.post("/generate", json={"tokens": ref["input_ids"][:n].tolist(), "max_new_tokens": 16})
        assert r.status_code == 200, r.text
        assert r.json()["generated"] == ref["greedy_ids"].tolist()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                              temperature=0)
        # the fixture's tokenizer spells byte i as token i, and its template is ChatML
        prompt = b"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        assert chat.usage.prompt_tokens == len(prompt) and chat.usage.completion_tokens == 5
        expected = generate(station.engine, list(prompt), 5, SamplingParams())
        assert chat.choices[0].message.content == bytes(expected).decode("utf-8", errors="replace")


def test_a_qwen_checkpoint_without_its_biases_is_refused(tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    src = FIXTURES / "tiny-qwen2"
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.bias'"):
        load_model(tmp_path)
    # a Llama checkpoint with a bias its architecture does not have is refused by name too
    llama = FIXTURES / "tiny-mistral"
    (tmp_path / "config.json").write_bytes((llama / "config.json").read_bytes())
    tensors = load_file(llama / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        load_model(tmp_path)


def test_a_window_on_some_layers_only_is_refused() -> None:
    import json

    config = json.loads((FIXTURES / "tiny-qwen2" / "config.json").read_text())
    with pytest.raises(ValueError, match="use_sliding_window=true"):
        ModelConfig.from_hf({**config, "use_sliding_window": True})


def test_a_two_station_mesh_of_gemma3_gives_the_single_station_tokens() -> None:
    """Two station processes split tiny-gemma3 between its global layer 0 and its local layers 1-2; the host's engine
    runs jobs through them (greedy and seeded, more jobs than lanes) and gets the local engine's tokens."""
    path = FIXTURES / "tiny-gemma3" / "model.gguf"
    shape = {"lanes": 4, "max_seq": 64, "prefill_chunk": 8, "kv_block": 16, "layer_loop": "unroll"}
    procs = start_mesh(["0:1", "1:3"], extra=("--model", str(path)), shape=shape)
    try:
        model = load_model(path, "gguf", "unroll", "kernel")  # as the stations load it
        arena = resolve_plan(StationConfig(model=str(path), **shape), model.cfg).kv_dtype  # as the stations plan it
        local = Engine(model, lanes=4, max_seq=64, chunk=8, block=16, attention="kernel", kv_dtype=arena)
        rng = np.random.default_rng(3)
        jobs = [(rng.integers(3, 256, int(n)).tolist(), SamplingParams(temperature=0.9, seed=i) if i % 2 else
                 SamplingParams()) for i, n in enumerate(rng.integers(2, 40, 6))]
        expected = [generate(local, p, 10, sp) for p, sp in jobs]
        config = StationConfig(stations=",".join(p.url for p in procs), mesh_token=TOKEN, continuous=True,
                               **shape)
        mesh = MeshEngine.connect(config, resolve_plan(config, model.cfg), model.cfg, fingerprint(model))
        sched = Scheduler(mesh, continuous=True, max_queue=16, terminal_ids=frozenset())
        futures = [sched.submit(Job(tokens=p, max_new_tokens=10, sampling=sp)) for p, sp in jobs]
        sched.start()
        try:
            assert [f.result(timeout=120).generated for f in futures] == expected
        finally:
            assert sched.drain(10)
    finally:
        for p in procs:
            p.stop()
