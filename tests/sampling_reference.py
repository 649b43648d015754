"""The float64 sampling reference the tests compare against (jaxstation/engine/sampling.py): the tokens top-k, top-p
and min-p keep, found by a sort, and the inverse-CDF draw over them with a row's uniform."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxstation.engine.rows import SamplingParams
from jaxstation.engine.sampling import row_bits


def reference_keep(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Sort, keep the k largest (ties at the k-th included), the shortest prefix whose mass reaches top_p (ties at the
    cut included), and p >= min_p * p_max; probabilities in float64. scaled: [vocab] float32 -> [vocab] bool."""
    desc = np.sort(scaled)[::-1]
    keep = np.ones(scaled.shape, bool)
    if top_k > 0:
        keep &= scaled >= desc[min(top_k, len(desc)) - 1]
    probs = np.exp(desc.astype(np.float64) - float(desc[0]))
    probs /= probs.sum()
    if top_p < 1.0:
        exclusive = np.cumsum(probs) - probs
        n_keep = max(int(np.sum(exclusive < top_p)), 1)
        keep &= scaled >= desc[n_keep - 1]
    if min_p > 0:
        keep &= scaled.astype(np.float64) >= float(desc[0]) + math.log(min_p)
    return keep


def uniforms(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Each row's uniform in [0, 1) with 53 bits, from its seed and generated-token count: [rows] -> [rows] float64."""
    bits = np.asarray(row_bits(jnp.asarray(seeds, jnp.uint32), jnp.asarray(counters, jnp.int32))).astype(np.uint64)
    return ((bits[:, 0] << np.uint64(21)) | (bits[:, 1] >> np.uint64(11))).astype(np.float64) * 2.0 ** -53


def reference_draw(logits: np.ndarray, sp: SamplingParams, counter: int) -> int:
    """The token a row samples from logits [vocab] float32 (already penalized, masked): greedy at temperature 0, else
    the first kept token, in vocabulary order, whose running probability exceeds the row's uniform. The parameters
    are taken in float32, as the device has them."""
    if sp.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits / np.float32(sp.temperature)
    keep = reference_keep(scaled, sp.top_k, *(float(np.float32(v)) for v in (sp.top_p, sp.min_p)))
    weights = np.where(keep, np.exp(scaled.astype(np.float64) - float(scaled.max())), 0.0)
    running = np.cumsum(weights)
    u = uniforms(np.array([sp.seed % 2**32]), np.array([counter]))[0]
    return int(np.searchsorted(running, u * running[-1], side="right"))
