"""The GPU-grade layouts and int8, exercised on CPU: per-layer weights walked unrolled, the dense decode attention
(`jax.nn.dot_product_attention`, its `xla` implementation here), int8 weights; float32 at highest precision; and the
memory plan for a 7B model on a 24 GB card. Parity with the oracle and transformers is in test_parity_tiny.py."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ENGINE_SHAPE, tiny_model
from test_batch_invariance import TARGET, run_wave

from jaxstation.config.memory import check_memory, weight_bytes
from jaxstation.config.plan import resolve_plan
from jaxstation.config.settings import ConfigError, StationConfig
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import SamplingParams, sampling_arrays
from jaxstation.engine.steps import step_rows
from jaxstation.model.loader import LoadedModel, load_model
from jaxstation.model.quant import QuantWeight, matmul, quantize
from jaxstation.model.shapes import ARCHITECTURES, random_model

STEPS = 5
SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=42)


def _assert_invariant(engine: Engine, target: list[int], neighbour_len: tuple[int, int], seed: int) -> None:
    """The target's tokens and logits are bit-equal alone in lane 0 and in the last lane beside random neighbours
    (greedy and seeded), whose prompts run more KV blocks than the target's."""
    for sp in (SamplingParams(), SEEDED):
        alone = run_wave(engine, {0: (target, sp)}, STEPS)[0]
        rng = np.random.default_rng(seed)
        last = engine.lanes - 1
        lanes = {last: (target, sp)}
        for other in range(last):
            n = int(rng.integers(*neighbour_len))
            lanes[other] = (rng.integers(3, engine.cfg.vocab_size, n).tolist(),
                            SamplingParams(temperature=1.0, seed=int(rng.integers(1 << 31))) if other % 2 else sp)
        beside = run_wave(engine, lanes, STEPS)[last]
        assert beside[0] == alone[0]
        for step, (a, b) in enumerate(zip(beside[1], alone[1], strict=True)):
            assert np.array_equal(a, b), f"{sp}: logits differ at step {step} (max abs {np.abs(a - b).max()})"


@pytest.mark.parametrize("name,weights,loop,attention", [
    ("tiny-llama3", "float32", "unroll", "xla"), ("tiny-llama3", "int8", "scan", "xla"),
    ("tiny-mistral", "int8", "unroll", "blocked")])
def test_bitwise_invariance_tiny(name: str, weights: str, loop: str, attention: str) -> None:
    engine = Engine(tiny_model(name, weights, loop), lanes=4, max_seq=64, chunk=8, block=16, attention=attention)
    _assert_invariant(engine, list(range(3, 12)), (17, 50), seed=1)


@pytest.fixture(scope="module")
def int8_model() -> LoadedModel:
    return load_model(dtype="int8")


def test_bitwise_invariance_int8_default_model(int8_model: LoadedModel) -> None:
    _assert_invariant(Engine(int8_model, **ENGINE_SHAPE), TARGET, (129, 220), seed=2)


def test_int8_weights_are_int8(int8_model: LoadedModel) -> None:
    p = int8_model.params
    for w in (p.embed, p.layers.wqkv, p.layers.wo, p.layers.w_gate_up, p.layers.w_down):  # tied head: the embed
        assert isinstance(w, QuantWeight) and w.q.dtype == jnp.int8 and w.scale.dtype == jnp.float32
    assert p.dtype == jnp.float32 and Engine(int8_model, lanes=1, max_seq=128, chunk=32, block=128).arena.k.dtype \
        == jnp.float32
    assert p.nbytes < 0.3 * weight_bytes(int8_model.cfg, "float32")
    assert p.nbytes == weight_bytes(int8_model.cfg, "int8")


def test_quantize_per_output_channel() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 48)).astype(np.float32) * np.linspace(0.01, 3, 48, dtype=np.float32)
    qw = quantize(w, reduce_axis=-2)
    assert qw.q.shape == (64, 48) and qw.scale.shape == (48,)
    np.testing.assert_allclose(np.asarray(qw.scale), np.abs(w).max(0) / 127, rtol=1e-6)
    deq = np.asarray(qw.q, np.float32) * np.asarray(qw.scale)
    assert np.all(np.abs(deq - w) <= np.asarray(qw.scale) / 2 + 1e-7)  # round to nearest, per channel
    x = rng.standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(matmul(jnp.asarray(x), qw)), x @ deq, rtol=1e-5, atol=1e-5)


