"""Row-invariant reductions: a row's result never depends on how many rows the array has.

XLA's CPU backend picks how to vectorize a reduce from the whole shape, so `jnp.sum` over a row adds in one order
for a 1-row array and in another for a 16-row one: the last bits differ. A decode wave that may run at several widths
(jaxstation/engine/engine.py) needs every float reduction of a row to be the same at every width. Max, min, argmax and
integer counts are exact in any order; float sums go through `row_sum`, which spells the order out as elementwise adds
of halves, which XLA does not reorder, and running sums through `row_cumsum`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxstation.kernels import cpu_kernel


def row_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Sum over `axis` (a negative index) by pairwise halves (an odd length gains a zero): [..., n] -> [...]. Over
    an axis before the last, each add is a whole vector of the axes after it."""
    while x.shape[axis] > 1:
        if x.shape[axis] % 2:
            pad = list(x.shape)
            pad[axis] = 1
            x = jnp.concatenate([x, jnp.zeros(pad, x.dtype)], axis=axis)
        half = x.shape[axis] // 2
        x = jax.lax.slice_in_dim(x, 0, half, axis=axis) + jax.lax.slice_in_dim(x, half, 2 * half, axis=axis)
    return jnp.squeeze(x, axis)


def row_cumsum(x: jax.Array) -> jax.Array:
    """Running sums over the last axis by doubling shifts (Hillis and Steele), elementwise adds only: [..., n] ->
    [..., n]."""
    shift = 1
    while shift < x.shape[-1]:
        x = x + jnp.pad(x[..., :-shift], [(0, 0)] * (x.ndim - 1) + [(shift, 0)])
        shift *= 2
    return x


def peak_and_first(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Over the last axis: the maximum, kept ([..., 1]), and the first index that holds it ([...] int32); on the CPU
    kernel where it runs (XLA's reduces over a row of a large vocabulary are several times slower; a row holding a NaN
    gets NaN and its last index), else as plain reductions (a row of NaNs: its last index)."""
    if cpu_kernel.available() and x.dtype == jnp.float32:
        peak, first = cpu_kernel.row_max(x)
        return peak[..., None], first
    n = x.shape[-1]
    peak = jnp.max(x, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return peak, jnp.minimum(jnp.min(jnp.where(x == peak, iota, n), axis=-1), n - 1)


def log_softmax(x: jax.Array, peak: jax.Array | None = None) -> jax.Array:
    """`jax.nn.log_softmax` over the last axis with a row-invariant sum; `peak`, each row's maximum ([..., 1]) where
    the caller has it."""
    peak = peak_and_first(x)[0] if peak is None else peak
    shifted = x - jax.lax.stop_gradient(peak)
    return shifted - jnp.log(row_sum(jnp.exp(shifted)))[..., None]


def softmax(x: jax.Array) -> jax.Array:
    """`jax.nn.softmax` over the last axis with a row-invariant sum."""
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / row_sum(e)[..., None]
