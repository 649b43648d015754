"""Parity on the tiny HF fixtures (tests/fixtures/README.md): llama3 rope scaling + sharded + untied, and mistral
with a 16-token sliding window + tied embeddings.

The engine uses a KV block (16) no larger than the window, so for mistral whole blocks fall out of the window and
get fully masked; prefill chunks (8) split prompts at lengths that are not chunk multiples.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, oracle_logits, prefill_all, tiny_model, tiny_reference

from jaxstation.engine.engine import Engine, generate
from jaxstation.engine.rows import DecodeRow, SamplingParams
from jaxstation.model.loader import load_model

NAMES = ("tiny-llama3", "tiny-mistral")
# (fixture, weights, layer loop, decode attention, matmul): the CPU default (unrolled, the CPU kernels for matmuls and
# decode attention; tiny-mistral's window is 16), the blocked attention on the matmul kernel, the stacked walk on XLA's
# dot, the GPU layout with the dense attention the GPU runs (its `xla` implementation; tiny-mistral's
# 16-token window rules the dense attention out at max_seq 64), int8 on XLA's dot and on the kernel.
VARIANTS = [(n, "float32", "unroll", "kernel", "kernel") for n in NAMES] + [
    ("tiny-llama3", "float32", "unroll", "blocked", "kernel"), ("tiny-mistral", "int8", "unroll", "kernel", "kernel"),
    *((n, "float32", "scan", "blocked", "xla") for n in NAMES),
    ("tiny-llama3", "float32", "unroll", "xla", "xla"), ("tiny-mistral", "float32", "unroll", "blocked", "xla"),
    ("tiny-llama3", "int8", "scan", "blocked", "xla")]
if jax.default_backend() != "cpu":  # scripts/gpu_check.sh: the CPU kernels do not exist on a GPU backend
    VARIANTS = [v for v in VARIANTS if "kernel" not in v]
# Prompt lengths to prefill before feeding the rest of the 48 reference ids one by one through decode.
# None is a multiple of the chunk (8). With the 16-token window: 5 and 13 decode across positions 16 and 32;
# 20 prefills across 16 and decodes across 32; 37 and 47 prefill across both.
PREFILL_LENGTHS = (5, 13, 20, 37, 47)


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: "-".join(v))
def tiny(request):
    name, weights, loop, attention, matmul = request.param
    model = tiny_model(name, weights, loop, matmul)
    assert model.params.row_invariant == (matmul == "kernel")  # every tiny shape fits the kernel
    ref = tiny_reference(name)
    full = np.asarray(oracle_logits(model, jnp.asarray(ref["input_ids"])))
    engine = Engine(model, lanes=3, max_seq=64, chunk=8, block=16, attention=attention)
    return "-".join(request.param), model, ref, full, engine


# transformers' float32 numbers hold for the float layouts; int8 against float32 is measured in bench/accuracy.py
FLOAT_VARIANTS = [v for v in VARIANTS if v[1] == "float32"]
hf_variants = pytest.mark.parametrize("tiny", FLOAT_VARIANTS, ids=lambda v: "-".join(v), indirect=True)


def test_config_is_what_the_fixture_says():
    llama = tiny_model("tiny-llama3")
    assert llama.cfg.rope_scaling is not None and llama.cfg.rope_scaling.factor == 8.0
    assert llama.cfg.sliding_window is None and not llama.cfg.tie_word_embeddings
    assert llama.params.lm_head is not None
    mistral = tiny_model("tiny-mistral")
    assert mistral.cfg.sliding_window == 16 and mistral.cfg.tie_word_embeddings
    assert mistral.params.lm_head is None


def test_load_model_needs_a_tokenizer():
    # the fixtures ship no tokenizer files, so the full loader refuses them (hence tiny_model / load_hf_dir)
    with pytest.raises(Exception):  # noqa: B017 - whatever the tokenizer loader raises for a missing file
        load_model(FIXTURES / "tiny-mistral")


@hf_variants
def test_forward_full_matches_hf(tiny):
    name, _, ref, full, _ = tiny
    assert full.shape == ref["logits"].shape == (48, 256)
    err = np.abs(full - ref["logits"]).max()
    assert err <= 1e-3, f"{name}: max abs diff {err}"


@pytest.mark.parametrize("n", PREFILL_LENGTHS)
def test_prefill_then_decode_matches_full_forward(tiny, n):
    name, _, ref, full, engine = tiny
    ids = ref["input_ids"].tolist()
    lane = n % engine.lanes
    sample, logits = prefill_all(engine, lane, ids[:n], SamplingParams(), return_logits=True)
    np.testing.assert_allclose(np.asarray(logits)[0], full[n - 1], atol=1e-4, rtol=0, err_msg=f"{name} prefill {n}")
    assert sample.token == int(full[n - 1].argmax())
    for pos in range(n, len(ids)):
        rows = [None] * engine.lanes
        rows[lane] = DecodeRow(ids[pos], pos, SamplingParams(), pos - n + 1)
        samples, logits = engine.decode(rows, return_logits=True)
        np.testing.assert_allclose(np.asarray(logits)[lane], full[pos], atol=1e-4, rtol=0,
                                   err_msg=f"{name} prefill {n}, decode position {pos}")
        assert samples[lane].token == int(full[pos].argmax())
        assert all(s is None for i, s in enumerate(samples) if i != lane)


@hf_variants
def test_greedy_matches_hf(tiny):
    name, _, ref, _, engine = tiny
    k = int(ref["greedy_prompt_len"])
    out = generate(engine, ref["input_ids"][:k].tolist(), len(ref["greedy_ids"]), SamplingParams(), lane=2)
    assert out == ref["greedy_ids"].tolist(), name


def test_generate_stops_at_max_new_tokens(tiny):
    _, _, ref, _, engine = tiny
    prompt = ref["input_ids"][:20].tolist()
    for n in (1, 3):
        assert generate(engine, prompt, n, SamplingParams()) == ref["greedy_ids"][:n].tolist()


def test_generate_zero_new_tokens(tiny):
    _, _, ref, _, engine = tiny
    assert generate(engine, ref["input_ids"][:20].tolist(), 0, SamplingParams()) == []
