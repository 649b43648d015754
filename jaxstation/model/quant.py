"""Weight-only int8: symmetric per-output-channel quantization, done once at load, dequantized inside the step.

A `QuantWeight` holds int8 values and one scale per output channel. `matmul` converts the int8 operand to the
activation dtype inside the compiled step and applies the scales to the product, `(x @ q) * scale`, which equals
`x @ (q * scale)` up to rounding and lets the compiler fuse the convert into the matmul where it can (a GPU's does).

A `KernelWeight` is a float32 or int8 weight laid out out-major for the CPU kernel (kernels/cpu_kernel.py), which
reads int8 without converting it in memory and gives each row the same bits whatever the other rows are; or a GGUF
matrix in its stored block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K). With weights "gguf" the kernel
rounds each activation row to 8 bits per block and multiplies integers, as llama.cpp does, in one fixed order per
output, so a row's bits still depend on nothing beside it; with "gguf-exact" it rebuilds in registers exactly the
float32 weights the gguf package's dequantization gives, so the bits are float32's. A `JoinedWeight` is one
projection whose parts a file stores in different block formats.
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxstation.kernels import cpu_kernel, packing
from jaxstation.model.choices import GGUF_WEIGHTS


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


@partial(jax.tree_util.register_dataclass, data_fields=["w", "scale"], meta_fields=["blocks", "integer"])
@dataclasses.dataclass(frozen=True)
class KernelWeight:
    w: jax.Array  # [..., out, in]: int8, or float32; uint8 [..., out, in / block * block bytes] for GGUF blocks
    scale: jax.Array | None  # float32 [..., out] for int8; None otherwise
    blocks: str | None = None  # the GGUF block format of w ("Q4_1", ..., "Q4_1R" repacked); None for int8 and float32
    integer: bool = False  # blocks multiplied in integers over 8-bit activations (weights "gguf")

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + (0 if self.scale is None else self.scale.nbytes)


@partial(jax.tree_util.register_dataclass, data_fields=["parts"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class JoinedWeight:
    """One projection whose output columns a file stores in several block formats (a Q4_K_M file's q and k in Q5_0,
    v in Q8_0): each part as stored, its outputs concatenated. The kernel computes every output column alone, so the
    columns are those of the joined float32 weight, bit for bit."""

    parts: tuple[KernelWeight, ...]  # in output order

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@dataclasses.dataclass(frozen=True)
class GGUFBlocks:
    """A matrix as a GGUF file stores it: data uint8 [..., out, in / block * block bytes] in block format `fmt`, or
    the row runs that join along out into it (a projection's parts, as the file holds each)."""

    data: np.ndarray | tuple[np.ndarray, ...]
    fmt: str
    shape: tuple[int, ...]  # the matrix's: [..., out, in]

    @property
    def parts(self) -> tuple[np.ndarray, ...]:
        return self.data if isinstance(self.data, tuple) else (self.data,)

    @property
    def joined(self) -> np.ndarray:
        """The blocks in one array (a copy where they are parts)."""
        return self.data if isinstance(self.data, np.ndarray) else np.concatenate(self.data, axis=-2)

    def dequantize(self) -> np.ndarray:
        """float32 [..., out, in], as the gguf package computes it."""
        from gguf import GGMLQuantizationType, dequantize

        return np.asarray(dequantize(self.joined, GGMLQuantizationType[self.fmt]), np.float32).reshape(self.shape)


Weight = jax.Array | QuantWeight | KernelWeight | JoinedWeight
Tensor = np.ndarray | jax.Array | GGUFBlocks | tuple[GGUFBlocks, ...]  # a tuple: one projection in several formats


def dense(w: Tensor) -> np.ndarray | jax.Array:
    """The tensor's values: GGUF blocks dequantized ([..., out, in]; a tuple's parts joined along out), anything else
    as it is."""
    if isinstance(w, tuple):
        return np.concatenate([p.dequantize() for p in w], axis=-2)
    return w.dequantize() if isinstance(w, GGUFBlocks) else w


def on_kernel(w: Weight) -> bool:
    """Whether every matmul with `w` runs on the CPU kernel."""
    return isinstance(w, KernelWeight | JoinedWeight)


def stored(w: GGUFBlocks, weights: str, matmul: str) -> KernelWeight | None:
    """GGUF blocks as stored, for the kernel: where weights "gguf" or "gguf-exact" ask for them and the kernel reads
    that format at that shape (for the integer products repacked into their tiles where the channels fill them,
    `packing.pack_blocks`, a table's looked-up rows included); else None."""
    if weights in GGUF_WEIGHTS and matmul == "kernel" and cpu_kernel.fits_blocks(w.fmt, w.shape[-1], w.shape[-2]):
        if weights == "gguf" and (packed := cpu_kernel.repacked_format(w.fmt, w.shape[-2])):
            # the packed array is the weight's memory: JAX takes it as it is
            return KernelWeight(jax.device_put(packing.pack_blocks(w.parts, packed), may_alias=True), None, packed,
                                True)
        return KernelWeight(jnp.asarray(w.joined), None, w.fmt, weights == "gguf")
    return None


def projection(parts: list[Tensor]) -> Tensor:
    """Checkpoint matrices [out_i, in] as one projection: GGUF blocks stay as stored, out-major (the rows of
    consecutive parts of one format concatenated; a tuple where formats differ); anything else becomes a dense
    [in, sum(out_i)]."""
    if all(isinstance(p, GGUFBlocks) for p in parts):
        runs = [list(run) for _, run in itertools.groupby(parts, key=lambda p: p.fmt)]
        joined = tuple(GGUFBlocks(tuple(q for p in run for q in p.parts), run[0].fmt,
                                  (sum(p.shape[0] for p in run), run[0].shape[1])) for run in runs)
        return joined[0] if len(joined) == 1 else joined
    if len(parts) == 1:
        return np.asarray(dense(parts[0])).T
    return np.concatenate([np.asarray(dense(p)) for p in parts], axis=0).T


def stack(layers: list[Tensor]) -> Tensor:
    """Per-layer tensors on a leading layer axis (GGUF blocks of one format stay as stored)."""
    if all(isinstance(w, GGUFBlocks) and w.fmt == layers[0].fmt for w in layers):
        return GGUFBlocks(np.stack([w.joined for w in layers]), layers[0].fmt, (len(layers), *layers[0].shape))
    return np.stack([_in_out(w) for w in layers])


def _in_out(w: Tensor) -> np.ndarray:
    """A projection's dense values [in, out] (GGUF blocks are stored out-major)."""
    return np.swapaxes(dense(w), -1, -2) if isinstance(w, GGUFBlocks | tuple) else np.asarray(w)


def prepare_weight(w: Tensor, weights: str, matmul: str) -> Weight:
    """A projection as the step will read it: cast, quantized, or out-major for the kernel (when its shape fits the
    kernel; otherwise XLA's dot serves that weight). `w` is [..., in, out], or GGUF blocks [..., out, in], which
    weights "gguf" and "gguf-exact" keep as stored for the kernel."""
    if isinstance(w, tuple) and all(parts := [stored(p, weights, matmul) for p in w]):
        return JoinedWeight(tuple(parts))
    if isinstance(w, GGUFBlocks) and (kw := stored(w, weights, matmul)):
        return kw
    if isinstance(w, GGUFBlocks | tuple):
        w = _in_out(w)
    if matmul == "kernel" and cpu_kernel.fits(w.shape[-2], w.shape[-1]):
        return kernel_weight(np.swapaxes(np.asarray(w), -1, -2), weights)
    if weights == "int8":
        return quantize(w, reduce_axis=-2)
    return jnp.asarray(w, compute_dtype(weights))


def prepare_embedding(embed: Tensor, weights: str, matmul: str, tied: bool) -> Weight:
    """The embedding table [vocab, d]. With weights "gguf" or "gguf-exact", in its GGUF blocks, whose looked-up rows
    are the dequantized rows bit for bit (tied, they are the lm_head's output channels too). Otherwise tied: quantized
    per row for int8, out-major for the kernel as it stands; untied, it is only looked up, so it stays in the compute
    dtype."""
    if isinstance(embed, GGUFBlocks):
        if kw := stored(embed, weights, matmul):
            return kw
        embed = embed.dequantize()
    if tied and matmul == "kernel" and cpu_kernel.fits(embed.shape[1], embed.shape[0]):
        return kernel_weight(embed, weights)
    if tied and weights == "int8":
        return quantize(embed, reduce_axis=-1)
    return jnp.asarray(embed, compute_dtype(weights))


def kernel_weight(w_out_in, weights: str) -> KernelWeight:
    """A dense weight already out-major ([..., out, in], e.g. a tied embedding) for the kernel: int8, or float32 (for
    GGUF weights too: a tensor the file stores unquantized, or in a format the kernel does not read)."""
    if weights == "int8":
        q = quantize(w_out_in, reduce_axis=-1)
        return KernelWeight(q.q, q.scale)
    if weights not in ("float32", *GGUF_WEIGHTS):
        raise ValueError(f"the CPU kernel takes float32, int8, gguf or gguf-exact weights, not {weights}")
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
    """Activations, norms and the arena: the weights' float dtype; float32 for GGUF blocks (the CPU kernel's); for
    int8, bfloat16 on a GPU and float32 on CPU."""
    if weights in GGUF_WEIGHTS:
        return jnp.dtype(jnp.float32)
    if weights == "int8":
        return jnp.dtype(jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
    return jnp.dtype(weights)


def precision_for(dtype: jnp.dtype) -> jax.lax.Precision | None:
    """float32 matmuls run at full precision on every backend (a GPU would otherwise use TF32)."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def matmul(x: jax.Array, w: Weight) -> jax.Array:
    """x [..., in] @ w [in, out] in x's dtype."""
    if isinstance(w, JoinedWeight):
        return jnp.concatenate([matmul(x, p) for p in w.parts], axis=-1)
    if isinstance(w, KernelWeight):
        return cpu_kernel.rowwise_matmul(x, w.w, w.scale, w.blocks, w.integer)
    precision = precision_for(x.dtype)
    if isinstance(w, QuantWeight):
        return jnp.matmul(x, w.q.astype(x.dtype), precision=precision) * w.scale.astype(x.dtype)
    return jnp.matmul(x, w, precision=precision)


def matmul_transposed(x: jax.Array, w: Weight) -> jax.Array:
    """x [..., d] @ w.T for w [out, d] (the tied lm_head over the embedding table) in x's dtype."""
    if isinstance(w, KernelWeight):
        return cpu_kernel.rowwise_matmul(x, w.w, w.scale, w.blocks, w.integer)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    precision = precision_for(x.dtype)
    if isinstance(w, QuantWeight):
        return jax.lax.dot_general(x, w.q.astype(x.dtype), dims, precision=precision) * w.scale.astype(x.dtype)
    return jax.lax.dot_general(x, w, dims, precision=precision)


def take_rows(w: Weight, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows `ids` of an embedding table [vocab, d], dequantized to `dtype`."""
    if isinstance(w, KernelWeight) and w.blocks:
        return cpu_kernel.block_rows(w.w, ids, w.blocks).astype(dtype)
    if isinstance(w, KernelWeight):
        rows = w.w[ids].astype(dtype)
        return rows if w.scale is None else rows * w.scale[ids][..., None].astype(dtype)
    if isinstance(w, QuantWeight):
        return w.q[ids].astype(dtype) * w.scale[ids][..., None].astype(dtype)
    return w[ids]
