"""Tensor parallelism: a `Mesh` of N devices on one axis, and where each weight and the KV arena live on it.

Every device holds 1/N of the attention heads, of the KV heads and of the MLP's hidden dimension: q/k/v and gate/up
are split by their output columns, o and down by their input rows, so each device computes its own heads and its own
slice of the MLP, and XLA's SPMD partitioner adds one all-reduce after o and one after down (NCCL on GPUs, the CPU
client's collectives on CPU). The KV arena is split by KV heads, so each device keeps the k and v of its own heads.
The embedding and the LM head are split by vocabulary rows (`VOCAB_SHARDED`: bench/step.py measured it faster than
replicating them, and it saves each device (N - 1) / N of them); the norms and sampling are replicated. A compiled
step is an ordinary `jax.jit` over arrays that carry their `NamedSharding`: the same program and the same scheduler
run at any N.

The fused projections hold several matrices side by side (wqkv: q | k | v; w_gate_up: gate | up). Split into N
contiguous pieces, the first device would hold q's first columns and none of k. So at N > 1 the loader lays fused
columns out shard-major (`shard_major`): [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], piece i holding device i's heads, and a
step reads the pieces back with `split_fused`; at N = 1 both are the plain layout and the plain slices.

A model with fewer KV heads than devices (Gemma 3 270M: 1 KV head) keeps `kv_replicas` copies of each, as vLLM does:
the loader repeats each KV head's k and v columns, so the model it builds has N KV heads, device i holding a copy of
the one its query heads read (`replicated_kv`). Query head j still reads a copy of its own KV head, so the attention
is the same; the arena holds the copies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxstation.model.config import ModelConfig

AXIS = "tp"  # the mesh's one axis
VOCAB_SHARDED = True  # the embedding and the LM head split by vocabulary rows (True) or replicated
COLUMN_SPLIT = frozenset({"wqkv", "w_gate_up", "bqkv"})  # split on their last (output) axis
ROW_SPLIT = frozenset({"wo", "w_down"})  # split on their input axis ([..., in, out]); their scales replicated


def make_mesh(n: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh over the first `n` devices (default: every process's, `jax.devices()`)."""
    devices = list(jax.devices() if devices is None else devices)
    if n > len(devices):
        raise ValueError(f"a mesh of {n} devices needs {n} devices, {len(devices)} are visible")
    return Mesh(np.array(devices[:n]), (AXIS,))


def shard_major(w: np.ndarray, sizes: Sequence[int], shards: int) -> np.ndarray:
    """Fused columns w [..., sum(sizes)] (pieces of `sizes` side by side) -> shard-major: each piece cut into `shards`
    equal parts and shard i's parts of every piece side by side, shard by shard."""
    if shards == 1:
        return w
    pieces = np.split(np.asarray(w), np.cumsum(sizes)[:-1], axis=-1)
    parts = [np.split(p, shards, axis=-1) for p in pieces]
    return np.concatenate([part[i] for i in range(shards) for part in parts], axis=-1)


