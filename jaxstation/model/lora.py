"""LoRA adapters on the device: `[slots, ...]` stacks of every adapter's A and B, and the per-row delta.

A station serving adapters holds, for each layer and projection, one stack of A matrices and one of B matrices with a
slot per resident adapter; slot 0 is all zeros (the base model). Each row of a step carries the slot of its request's
adapter: it gathers its own A and B (as BGMV does) and adds `(x A^T) B^T`, in float32, to the projection's output.
The stacks' shapes are fixed by the station (`--max-loras`, `--max-lora-rank`): loading an adapter writes a slot and
never recompiles a step.

Batch invariance by construction: a row reads only its own slot, and the two products are elementwise multiplies
summed with `rowwise.row_sum` (pairwise halves, the same order at any row count), not XLA dots; where the
projection's weights are on the CPU kernel, one kernel call a projection does the same (`kernels/lora.cc`). A rank
below the station's maximum is padded with zeros, which add exactly nothing. The scale (alpha / r, or alpha / sqrt(r)
for rsLoRA) is folded into B when the slot is written.

Joined projections follow the base's joining (layers.py): q/k/v share one input, so their A matrices are stacked
along the rank axis and gathered as one; each part then has its own B, and the parts' outputs are concatenated in
the fused projection's order (q | k | v, gate | up).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxstation.kernels import cpu_kernel
from jaxstation.kernels.rowwise import row_sum

# the fused projections (LayerParams fields) and the checkpoint slots each joins, in the fused order
PROJECTIONS = {"wqkv": ("q", "k", "v"), "wo": ("o",), "w_gate_up": ("gate", "up"), "w_down": ("down",)}


@partial(jax.tree_util.register_dataclass, data_fields=["a", "b"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LoraProj:
    """One fused projection's adapters: a [slots, in, parts * rank] (the parts' A^T side by side), and b one
    [slots, rank, out_part] per part (B^T, scale folded in). With a leading layer axis in a stacked ("scan") layout.
    The summed axis comes before the last, so that every add of `row_sum` is a vector over the last."""

    a: jax.Array
    b: tuple[jax.Array, ...]


@partial(jax.tree_util.register_dataclass, data_fields=["wqkv", "wo", "w_gate_up", "w_down"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LoraLayer:
    wqkv: LoraProj
    wo: LoraProj
    w_gate_up: LoraProj
    w_down: LoraProj


def part_shapes(d: int, ffn: int, q: int, kv: int) -> dict[str, tuple[int, int]]:
    """Each checkpoint slot's (in, out)."""
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, ffn), "up": (d, ffn), "down": (ffn, d)}


def empty_layer(shapes: dict[str, tuple[int, int]], slots: int, rank: int) -> LoraLayer:
    """One layer's stacks, every slot zero."""
    def proj(parts: tuple[str, ...]) -> LoraProj:
        d_in = shapes[parts[0]][0]
        return LoraProj(a=jnp.zeros((slots, d_in, len(parts) * rank), jnp.float32),
                        b=tuple(jnp.zeros((slots, rank, shapes[p][1]), jnp.float32) for p in parts))

    return LoraLayer(**{name: proj(parts) for name, parts in PROJECTIONS.items()})


def slot_arrays(weights: dict[str, tuple[np.ndarray, np.ndarray]], shapes: dict[str, tuple[int, int]], rank: int
                ) -> dict[str, tuple[np.ndarray, tuple[np.ndarray, ...]]]:
    """One layer's adapter, as the arrays of one slot per fused projection: `weights` maps a checkpoint slot to its
    (A [r, in], B [out, r] with the scale folded in); a slot it lacks, and ranks below `rank`, are zeros."""
    out = {}
    for name, parts in PROJECTIONS.items():
        a = np.zeros((shapes[parts[0]][0], len(parts) * rank), np.float32)
        bs = []
        for j, p in enumerate(parts):
            b = np.zeros((rank, shapes[p][1]), np.float32)
            if p in weights:
                pa, pb = weights[p]
                a[:, j * rank:j * rank + pa.shape[0]] = pa.T
                b[:pb.shape[1]] = pb.T
            bs.append(b)
        out[name] = (a, tuple(bs))
    return out


@jax.jit
def write_slot(layer: LoraLayer, slot: jax.Array, arrays: dict[str, tuple[jax.Array, tuple[jax.Array, ...]]],
               ) -> LoraLayer:
    """The stacks with `slot` overwritten by `arrays` (as `slot_arrays` gives; a leading layer axis where the stacks
    have one)."""
    def put(stack: jax.Array, value: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_index_in_dim(stack, value.astype(stack.dtype), slot, axis=stack.ndim - 3)

    return LoraLayer(**{name: LoraProj(a=put(getattr(layer, name).a, a),
                                       b=tuple(put(s, v) for s, v in zip(getattr(layer, name).b, bs, strict=True)))
                        for name, (a, bs) in arrays.items()})


def add_delta(y: jax.Array, proj: LoraProj, x: jax.Array, adapters: jax.Array, kernel: bool = False) -> jax.Array:
    """y + B (A x) per row, added in float32. y: [rows, Q, out] (a projection's output); x: [rows, Q, in] (its
    input); adapters: [rows] int32, each row's slot. kernel: the delta in one CPU-kernel call (`cpu_kernel.lora_delta`:
    the same sums in the same order, without the FMAs XLA contracts a product and an add into), where XLA's ops (two
    dozen a projection) take an unrolled 30-layer step seconds more to compile."""
    xf = x.astype(jnp.float32)
    if kernel:
        return (y.astype(jnp.float32) + cpu_kernel.lora_delta(xf, proj.a, proj.b, adapters)).astype(y.dtype)
    a = proj.a[adapters]  # [rows, in, parts * rank]
    h = row_sum(xf[..., None] * a[:, None], axis=-2)  # [rows, Q, parts * rank]
    rank = proj.b[0].shape[-2]
    outs = [row_sum(h[..., j * rank:(j + 1) * rank, None] * b[adapters][:, None], axis=-2)
            for j, b in enumerate(proj.b)]
    delta = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)  # [rows, Q, out]
    return (y.astype(jnp.float32) + delta).astype(y.dtype)
