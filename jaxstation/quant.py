"""Weight-only int8: symmetric per-output-channel quantization, done once at load, dequantized inside the step.

A `QuantWeight` holds int8 values and one scale per output channel. `matmul` converts the int8 operand to the
activation dtype inside the compiled step and applies the scales to the product, `(x @ q) * scale`, which equals
`x @ (q * scale)` up to rounding and lets the compiler fuse the convert into the matmul where it can.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


@partial(jax.tree_util.register_dataclass, data_fields=["q", "scale"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class QuantWeight:
    q: jax.Array  # int8, the weight's shape: [..., in, out] for projections, [vocab, d] for a tied embedding
    scale: jax.Array  # float32, the shape without the reduced axis: [..., out] or [vocab]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


Weight = jax.Array | QuantWeight


@partial(jax.jit, static_argnames=("reduce_axis",))
def quantize(w: jax.Array | np.ndarray, reduce_axis: int) -> QuantWeight:
    """Symmetric int8 with one scale per slice along `reduce_axis` (the input axis): scale = max|w| / 127."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=reduce_axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return QuantWeight(q=q, scale=jnp.squeeze(scale, axis=reduce_axis))


def precision_for(dtype: jnp.dtype) -> jax.lax.Precision | None:
    """float32 matmuls run at full precision on every backend (a GPU would otherwise use TF32)."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def matmul(x: jax.Array, w: Weight) -> jax.Array:
    """x [..., in] @ w [in, out] in x's dtype."""
    precision = precision_for(x.dtype)
    if isinstance(w, QuantWeight):
        return jnp.matmul(x, w.q.astype(x.dtype), precision=precision) * w.scale.astype(x.dtype)
    return jnp.matmul(x, w, precision=precision)


def matmul_transposed(x: jax.Array, w: Weight) -> jax.Array:
    """x [..., d] @ w.T for w [out, d] (the tied lm_head over the embedding table) in x's dtype."""
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    precision = precision_for(x.dtype)
    if isinstance(w, QuantWeight):
        return jax.lax.dot_general(x, w.q.astype(x.dtype), dims, precision=precision) * w.scale.astype(x.dtype)
    return jax.lax.dot_general(x, w, dims, precision=precision)


def take_rows(w: Weight, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows `ids` of an embedding table [vocab, d], dequantized to `dtype`."""
    if isinstance(w, QuantWeight):
        return w.q[ids].astype(dtype) * w.scale[ids][..., None].astype(dtype)
    return w[ids]