def _dot_precisions(model: LoadedModel) -> list[str]:
    engine = Engine(model, lanes=2, max_seq=64, chunk=8, block=16)
    lowered = step_rows.lower(engine.cfg, engine.params, engine.arena, np.zeros(2, np.int32),
                              np.zeros(2, np.int32), np.int32(1), sampling_arrays([None, None]), block=16)
    hlo = lowered.as_text(dialect="hlo")
    dots = re.findall(r"= \w+\[[^\]]*\][^\n]* dot\([^\n]*", hlo)
    assert dots
    return [m.group(1) if (m := re.search(r"operand_precision=\{(\w+),", d)) else "default" for d in dots]


def test_float32_matmuls_ask_for_highest_precision() -> None:
    # a GPU would otherwise run float32 matmuls as TF32 and miss parity with transformers
    assert set(_dot_precisions(tiny_model("tiny-llama3"))) == {"highest"}
    assert "highest" not in _dot_precisions(tiny_model("tiny-llama3", "bfloat16"))


def test_dense_attention_refuses_a_window_it_would_cut() -> None:
    mistral = tiny_model("tiny-mistral")  # sliding window 16
    with pytest.raises(ValueError, match="sliding window of 16 it needs max_seq <= the window"):
        Engine(mistral, lanes=2, max_seq=64, chunk=8, block=16, attention="xla")
    config = StationConfig(max_seq=64, prefill_chunk=8, kv_block=16)
    assert resolve_plan(config, mistral.cfg).attention == "kernel"  # auto never picks a dense one: on CPU, the kernel
    with pytest.raises(ConfigError, match="MOONSHINE_ATTENTION='xla' does not window; with a sliding window of 16 it "
                                          "needs max_seq <= the window, got 64"):
        resolve_plan(dataclasses.replace(config, attention="xla"), mistral.cfg)


L4 = 23034 * (1 << 20)  # what an NVIDIA L4 reports: 22.5 GiB


def test_mistral_7b_bf16_fits_an_l4_with_8_lanes_of_4096() -> None:
    cfg = ARCHITECTURES["mistral-7b"]
    pool = int(0.92 * L4)  # the GPU memory fraction the station sets
    assert 14.4e9 < weight_bytes(cfg, "bfloat16") < 14.6e9
    check_memory(cfg, StationConfig(lanes=8, max_seq=4096), "bfloat16", available=pool)
    with pytest.raises(ConfigError, match=r"the KV arena needs 8\.00 GiB .* plus 13\.50 GiB of weights, but only "
                                          r"20\.69 GiB is free .*at most 14 lanes fit"):
        check_memory(cfg, StationConfig(lanes=16, max_seq=4096), "bfloat16", available=pool)
    # int8 weights take about half: 8 x 4096 fits with room to spare even with this CPU backend's float32 arena
    check_memory(cfg, StationConfig(lanes=8, max_seq=4096), "int8", available=pool)
    assert weight_bytes(cfg, "int8") < 0.55 * weight_bytes(cfg, "bfloat16")  # + a float32 embedding on CPU


def test_random_model_matches_a_loaded_one_in_layout_and_bytes(float32_model: LoadedModel) -> None:
    random = random_model("smollm2-135m", "float32", float32_model.params.layer_loop, matmul="kernel")
    assert random.cfg == dataclasses.replace(float32_model.cfg, rms_norm_eps=1e-5)  # GGUF stores it as float32
    assert random.params.nbytes == float32_model.params.nbytes == weight_bytes(random.cfg, "float32")
    shapes = [x.shape for x in jax.tree_util.tree_leaves(random.params)]
    assert shapes == [x.shape for x in jax.tree_util.tree_leaves(float32_model.params)]
    unrolled = random_model("smollm2-135m", "int8", "unroll")
    assert isinstance(unrolled.params.layers, tuple) and len(unrolled.params.layers) == 30
