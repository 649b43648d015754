"""The sampling filters against a plain sort-based reference: top-k, top-p and min-p found by bisection keep exactly
the tokens a sorted vocabulary would; and a request's sampling parameters as the faces build them."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxstation.chat.request import sampling_params
from jaxstation.engine.rows import SamplingParams
from jaxstation.engine.sampling import SamplingArrays, _filter_mask


def reference_keep(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Sort, keep the k largest (ties at the k-th included), the shortest prefix whose mass reaches top_p (ties at the
    cut included), and p >= min_p * p_max; probabilities in float64."""
    desc = np.sort(scaled)[::-1]
    keep = np.ones(scaled.shape, bool)
    if top_k > 0:
        keep &= scaled >= desc[min(top_k, len(desc)) - 1]
    probs = np.exp(desc.astype(np.float64) - desc[0])
    probs /= probs.sum()
    if top_p < 1.0:
        exclusive = np.cumsum(probs) - probs
        n_keep = max(int(np.sum(exclusive < top_p)), 1)
        keep &= scaled >= desc[n_keep - 1]
    if min_p > 0:
        keep &= scaled >= desc[0] + np.log(min_p)
    return keep


def test_filters_equal_a_sorted_vocabulary() -> None:
    rng = np.random.default_rng(3)
    rows, vocab = 48, 4096
    scaled = (rng.standard_normal((rows, vocab)) * rng.uniform(0.3, 6.0, (rows, 1))).astype(np.float32)
    scaled[::3, :64] = scaled[::3].max(axis=1, keepdims=True) + 1  # a run of ties at the top
    scaled[1::3, 100:160] = -np.inf  # masked tokens
    top_k = rng.choice([0, 1, 3, 40, 64, 65, 500], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.01, 0.3, 0.9, 0.999], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.05, 0.3], rows).astype(np.float32)
    s = SamplingArrays(temperature=jnp.ones(rows), top_k=jnp.asarray(top_k), top_p=jnp.asarray(top_p),
                       min_p=jnp.asarray(min_p), seed=jnp.zeros(rows, jnp.uint32), counter=jnp.zeros(rows, jnp.int32))
    got = np.asarray(_filter_mask(jnp.asarray(scaled), s))
    for r in range(rows):
        want = reference_keep(scaled[r], int(top_k[r]), float(top_p[r]), float(min_p[r]))
        assert np.array_equal(got[r], want), (r, top_k[r], top_p[r], min_p[r], got[r].sum(), want.sum())
        assert got[r].sum() >= 1
    assert got[0].sum() >= 64  # ties at the top are all kept, whatever k


def test_bounded_parameters_are_the_checked_ones_and_direct_ones_still_check() -> None:
    """`bounded` (values a face's types already bounded) builds what the checking constructor builds; built directly,
    SamplingParams still refuses what lies out of bounds."""
    fields = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "seed": 3, "presence_penalty": 0.5,
              "frequency_penalty": -1.0, "repetition_penalty": 1.1, "logit_bias": ((5, 1.0),),
              "allowed_token_ids": (1, 2), "min_tokens": 2}
    assert SamplingParams.bounded(**fields) == SamplingParams(**fields)
    base = SamplingParams(temperature=0.5, top_k=3)
    assert SamplingParams.bounded(base, seed=9) == dataclasses.replace(base, seed=9)
    assert SamplingParams.bounded() == SamplingParams()
    with pytest.raises(TypeError, match="top_q"):
        SamplingParams.bounded(top_q=0.5)
    for bad in ({"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"min_p": 1.5}, {"presence_penalty": 3.0},
                {"repetition_penalty": 0.0}, {"logit_bias": ((1, 101.0),)}, {"allowed_token_ids": (-1,)},
                {"min_tokens": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_the_chat_faces_defaults() -> None:
    """What a chat face did not send: temperature 1, every filter off; top_k -1 is off too."""
    assert sampling_params() == SamplingParams(temperature=1.0)
    assert sampling_params(0, 0.5, -1, 0.1) == SamplingParams(temperature=0.0, top_p=0.5, min_p=0.1)
    assert sampling_params(top_k=7) == SamplingParams(temperature=1.0, top_k=7)
