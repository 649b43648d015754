"""The KV arena: k and v for every layer, lane and position, allocated once and donated through every step, and the
per-lane token state that penalties, logit biases and min_tokens read (engine/penalties.py)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxstation.engine.penalties import TokenState, allocate_token_state
from jaxstation.model.config import ModelConfig
from jaxstation.model.sharding import arena_sharding, replicated


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "tokens"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVArena:
    k: jax.Array  # [layers, lanes, max_seq, kv_heads, head_dim]
    v: jax.Array  # [layers, lanes, max_seq, kv_heads, head_dim]
    tokens: TokenState | None = None  # [lanes, vocab] rows per lane; None where no step samples (a mesh stage)

    @property
    def lanes(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq(self) -> int:
        return self.k.shape[2]


def arena_shape(cfg: ModelConfig, lanes: int, max_seq: int) -> tuple[int, ...]:
    return (cfg.num_layers, lanes, max_seq, cfg.num_kv_heads, cfg.head_dim)


def arena_bytes(cfg: ModelConfig, lanes: int, max_seq: int, dtype: jnp.dtype) -> int:
    """Bytes the arena (k and v) takes."""
    n = 1
    for s in arena_shape(cfg, lanes, max_seq):
        n *= s
    return 2 * n * jnp.dtype(dtype).itemsize


def allocate_arena(cfg: ModelConfig, lanes: int, max_seq: int, dtype: jnp.dtype, token_state: bool = False,
                   mesh: Mesh | None = None) -> KVArena:
    """Zeros; with `token_state`, also the lanes' TokenState (9 bytes per lane and vocabulary entry). On a `mesh`, k and
    v are split by KV heads and the token state is replicated (model/sharding.py)."""
    shape = arena_shape(cfg, lanes, max_seq)
    tokens = allocate_token_state(lanes, cfg.vocab_size) if token_state else None
    arena = KVArena(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), tokens=tokens)
    if mesh is None:
        return arena
    kv = arena_sharding(mesh)
    return KVArena(k=jax.device_put(arena.k, kv), v=jax.device_put(arena.v, kv),
                   tokens=jax.device_put(tokens, replicated(mesh)))
