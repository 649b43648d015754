"""The KV arena: k and v for every layer, lane and position, allocated once and donated through every step, and the
per-lane token state that penalties, logit biases and min_tokens read (engine/penalties.py).

One preallocated set of buffers per layer kind (`KVBuffers`: k and v, and in int8 a float32 scale per position and
head). Global layers keep every position of a lane (`full`). Where the model has a sliding window shorter than the
context, its windowed layers keep a ring (`rings`): `ring` slots per
lane, position p at slot p mod ring, plus one scratch slot (slot `ring`) for the idle rows that the full buffer's
last position serves. A step writes at most `span` positions of a lane before any of them attends (a prefill chunk,
a packed piece, a verify step's drafts), so a ring of at least window + span - 1 slots still holds every position a
row reads, and rounded up to the KV block a logical block is a contiguous run of slots: each attention reads a
ring's blocks in the order and shapes it reads the full buffer's, so a row's bits are the same either way
(engine/attention.py). The decode thread owns the arena (docs/design.md).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxstation.engine.choices import KV_DTYPES, KV_WINDOWS
from jaxstation.engine.penalties import TokenState, allocate_token_state
from jaxstation.model.config import ModelConfig
from jaxstation.model.sharding import arena_sharding, replicated


def kv_dtype_of(kv_dtype: str, activations: jnp.dtype) -> jnp.dtype:
    """The arena's dtype: `kv_dtype`, or the activations' for "auto". k and v are cast to it when written (int8:
    quantized with a float32 scale per position and head), and read back in the activations' dtype."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return jnp.dtype(activations if kv_dtype == "auto" else kv_dtype)


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "k_scale", "v_scale"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVBuffers:
    """One layer kind's k and v, and in int8 their scales: a value is k * k_scale[..., None]."""

    k: jax.Array  # [layers of this kind, lanes, slots, kv_heads, head_dim]
    v: jax.Array  # [layers of this kind, lanes, slots, kv_heads, head_dim]
    k_scale: jax.Array | None = None  # [layers of this kind, lanes, slots, kv_heads] float32; None unless int8
    v_scale: jax.Array | None = None  # [layers of this kind, lanes, slots, kv_heads] float32


