"""The suite compiles without LLVM's optional passes (conftest.FAST_COMPILE_FLAG), which a station runs: they unroll
and vectorize loops but never reassociate floats, so they cannot change a bit. Checked here on a station's decode
wave over the default model, sampled and penalized rows beside a greedy one: the program compiled as a station
compiles it gives the same samples and logits."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from conftest import FAST_COMPILE_FLAG

from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import SamplingParams, penalty_arrays, sampling_arrays
from jaxstation.engine.steps import step_rows

IN_THE_SUITE, AS_A_STATION = ({"xla_llvm_disable_expensive_passes": on} for on in (True, False))


def test_the_suites_compile_flag_changes_no_bit_of_a_wave(engine: Engine) -> None:
    assert FAST_COMPILE_FLAG in os.environ["XLA_FLAGS"]
    rows = [(SamplingParams(), 0), (SamplingParams(temperature=0.8, top_p=0.95, seed=3), 2),
            (SamplingParams(temperature=1.1, top_k=40, min_p=0.05, seed=9, repetition_penalty=1.2), 5), None]
    positions = np.array([17, 40, 3, engine.scratch_pos], np.int32)
    tokens = np.array([11, 260, 4000, 0], np.int32)
    sampling = sampling_arrays(rows)
    penalties = penalty_arrays(rows, engine.cfg.vocab_size, [None] * len(rows))

    def wave(params, arena, positions, tokens, sampling, penalties):
        return step_rows(engine.cfg, params, arena, positions, tokens, np.int32(1), sampling, None, penalties,
                         block=engine.block, attention=engine.attention, return_logits=True)[1:]

    suite, station = (jax.jit(wave, compiler_options=options) for options in (IN_THE_SUITE, AS_A_STATION))
    outs = [f(engine.params, jax.tree.map(jnp.copy, engine.arena), positions, tokens, sampling, penalties)
            for f in (suite, station)]
    leaves = [jax.tree_util.tree_leaves(out) for out in outs]
    assert len(leaves[0]) == len(leaves[1]) >= 5  # tokens, logprob, top ids and logprobs, logits
    for got, want in zip(*leaves, strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want))
