"""A model split into layer-range stages computes exactly what the whole model does: the stages' chained residuals
and their lm_head give bitwise the local engine's logits, for prefill chunks, full decode waves and lane groups (the
pipelined shape), on the default model's integer products, in float32 and in bfloat16 (whose residuals stay bfloat16
on the wire); and the stages' prefill chunks give a prompt the bits of a single station's packed step. In-process,
no HTTP."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ENGINE_SHAPE as SHAPE  # the session engine's shape, so its compiled steps are reused
from conftest import tiny_model

from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, PromptPiece, Sample, SamplingParams, sampling_arrays
from jaxstation.group.payload import DTYPES, decode, encode
from jaxstation.mesh.stage import Stage, slice_params
from jaxstation.model.choices import LayerRange


def _stages(model, splits: list[str], attention: str = "blocked", kv_dtype: str | None = None) -> list[Stage]:
    return [Stage(model, LayerRange.parse(s), **SHAPE, attention=attention, kv_dtype=kv_dtype) for s in splits]


def _forward(stages: list[Stage], wave: str, inputs: np.ndarray, positions: np.ndarray, lane0: int,
             n_blocks: int) -> np.ndarray:
    x = inputs
    for s in stages:
        x = s.forward(wave, x, positions, lane0, n_blocks)
        assert x.dtype == s.dtype
        x = decode(encode({}, {"x": x}))[1]["x"]  # as it travels
    return x


def _check_split(engine: Engine, splits: list[str], sampling: SamplingParams) -> None:
    model = engine.model
    stages = _stages(model, splits, engine.attention, engine.kv_dtype.name)
    lanes, chunk, block, scratch = SHAPE["lanes"], SHAPE["chunk"], SHAPE["block"], SHAPE["max_seq"] - 1
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, model.cfg.vocab_size, 45)]
    lane = 1
    for start in (0, chunk):
        sample, want = engine.prefill(lane, prompt, start, sampling, return_logits=True)
        piece = prompt[start:start + chunk]
        tokens = np.zeros((1, chunk), np.int32)
        tokens[0, :len(piece)] = piece
        x = _forward(stages, "prefill", tokens, (start + np.arange(chunk, dtype=np.int32))[None], lane,
                     (start + len(piece) + block - 1) // block)
    out = stages[-1].lm_head("prefill", x[0, len(piece) - 1][None], sampling_arrays([(sampling, 0)]), True)
    np.testing.assert_array_equal(out["logits"], np.asarray(want))
    assert out["tokens"][0] == sample.token
    token = sample.token
    for step in range(4):
        pos = len(prompt) + step
        rows: list[DecodeRow | None] = [None] * lanes
        rows[lane] = DecodeRow(token, pos, sampling, step + 1)
        samples, want = engine.decode(rows, return_logits=True)
        group = 2 if step % 2 else lanes  # odd steps: the pipelined shape, lanes [0, 2) only
        tokens = np.array([[token if i == lane else 0] for i in range(group)], np.int32)
        positions = np.array([[pos if i == lane else scratch] for i in range(group)], np.int32)
        x = _forward(stages, "decode", tokens, positions, 0, pos // block + 1)
        out = stages[-1].lm_head("decode", x[:, 0], sampling_arrays([(r.sampling, r.counter) if r else None
                                                                      for r in rows[:group]]), True)
        np.testing.assert_array_equal(out["logits"][lane], np.asarray(want)[lane], err_msg=f"step {step}")
        assert out["tokens"][lane] == samples[lane].token
        token = samples[lane].token


def test_three_uneven_stages_equal_the_whole_model_bitwise(engine):
    _check_split(engine, ["0:7", "7:19", "19:30"], SamplingParams(temperature=0.8, top_k=50, seed=3))


def test_stage_prefill_chunks_give_a_packed_steps_bits(engine):
    """A single station on CPU packs prompts, one row per token; a mesh feeds them one chunk at a time. Both attend
    through the decode attention kernel, so the first token of a 45-token prompt, fed as two chunks through three
    stages, has the packed step's log-probabilities bit for bit (on the integer products, an attention that differed
    in its last bit would move activations' 8-bit codes)."""
    assert engine.prefill_budget and engine.attention == "kernel"
    assert engine.params.layers[0].wqkv.integer  # the default: dtype gguf
    stages = _stages(engine.model, ["0:7", "7:19", "19:30"], engine.attention, engine.kv_dtype.name)
    chunk, block, lane = SHAPE["chunk"], SHAPE["block"], 3
    sampling = SamplingParams(temperature=0.8, top_k=50, seed=3)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, engine.cfg.vocab_size, 45)]
    engine.begin(lane, prompt, sampling, frozenset())
    want = engine.pack([PromptPiece(lane, prompt, 0, len(prompt), sampling)], [None] * SHAPE["lanes"])[lane]
    for start in (0, chunk):
        piece = prompt[start:start + chunk]
        tokens = np.zeros((1, chunk), np.int32)
        tokens[0, :len(piece)] = piece
        x = _forward(stages, "prefill", tokens, (start + np.arange(chunk, dtype=np.int32))[None], lane,
                     (start + len(piece) + block - 1) // block)
    out = stages[-1].lm_head("prefill", x[0, len(piece) - 1][None], sampling_arrays([(sampling, 0)]), False)
    got = Sample(int(out["tokens"][0]), float(out["logprob"][0]),
                 tuple(zip(out["top_ids"][0].tolist(), out["top_logprobs"][0].tolist(), strict=True)))
    assert got == want


def test_bfloat16_stages_equal_the_whole_bfloat16_model_bitwise():
    model = tiny_model("tiny-llama3", "bfloat16")
    stage = Stage(model, LayerRange(0, 1), **SHAPE)
    assert stage.dtype == DTYPES["bfloat16"] and stage.info()["dtype"] == "bfloat16"
    _check_split(Engine(model, **SHAPE), ["0:1", "1:2"], SamplingParams())


def test_slice_params_keeps_only_what_the_range_needs(default_model):
    cfg, params = default_model.cfg, default_model.params
    tied = params.lm_head is None
    first_cfg, first = slice_params(cfg, params, LayerRange(0, 7))
    middle_cfg, middle = slice_params(cfg, params, LayerRange(7, 19))
    last_cfg, last = slice_params(cfg, params, LayerRange(19, 30))
    assert (first_cfg.num_layers, middle_cfg.num_layers, last_cfg.num_layers) == (7, 12, 11)
    assert first.embed is not None and first.lm_head is None
    assert middle.embed is None and middle.lm_head is None
    assert (last.embed is not None) == tied and (last.lm_head is None) == tied
    assert all(p.final_norm is params.final_norm for p in (first, middle, last))  # [d]: names the compute dtype
    assert middle.layers[0] is params.layers[7]  # the default model's layers are a tuple: sliced, not copied
    assert middle.nbytes < params.nbytes / 2


def test_per_layer_int8_weights_split_bitwise():
    """The 'unroll' layout (a tuple of layers, the GPU default) slices by layer too (float32 weights: the default model
    above); int8 weights travel as the float compute dtype between stations."""
    model = tiny_model("tiny-llama3", "int8", "unroll")
    _, sub = slice_params(model.cfg, model.params, LayerRange(1, 2))
    assert isinstance(sub.layers, tuple) and sub.layers[0] is model.params.layers[1]
    _check_split(Engine(model, **SHAPE), ["0:1", "1:2"], SamplingParams(temperature=0.9, seed=5))


def test_gemma3_split_across_its_global_and_local_layers_bitwise():
    """tiny-gemma3's layer 0 is global, layers 1 and 2 local (their own window and RoPE base): the second station's
    layer 0 is the model's layer 1. In the stacked walk, where the decode attention kernel's window is chosen by the
    traced layer index (tests/test_families.py runs the unrolled split as two station processes, and the blocked
    walk's stacked windows in its Gemma 2 engine)."""
    model = tiny_model("tiny-gemma3", "float32", "scan", "kernel")
    assert model.cfg.local_layers == (False, True, True)
    assert slice_params(model.cfg, model.params, LayerRange(1, 3))[0].local_layers == (True, True)
    _check_split(Engine(model, **SHAPE, attention="kernel"), ["0:1", "1:3"], SamplingParams(temperature=0.9, seed=2))


def test_a_range_past_the_model_is_refused(default_model):
    with pytest.raises(ValueError, match="layers 20:31 reach past the model's 30 layers"):
        Stage(default_model, LayerRange(20, 31), **SHAPE)
    for text in ("7", "a:b", "5:5", "9:3", "-1:3"):
        with pytest.raises(ValueError, match="A:B"):
            LayerRange.parse(text)