@partial(jax.tree_util.register_dataclass, data_fields=["full", "tokens", "rings"], meta_fields=["windowed"])
@dataclasses.dataclass(frozen=True)
class KVArena:
    full: KVBuffers  # the global layers': [global layers, lanes, max_seq, kv_heads, head_dim]
    tokens: TokenState | None = None  # [lanes, vocab] rows per lane; None where no step samples (a mesh stage)
    rings: KVBuffers | None = None  # the windowed layers': [windowed layers, lanes, ring + 1, ...]; None: no ring
    windowed: tuple[bool, ...] = ()  # per layer: whether it keeps a ring; (): none does

    @property
    def k(self) -> jax.Array:
        return self.full.k

    @property
    def v(self) -> jax.Array:
        return self.full.v

    @property
    def lanes(self) -> int:
        return self.full.k.shape[1]

    @property
    def max_seq(self) -> int:
        return self.full.k.shape[2]

    @property
    def ring(self) -> int:
        """Slots per lane of the windowed layers' ring (without its scratch slot); 0 without a ring."""
        return 0 if self.rings is None else self.rings.k.shape[2] - 1

    @property
    def nbytes(self) -> int:
        """Bytes of k, v and their scales, both kinds."""
        return sum(a.nbytes for a in jax.tree_util.tree_leaves((self.full, self.rings)))

    def layer(self, i: jax.Array | int) -> LayerKV:
        """Layer i's view: a Python index, or a traced one where every layer is of one kind."""
        if not self.windowed:
            return LayerKV(self.full, i, 0, self.max_seq - 1)
        if not isinstance(i, int):
            if not all(self.windowed):
                raise ValueError("a traced layer index needs every layer of one kind (the unrolled walk)")
            return LayerKV(self.rings, i, self.ring, self.max_seq - 1)
        if self.windowed[i]:
            return LayerKV(self.rings, sum(self.windowed[:i]), self.ring, self.max_seq - 1)
        return LayerKV(self.full, i - sum(self.windowed[:i]), 0, self.max_seq - 1)

    def with_layer(self, i: jax.Array | int, kv: LayerKV) -> KVArena:
        """The arena with layer i's buffers replaced by `kv`'s (after a write)."""
        if self.windowed and (not isinstance(i, int) or self.windowed[i]):
            return dataclasses.replace(self, rings=kv.buffers)
        return dataclasses.replace(self, full=kv.buffers)


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> (int8 [..., head_dim], float32 scale [...]): each head's largest magnitude maps to 127.
    Elementwise but for the max over one head, which is exact in any order: a row's bits depend on nothing else."""
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / 127.0
    q = jnp.round(xf / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


@dataclasses.dataclass(frozen=True)
class LayerKV:
    """One layer's slab of the arena: its kind's buffers and its index there. ring 0: slot = position; else slot =
    position mod ring, and the scratch position at slot `ring`."""

    buffers: KVBuffers
    index: jax.Array | int
    ring: int
    scratch_pos: int

    def slots(self, positions: jax.Array) -> jax.Array:
        """The slots of `positions` (any shape, int32)."""
        if not self.ring:
            return positions
        return jnp.where(positions == self.scratch_pos, self.ring, positions % self.ring)

    def block_slots(self, b: jax.Array, block: int) -> jax.Array:
        """The slots [block] of logical KV block b: contiguous, since the ring is a whole number of blocks."""
        start = b * block if not self.ring else (b * block) % self.ring
        return start + jnp.arange(block, dtype=jnp.int32)

    def read(self, lanes: jax.Array | slice, slots: jax.Array | slice, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """k and v at [lanes, slots] (indices that broadcast, or slices) of this layer, as `dtype`."""
        b, at = self.buffers, (self.index, lanes, slots)
        k, v = b.k[at].astype(dtype), b.v[at].astype(dtype)
        if b.k_scale is None:
            return k, v
        return k * b.k_scale[at][..., None].astype(dtype), v * b.v_scale[at][..., None].astype(dtype)

    def write(self, lanes: jax.Array, positions: jax.Array, k: jax.Array, v: jax.Array) -> LayerKV:
        """Write k, v [rows, Q, kv_heads, hd] of rows at lanes [rows], positions [rows, Q]."""
        b = self.buffers
        (k, ks), (v, vs) = (quantize(k), quantize(v)) if b.k_scale is not None else ((k, None), (v, None))
        if positions.shape[1] == 1 or self.ring:  # one position per row, or a chunk that may wrap around the ring
            one = positions.shape[1] == 1  # else a prefill chunk: one lane's run of positions, scattered to slots
            at = (self.index, lanes, self.slots(positions[:, 0])) if one else (self.index, lanes[0],
                                                                                self.slots(positions[0]))

            def put(buf: jax.Array | None, x: jax.Array | None) -> jax.Array | None:
                return None if buf is None else buf.at[at].set((x[:, 0] if one else x[0]).astype(buf.dtype))
        else:  # a prefill chunk: one lane, a contiguous run of positions
            def put(buf: jax.Array | None, x: jax.Array | None) -> jax.Array | None:
                if buf is None:
                    return None
                start = (self.index, lanes[0], positions[0, 0]) + (0,) * (buf.ndim - 3)
                return jax.lax.dynamic_update_slice(buf, x[None].astype(buf.dtype), start)
        new = KVBuffers(put(b.k, k), put(b.v, v), put(b.k_scale, ks), put(b.v_scale, vs))
        return dataclasses.replace(self, buffers=new)


def ring_size(cfg: ModelConfig, max_seq: int, block: int, span: int) -> int:
    """Slots per lane of a windowed layer's ring: window + span - 1 rounded up to the block, where a step writes at
    most `span` positions of one lane; 0 (no ring) without a window, or where the ring would not be shorter than
    max_seq."""
    if cfg.sliding_window is None:
        return 0
    ring = -(-(cfg.sliding_window + span - 1) // block) * block
    return ring if ring < max_seq else 0


def windowed_layers(cfg: ModelConfig, ring: int, layer_loop: str) -> tuple[bool, ...]:
    """Which layers keep a ring of `ring` slots: the windowed ones, where there is a ring and the layer walk indexes
    layers by Python ints (unrolled), or every layer is windowed; () otherwise."""
    if not ring:
        return ()
    windowed = tuple(cfg.is_local(i) for i in range(cfg.num_layers))
    return windowed if layer_loop == "unroll" or all(windowed) else ()


def arena_layout(cfg: ModelConfig, max_seq: int, block: int, kv_windows: str, layer_loop: str, *, chunk: int,
                 budget: int, verify_rows: int) -> tuple[int, tuple[bool, ...]]:
    """(ring, windowed) of an engine of these settings: "full" or nothing to gain keeps every position (0, ()). A
    step writes at most max(chunk, budget, verify_rows) positions of one lane."""
    if kv_windows not in KV_WINDOWS:
        raise ValueError(f"kv_windows must be one of {KV_WINDOWS}, got {kv_windows!r}")
    ring = ring_size(cfg, max_seq, block, max(chunk, budget, verify_rows)) if kv_windows == "ring" else 0
    windowed = windowed_layers(cfg, ring, layer_loop)
    return (ring if windowed else 0), windowed


def buffer_shapes(cfg: ModelConfig, lanes: int, max_seq: int, ring: int, windowed: tuple[bool, ...]
                  ) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The shapes of the global buffer and of the ring (None without one)."""
    n_ring = sum(windowed)
    heads = (cfg.num_kv_heads, cfg.head_dim)
    full = (cfg.num_layers - n_ring, lanes, max_seq, *heads)
    return full, ((n_ring, lanes, ring + 1, *heads) if windowed else None)


def arena_bytes(cfg: ModelConfig, lanes: int, max_seq: int, dtype: jnp.dtype, ring: int = 0,
                windowed: tuple[bool, ...] = ()) -> int:
    """Bytes the arena (k and v, both kinds, and in int8 a float32 scale per position and head) takes."""
    shapes = [s for s in buffer_shapes(cfg, lanes, max_seq, ring, windowed) if s is not None]
    per_head = cfg.head_dim * jnp.dtype(dtype).itemsize + (4 if jnp.dtype(dtype) == jnp.int8 else 0)
    return 2 * sum(int(np.prod(s[:-1])) for s in shapes) * per_head


def _zeros(shape: tuple[int, ...], dtype: jnp.dtype) -> KVBuffers:
    scales = (jnp.zeros(shape[:-1], jnp.float32), jnp.zeros(shape[:-1], jnp.float32)) if dtype == jnp.int8 else ()
    return KVBuffers(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), *scales)


def allocate_arena(cfg: ModelConfig, lanes: int, max_seq: int, dtype: jnp.dtype, token_state: bool = False,
                   mesh: Mesh | None = None, ring: int = 0, windowed: tuple[bool, ...] = ()) -> KVArena:
    """Zeros; with `token_state`, also the lanes' TokenState (9 bytes per lane and vocabulary entry); with `windowed`
    layers, their ring of `ring` slots. On a `mesh`, k, v and their scales are split by KV heads and the token state
    is replicated (model/sharding.py)."""
    full, ring_shape = buffer_shapes(cfg, lanes, max_seq, ring, windowed)
    tokens = allocate_token_state(lanes, cfg.vocab_size) if token_state else None
    arena = KVArena(_zeros(full, dtype), tokens, None if ring_shape is None else _zeros(ring_shape, dtype), windowed)
    if mesh is None:
        return arena
    return dataclasses.replace(arena, full=_placed(arena.full, mesh), rings=_placed(arena.rings, mesh),
                               tokens=jax.device_put(tokens, replicated(mesh)))


def _placed(buffers: KVBuffers | None, mesh: Mesh) -> KVBuffers | None:
    return jax.tree_util.tree_map(lambda a: jax.device_put(a, arena_sharding(mesh, a.ndim)), buffers)


@partial(jax.jit, static_argnums=3)
def _read_span(buffers: KVBuffers, lane: jax.Array, start: jax.Array, span: int) -> KVBuffers:
    """Positions [start, start + span) of `lane` in every leaf of `buffers`: [layers, span, ...] each."""
    return jax.tree_util.tree_map(
        lambda a: jax.lax.dynamic_slice(a, (0, lane, start) + (0,) * (a.ndim - 3), (a.shape[0], 1, span,
                                                                                    *a.shape[3:]))[:, 0], buffers)


@partial(jax.jit, donate_argnums=0)
def _write_span(buffers: KVBuffers, lane: jax.Array, start: jax.Array, rows: KVBuffers) -> KVBuffers:
    """`buffers` with `rows` ([layers, span, ...] each) written at positions [start, start + span) of `lane`."""
    def put(a: jax.Array, r: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(a, r[:, None].astype(a.dtype), (0, lane, start) + (0,) * (a.ndim - 3))
    return jax.tree_util.tree_map(put, buffers, rows)


def read_prefix(buffers: KVBuffers, lane: int, n: int, span: int) -> KVBuffers:
    """A host (numpy) copy of positions [0, n) of `lane` in every leaf (k, v and any scales), read `span` positions
    per call of one compiled program; n must be a multiple of span."""
    parts = [jax.device_get(_read_span(buffers, np.int32(lane), np.int32(s), span)) for s in range(0, n, span)]
    return jax.tree_util.tree_map(lambda *a: np.concatenate(a, axis=1), *parts)


def write_prefix(buffers: KVBuffers, lane: int, kv: KVBuffers, n: int, span: int) -> KVBuffers:
    """`buffers` (donated) with positions [0, n) of the host copy `kv` (`read_prefix`) written into `lane`, `span`
    positions per call of one compiled program; n must be a multiple of span."""
    for s in range(0, n, span):
        rows = jax.tree_util.tree_map(lambda a, s=s: a[:, s:s + span], kv)
        buffers = _write_span(buffers, np.int32(lane), np.int32(s), rows)
    return buffers


@partial(jax.jit, static_argnums=3)
def _read_window(rings: KVBuffers, lane: jax.Array, end: jax.Array, count: int) -> KVBuffers:
    """The ring slots of positions [end - count, end) of `lane` in every leaf: [layers, count, ...] each."""
    slots = (end - count + jnp.arange(count, dtype=jnp.int32)) % (rings.k.shape[2] - 1)
    return jax.tree_util.tree_map(lambda a: a[:, lane, slots], rings)


@partial(jax.jit, donate_argnums=0)
def _write_window(rings: KVBuffers, lane: jax.Array, end: jax.Array, rows: KVBuffers) -> KVBuffers:
    """`rings` with `rows` ([layers, count, ...] each) written at the ring slots of positions [end - count, end)."""
    count = rows.k.shape[1]
    slots = (end - count + jnp.arange(count, dtype=jnp.int32)) % (rings.k.shape[2] - 1)
    return jax.tree_util.tree_map(lambda a, r: a.at[:, lane, slots].set(r.astype(a.dtype)), rings, rows)


def read_window(rings: KVBuffers, lane: int, end: int, count: int) -> KVBuffers:
    """A host (numpy) copy of the ring slots that hold positions [max(0, end - count), end) of `lane` (every leaf),
    in position order, as stored: one compiled program of `count` positions, those below 0 cut off after it."""
    copy = jax.device_get(_read_window(rings, np.int32(lane), np.int32(end), count))
    return jax.tree_util.tree_map(lambda a: a[:, max(0, count - end):].copy(), copy)


def write_window(rings: KVBuffers, lane: int, end: int, window: KVBuffers, count: int) -> KVBuffers:
    """`rings` (donated) with a host copy (`read_window` of `count`) written back into the slots of its positions,
    which are where the ring keeps them for a restart at `end` (slot = position mod ring). The copy is padded back to
    `count` positions (one program): the slots of positions below 0 get zeros, which a restart at `end` never reads."""
    window = jax.tree_util.tree_map(lambda a: np.pad(a, [(0, 0), (count - a.shape[1], 0)] + [(0, 0)] * (a.ndim - 2)),
                                    window)
    return _write_window(rings, np.int32(lane), np.int32(end), window)


def restore_lane(arena: KVArena, lane: int, kv: KVBuffers, n: int, span: int, window: KVBuffers | None = None,
                 count: int = 0) -> KVArena:
    """`arena` (donated) with host copies written back into `lane`: its global layers' KV at [0, n) (`read_prefix`)
    and, given `window`, its rings' window before n (`read_window` of `count`)."""
    full = write_prefix(arena.full, lane, kv, n, span)
    rings = arena.rings if window is None else write_window(arena.rings, lane, n, window, count)
    return dataclasses.replace(arena, full=full, rings=rings)
