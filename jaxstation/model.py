"""The Llama-family decoder in functional JAX: parameter pytree, layer pieces and the full-sequence oracle.

Weights are stored [in, out] so activations multiply on the left. Per-layer weights are stacked on a leading layer
axis; q/k/v and gate/up are fused so that each layer reads its weights in three matmuls plus the output projections.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxstation.config import ModelConfig


@partial(jax.tree_util.register_dataclass, data_fields=[
    "attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LayerParams:
    attn_norm: jax.Array  # [layers, d]
    wqkv: jax.Array  # [layers, d, (heads + 2 * kv_heads) * head_dim]
    wo: jax.Array  # [layers, heads * head_dim, d]
    mlp_norm: jax.Array  # [layers, d]
    w_gate_up: jax.Array  # [layers, d, 2 * ffn]
    w_down: jax.Array  # [layers, ffn, d]


@partial(jax.tree_util.register_dataclass, data_fields=["embed", "layers", "final_norm", "lm_head"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Params:
    embed: jax.Array  # [vocab, d]
    layers: LayerParams
    final_norm: jax.Array  # [d]
    lm_head: jax.Array | None  # [d, vocab]; None when tied to embed

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))


def layer_at(layers: LayerParams, i: jax.Array | int) -> LayerParams:
    """One layer's weights out of the stacked pytree."""
    return jax.tree_util.tree_map(lambda a: a[i], layers)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF's LlamaRMSNorm: normalise in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: [..., T, heads, head_dim]; positions: [..., T] int32; inv_freq: [head_dim // 2]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, head_dim // 2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., T, 1, head_dim]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def qkv_proj(cfg: ModelConfig, layer: LayerParams, x: jax.Array, positions: jax.Array, inv_freq: jax.Array):
    """Norm, fused q/k/v projection and RoPE. x: [..., T, d] -> q [..., T, heads, hd], k/v [..., T, kv_heads, hd]."""
    h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    qkv = h @ layer.wqkv
    nq, nk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    lead = x.shape[:-1]
    q = qkv[..., :nq].reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = qkv[..., nq:nq + nk].reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[..., nq + nk:].reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    return rope(q, positions, inv_freq), rope(k, positions, inv_freq), v


def mlp_block(cfg: ModelConfig, layer: LayerParams, x: jax.Array) -> jax.Array:
    """Residual SwiGLU block: x + down(silu(gate) * up)."""
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    gate_up = h @ layer.w_gate_up
    gate, up = gate_up[..., :cfg.intermediate_size], gate_up[..., cfg.intermediate_size:]
    return x + (jax.nn.silu(gate) * up) @ layer.w_down


def lm_logits(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    """Final norm and lm_head; float32 logits [..., vocab]."""
    h = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:
        logits = jax.lax.dot_general(h, params.embed, (((h.ndim - 1,), (1,)), ((), ())))
    else:
        logits = h @ params.lm_head
    return logits.astype(jnp.float32)


@partial(jax.jit, static_argnames=("cfg",))
def forward_full(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """The oracle: a plain causal forward over a whole sequence, no cache. tokens [T] -> logits [T, vocab]."""
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)
    inv_freq = jnp.asarray(cfg.inv_freq())
    qpos, kpos = positions[:, None], positions[None, :]
    mask = kpos <= qpos  # [T, T]
    if cfg.sliding_window is not None:
        mask &= kpos > qpos - cfg.sliding_window
    x = params.embed[tokens]  # [T, d]

    def body(i, x):
        layer = layer_at(params.layers, i)
        q, k, v = qkv_proj(cfg, layer, x, positions, inv_freq)
        q = q.reshape(t, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
        s = jnp.einsum("qkgd,skd->kgqs", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(cfg.head_dim)
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        o = jnp.einsum("kgqs,skd->qkgd", p.astype(v.dtype), v).reshape(t, cfg.num_heads * cfg.head_dim)
        return mlp_block(cfg, layer, x + o @ layer.wo)

    x = jax.lax.fori_loop(0, cfg.num_layers, body, x)
    return lm_logits(cfg, params, x)
