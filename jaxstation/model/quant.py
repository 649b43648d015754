"""Weight-only int8: symmetric per-output-channel quantization, done once at load, dequantized inside the step.

A `QuantWeight` holds int8 values and one scale per output channel. `matmul` converts the int8 operand to the
activation dtype inside the compiled step and applies the scales to the product, `(x @ q) * scale`, which equals
`x @ (q * scale)` up to rounding and lets the compiler fuse the convert into the matmul where it can (a GPU's does).

A `KernelWeight` is a float32 or int8 weight laid out out-major for the CPU kernel (kernels/cpu_kernel.py), which
reads int8 without converting it in memory and gives each row the same bits whatever the other rows are.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxstation.kernels import cpu_kernel


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


@partial(jax.tree_util.register_dataclass, data_fields=["w", "scale"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KernelWeight:
    w: jax.Array  # [..., out, in]: int8, or float32
    scale: jax.Array | None  # float32 [..., out] for int8; None for float32

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + (0 if self.scale is None else self.scale.nbytes)


Weight = jax.Array | QuantWeight | KernelWeight
MATMULS = ("xla", "kernel")  # how projections multiply: XLA's dot, or the CPU kernel over KernelWeights


def prepare(w, weights: str, matmul: str) -> Weight:
    """A projection [..., in, out] as the step will read it: cast, quantized, or out-major for the kernel (when its
    shape fits the kernel; otherwise XLA's dot serves that weight)."""
    if matmul == "kernel" and cpu_kernel.fits(w.shape[-2], w.shape[-1]):
        return kernel_weight(np.swapaxes(np.asarray(w), -1, -2), weights)
    if weights == "int8":
        return quantize(w, reduce_axis=-2)
    return jnp.asarray(w, weights)


def prepare_embedding(embed, weights: str, matmul: str, tied: bool) -> Weight:
    """The embedding table [vocab, d]. Tied, its rows are the lm_head's output channels: quantized per row for int8,
    or out-major for the kernel as it stands. Untied, it is only looked up, so it stays in the compute dtype."""
    if tied and matmul == "kernel" and cpu_kernel.fits(embed.shape[1], embed.shape[0]):
        return kernel_weight(embed, weights)
    if tied and weights == "int8":
        return quantize(embed, reduce_axis=-1)
    return jnp.asarray(embed, compute_dtype(weights))


def kernel_weight(w_out_in, weights: str) -> KernelWeight:
    """A weight already out-major ([..., out, in], e.g. a tied embedding) for the kernel: int8 or float32."""
    if weights == "int8":
        q = quantize(w_out_in, reduce_axis=-1)
        return KernelWeight(q.q, q.scale)
    if weights != "float32":
        raise ValueError(f"the CPU kernel takes float32 or int8 weights, not {weights}")
    return KernelWeight(jnp.asarray(w_out_in, jnp.float32), None)


@partial(jax.jit, static_argnames=("reduce_axis",))
def quantize(w: jax.Array | np.ndarray, reduce_axis: int) -> QuantWeight:
    """Symmetric int8 with one scale per slice along `reduce_axis` (the input axis): scale = max|w| / 127."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=reduce_axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return QuantWeight(q=q, scale=jnp.squeeze(scale, axis=reduce_axis))


def compute_dtype(weights: str) -> jnp.dtype:
    """Activations, norms and the arena: the weights' float dtype; for int8, bfloat16 on a GPU and float32 on CPU."""
    if weights == "int8":
        return jnp.dtype(jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
    return jnp.dtype(weights)


def precision_for(dtype: jnp.dtype) -> jax.lax.Precision | None:
    """float32 matmuls run at full precision on every backend (a GPU would otherwise use TF32)."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def matmul(x: jax.Array, w: Weight) -> jax.Array:
    """x [..., in] @ w [in, out] in x's dtype."""
    if isinstance(w, KernelWeight):
        return cpu_kernel.rowwise_matmul(x, w.w, w.scale)
    precision = precision_for(x.dtype)
    if isinstance(w, QuantWeight):
        return jnp.matmul(x, w.q.astype(x.dtype), precision=precision) * w.scale.astype(x.dtype)
    return jnp.matmul(x, w, precision=precision)


def matmul_transposed(x: jax.Array, w: Weight) -> jax.Array:
    """x [..., d] @ w.T for w [out, d] (the tied lm_head over the embedding table) in x's dtype."""
    if isinstance(w, KernelWeight):
        return cpu_kernel.rowwise_matmul(x, w.w, w.scale)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    precision = precision_for(x.dtype)
    if isinstance(w, QuantWeight):
        return jax.lax.dot_general(x, w.q.astype(x.dtype), dims, precision=precision) * w.scale.astype(x.dtype)
    return jax.lax.dot_general(x, w, dims, precision=precision)


def take_rows(w: Weight, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows `ids` of an embedding table [vocab, d], dequantized to `dtype`."""
    if isinstance(w, KernelWeight):
        rows = w.w[ids].astype(dtype)
        return rows if w.scale is None else rows * w.scale[ids][..., None].astype(dtype)
    if isinstance(w, QuantWeight):
        return w.q[ids].astype(dtype) * w.scale[ids][..., None].astype(dtype)
    return w[ids]
