"""The sampling filters against a plain sort-based reference: top-k, top-p and min-p found by bisection keep exactly
the tokens a sorted vocabulary would."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

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
