"""The suite compiles without LLVM's optional passes and at LLVM's level 2 (conftest.FAST_COMPILE_FLAG), a station
with both at XLA's defaults: the passes unroll and vectorize loops and never reassociate floats, and level 2 keeps the
multiply-adds level 3 contracts into FMAs, so no bit changes. Checked here on decode waves, sampled and penalized rows
beside a greedy one, over the default model as a station runs it and over tiny models on XLA's float32 dots (where
level 1 changes bits): the programs compiled as a station compiles them give the same samples and logits."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST_COMPILE_FLAG, tiny_model

from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import SamplingParams, penalty_arrays, sampling_arrays
from jaxstation.engine.steps import step_rows

IN_THE_SUITE = {"xla_llvm_disable_expensive_passes": True, "xla_backend_optimization_level": 2}
AS_A_STATION = {"xla_llvm_disable_expensive_passes": False, "xla_backend_optimization_level": 3}


def test_the_suites_compile_flag_changes_no_bit_of_a_wave(engine: Engine) -> None:
    assert FAST_COMPILE_FLAG in os.environ["XLA_FLAGS"]
    assert_same_wave(engine, tokens=[11, 260, 4000, 0])


@pytest.mark.parametrize(("name", "loop"), [("tiny-gemma3", "scan"), ("tiny-llama3", "unroll")])
def test_the_suites_compile_flag_changes_no_bit_of_xlas_float32_dots(name: str, loop: str) -> None:
    """XLA's own dots in float32 (a GPU's path), where LLVM's level 1 (not the suite's 2) changes bits."""
    engine = Engine(tiny_model(name, "float32", loop, "xla"), lanes=4, max_seq=64, chunk=16, block=16)
    assert_same_wave(engine, tokens=[11, 60, 200, 0])


def assert_same_wave(engine: Engine, tokens: list[int]) -> None:
    """A decode wave of `engine` (greedy, sampled and penalized rows, an idle lane) compiled as the suite and as a
    station compile it gives the same samples and logits."""
    rows = [(SamplingParams(), 0), (SamplingParams(temperature=0.8, top_p=0.95, seed=3), 2),
            (SamplingParams(temperature=1.1, top_k=40, min_p=0.05, seed=9, repetition_penalty=1.2), 5), None]
    positions = np.array([17, 40, 3, engine.scratch_pos], np.int32)
    sampling = sampling_arrays(rows)
    penalties = penalty_arrays(rows, engine.cfg.vocab_size, [None] * len(rows))

    def wave(params, arena, positions, tokens, sampling, penalties):
        return step_rows(engine.cfg, params, arena, positions, tokens, np.int32(1), sampling, None, penalties,
                         block=engine.block, attention=engine.attention, return_logits=True)[1:]

    suite, station = (jax.jit(wave, compiler_options=options) for options in (IN_THE_SUITE, AS_A_STATION))
    outs = [f(engine.params, jax.tree.map(jnp.copy, engine.arena), positions, np.array(tokens, np.int32), sampling,
              penalties) for f in (suite, station)]
    leaves = [jax.tree_util.tree_leaves(out) for out in outs]
    assert len(leaves[0]) == len(leaves[1]) == 2  # the samples (tokens, logprobs, top ids, in one array), logits
    for got, want in zip(*leaves, strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want))