def natural_order(w: np.ndarray, sizes: Sequence[int], shards: int) -> np.ndarray:
    """The inverse of `shard_major`: fused columns w [..., sum(sizes)] laid out for `shards` devices, in the plain
    layout (the pieces side by side)."""
    if shards == 1:
        return w
    per = np.cumsum([s // shards for s in sizes])[:-1]
    blocks = [np.split(b, per, axis=-1) for b in np.split(np.asarray(w), shards, axis=-1)]
    return np.concatenate([blocks[i][j] for j in range(len(sizes)) for i in range(shards)], axis=-1)


def fused_sizes(cfg: ModelConfig, slot: str) -> tuple[int, ...] | None:
    """The pieces of a fused slot's columns (wqkv and bqkv: q, k, v; w_gate_up: gate, up), or None for another slot."""
    kv = cfg.num_kv_heads * cfg.head_dim
    return {"wqkv": (cfg.num_heads * cfg.head_dim, kv, kv), "bqkv": (cfg.num_heads * cfg.head_dim, kv, kv),
            "w_gate_up": (cfg.intermediate_size,) * 2}.get(slot)


def split_fused(y: jax.Array, sizes: Sequence[int], shards: int) -> list[jax.Array]:
    """The pieces of a fused projection's output y [..., sum(sizes)], laid out by `shard_major` for `shards`: each
    piece [..., size], its columns in their natural order."""
    if shards == 1:
        bounds = np.cumsum([0, *sizes])
        return [y[..., a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    lead = y.shape[:-1]
    y = y.reshape(*lead, shards, sum(sizes) // shards)  # [..., shards, per shard]
    out, at = [], 0
    for size in sizes:
        out.append(y[..., at:at + size // shards].reshape(*lead, size))
        at += size // shards
    return out


def kv_replicas(cfg: ModelConfig, shards: int) -> int:
    """Copies of each KV head a split over `shards` devices keeps: shards / KV heads where there are fewer KV heads
    than devices and they divide the devices, else 1."""
    kv = cfg.num_kv_heads
    return shards // kv if kv < shards and shards % kv == 0 else 1


def replicated_kv(cfg: ModelConfig, shards: int) -> ModelConfig:
    """`cfg` as the loader builds it for `shards` devices: `kv_replicas` copies of each KV head."""
    return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * kv_replicas(cfg, shards))


def indivisible(cfg: ModelConfig, shards: int) -> str | None:
    """Why a model of `cfg` cannot split over `shards` devices (a head count or the MLP width does not divide, its
    KV heads counted with their copies), or None."""
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", replicated_kv(cfg, shards).num_kv_heads),
                    ("MLP hidden size", cfg.intermediate_size)):
        if n % shards:
            return f"the model's {what} ({n}) do not divide by {shards} devices"
    return None


def slot_spec(slot: str, part: str, shape: Sequence[int], shards: int, vocab: bool = VOCAB_SHARDED) -> PartitionSpec:
    """Where a weight of `slot` (its `part`: "q", "scale", "w", or the slot itself) lives: split on one axis by its
    slot, or replicated; the embedding and the head split by vocabulary rows with `vocab`, where the vocabulary
    divides by `shards` (else whole)."""
    ndim, axis = len(shape), None
    if slot in COLUMN_SPLIT:
        axis = ndim - 1
    elif slot in ROW_SPLIT and part != "scale":
        axis = ndim - 2
    elif vocab and slot in ("embed", "lm_head"):
        axis = 0 if slot == "embed" else ndim - 1
        axis = axis if shape[axis] % shards == 0 else None
    return PartitionSpec(*(AXIS if a == axis else None for a in range(ndim)))


def _spec(path: tuple, leaf: jax.Array, vocab: bool, shards: int) -> PartitionSpec:
    """`slot_spec` of one weight leaf, its slot and part read from its path in the Params."""
    names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
    slot, part = names[-2] if len(names) > 1 and names[-1] in ("q", "scale", "w") else names[-1], names[-1]
    return slot_spec(slot, part, leaf.shape, shards, vocab)


def on_shards(slot: str, w: np.ndarray, mesh: Mesh | None) -> np.ndarray | jax.Array:
    """A host weight of `slot` ([..., in, out], or the embedding [vocab, d]) put straight onto `mesh` as `slot_spec`
    splits it: each device receives only its piece, so no device ever holds the whole weight. Without a mesh, `w`."""
    if mesh is None:
        return w
    w = np.asarray(w)
    return jax.device_put(w, NamedSharding(mesh, slot_spec(slot, "w", w.shape, mesh.size)))


def shard_params(params, mesh: Mesh, vocab: bool = VOCAB_SHARDED):
    """`params` (laid out by the loader for the mesh's size) placed on `mesh`, each leaf split as `_spec` says."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: jax.device_put(leaf, NamedSharding(mesh, _spec(path, leaf, vocab, mesh.size))), params)


def arena_sharding(mesh: Mesh, ndim: int = 5) -> NamedSharding:
    """The KV arena's k and v [layers, lanes, max_seq, kv_heads, head_dim], or their int8 scales (ndim 4, without
    head_dim): split by KV heads."""
    return NamedSharding(mesh, PartitionSpec(None, None, None, AXIS, *(None,) * (ndim - 4)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def mesh_of(tree) -> Mesh | None:
    """The mesh the arrays of `tree` are placed on, or None for arrays on one device."""
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return None


def device_bytes(tree) -> int:
    """Bytes of `tree` one device holds: its shard of each split leaf, the whole of each replicated one."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shards = getattr(leaf, "addressable_shards", None)
        total += shards[0].data.nbytes if shards else leaf.nbytes
    return total
