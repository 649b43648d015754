"""Gemma 3 270M Q4_K_M, the real file (assembled from the test extra's wheels into this run's cache directory).

It loads as a Q4_K_M mix (Q5_0, Q8_0, Q4_K and Q6_K matrices), the way a CPU station serves it: greedy tokens on four
prompts equal transformers' from the same file (`tests/reference/gemma3_270m_reference.json`); a request gives the same
tokens and logits alone and beside 7 others; and the model served as stored gives the logits of the same model
dequantized to float32, bit for bit.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REFERENCE, run_wave, station_plan

from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import SamplingParams
from jaxstation.model.gguf_file import GGUFFile
from jaxstation.model.layers import forward_full
from jaxstation.model.loader import LoadedModel, load_model
from jaxstation.model.quant import KernelWeight
from jaxstation.serving.plan import Plan
from jaxstation.serving.settings import StationConfig

GREEDY = json.loads((REFERENCE / "gemma3_270m_reference.json").read_text(encoding="utf-8"))["greedy"]
STEPS = len(GREEDY[0]["greedy_ids"]) - 1


@pytest.fixture(scope="module")
def plan(gemma3_270m: Path) -> Plan:
    """The CPU defaults a station plans for a GGUF model: its blocks as stored."""
    return station_plan(StationConfig(model=str(gemma3_270m), lanes=8, max_seq=128))


@pytest.fixture(scope="module")
def gemma(gemma3_270m: Path, plan: Plan) -> LoadedModel:
    return load_model(gemma3_270m, plan.dtype, plan.layer_loop, plan.matmul)


@pytest.fixture(scope="module")
def gemma_engine(gemma: LoadedModel, plan: Plan) -> Engine:
    return Engine(gemma, lanes=8, max_seq=128, chunk=32, block=128, attention=plan.attention)


def test_the_file_is_a_q4_k_m_mix(gemma3_270m: Path, gemma: LoadedModel) -> None:
    types = collections.Counter(gguf.GGMLQuantizationType(t.tensor_type).name for t in GGUFFile(gemma3_270m).tensors)
    assert types == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    p = gemma.params
    assert p.embed.blocks == "Q8_0" and p.lm_head is None  # the tied embedding stays in its blocks
    assert {w.blocks for layer in p.layers for w in (layer.wo, layer.w_down)} == {"Q4_K", "Q6_K"}
    assert {w.blocks for layer in p.layers for w in (layer.w_gate_up,)} == {"Q5_0"}
    # q, k and v in one format where the file has one (Q5_0), joined parts where v is Q8_0
    qkv = [w.blocks if isinstance(w, KernelWeight) else tuple(part.blocks for part in w.parts)
           for w in (layer.wqkv for layer in p.layers)]
    assert collections.Counter(qkv) == {"Q5_0": 9, ("Q5_0", "Q8_0"): 9}
    assert p.nbytes < os.path.getsize(gemma3_270m)  # every matrix served as the file stores it


@pytest.mark.parametrize("case", range(len(GREEDY)))
def test_greedy_tokens_equal_transformers(gemma: LoadedModel, gemma_engine: Engine, case: int) -> None:
    ref = GREEDY[case]
    assert gemma.tokenizer.encode(ref["prompt"]) == ref["prompt_ids"]
    tokens, _ = run_wave(gemma_engine, {0: (ref["prompt_ids"], SamplingParams())}, STEPS, return_logits=False)[0]
    assert tokens == ref["greedy_ids"], gemma.tokenizer.decode(tokens)


def test_alone_and_beside_seven_others_give_the_same_tokens(gemma_engine: Engine) -> None:
    target = GREEDY[0]["prompt_ids"]
    alone_tokens, alone_logits = run_wave(gemma_engine, {3: (target, SamplingParams())}, STEPS)[3]
    rng = np.random.default_rng(7)
    lanes = {3: (target, SamplingParams())}
    for lane in (0, 1, 2, 4, 5, 6, 7):
        prompt = [2, *rng.integers(10, 262144, size=int(rng.integers(4, 60))).tolist()]
        sampling = SamplingParams() if lane % 2 else SamplingParams(temperature=0.9, top_k=40, seed=lane)
        lanes[lane] = (prompt, sampling)
    tokens, logits = run_wave(gemma_engine, lanes, STEPS)[3]
    assert tokens == alone_tokens == GREEDY[0]["greedy_ids"]
    for a, b in zip(logits, alone_logits, strict=True):
        assert np.array_equal(a, b), np.abs(a - b).max()


def test_as_stored_gives_the_dequantized_models_logits(gemma3_270m: Path, gemma: LoadedModel, plan: Plan) -> None:
    dense = load_model(gemma3_270m, "float32", plan.layer_loop, plan.matmul)
    tokens = jnp.asarray(GREEDY[3]["prompt_ids"], jnp.int32)
    got = np.asarray(forward_full(gemma.cfg, gemma.params, tokens))
    want = np.asarray(forward_full(dense.cfg, dense.params, tokens))
    assert np.array_equal(got, want), np.abs(got - want).max()
