"""The attentions a step can run, each one function over a layer's slab of the KV arena (`LayerKV`: its full buffer
or its ring, engine/arena.py), and `attend`, which picks one.

Each reads only its row's own lane, so a row's bits never depend on the rows beside it: `blocked_attention` (any wave
width, prefill chunks and waves), `kernel_decode_attention` (the CPU kernel, any wave width, in place) and
`dense_decode_attention` (XLA's or cuDNN's, full-width waves only, never over a ring: rules.attention_refusal).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxstation.engine.arena import LayerKV
from jaxstation.kernels import cpu_kernel
from jaxstation.kernels.rowwise import row_sum
from jaxstation.model.config import NO_WINDOW, ModelConfig
from jaxstation.model.layers import softcap, window_at
from jaxstation.model.quant import precision_for


def blocked_attention(cfg: ModelConfig, q: jax.Array, q_pos: jax.Array, kv: LayerKV, layer: jax.Array | int,
                      lanes: jax.Array, n_blocks: jax.Array, block: int) -> jax.Array:
    """Online-softmax attention of q over each row's arena lane, block by block (layer `layer`, its slab `kv`).

    q: [rows, Q, kv_heads, group, head_dim]; q_pos: [rows, Q]; lanes: [rows] -> [rows, Q, heads * head_dim].
    Any number of query rows (prefill chunks and decode waves), any wave width. A block fully masked for a row leaves
    that row's running state untouched (`where`, not arithmetic), so how many blocks a wave runs never changes a row's
    bits: a windowed layer starts at the first block any row's window reaches. A ring's logical block is a contiguous
    run of its slots, read in the same order and shape as the full buffer's, so both give a row the same bits.
    """
    rows, nq = q.shape[:2]
    kvh, hd = cfg.num_kv_heads, cfg.head_dim
    scale = 1.0 / jnp.sqrt(jnp.float32(hd)) if cfg.query_scale is None else jnp.float32(cfg.query_scale)
    stat_shape = (rows, nq, kvh, cfg.group_size)
    precision = precision_for(q.dtype)
    window = window_at(cfg, layer)

    def body(b, carry):
        m, denom, acc = carry  # [rows, Q, kvh, group], same, [rows, Q, kvh, group, hd]
        k_pos = b * block + jnp.arange(block, dtype=jnp.int32)
        kb, vb = kv.read(lanes[:, None], kv.block_slots(b, block)[None, :], q.dtype)  # [rows, block, kvh, hd]
        s = jnp.einsum("rqkgd,rbkd->rqkgb", q, kb, preferred_element_type=jnp.float32, precision=precision) * scale
        s = softcap(s, cfg.attn_softcap)
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [rows, Q, block]
        if window is not None:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
        s = jnp.where(mask[:, :, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        denom_new = alpha * denom + row_sum(p)
        acc_new = alpha[..., None] * acc + jnp.einsum("rqkgb,rbkd->rqkgd", p.astype(vb.dtype), vb,
                                                      preferred_element_type=jnp.float32, precision=precision)
        live = jnp.any(mask, axis=-1)[:, :, None, None]  # [rows, Q, 1, 1]
        return (jnp.where(live, m_new, m), jnp.where(live, denom_new, denom), jnp.where(live[..., None], acc_new, acc))

    init = (jnp.full(stat_shape, -jnp.inf, jnp.float32), jnp.zeros(stat_shape, jnp.float32),
            jnp.zeros((*stat_shape, hd), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(first_block(q_pos, window, block), n_blocks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.astype(q.dtype).reshape(rows, nq, cfg.num_heads * hd)


def dense_decode_attention(cfg: ModelConfig, q: jax.Array, q_pos: jax.Array, k: jax.Array, v: jax.Array,
                            implementation: str) -> jax.Array:
    """One query per lane over that lane's whole slab, masked to its own length, in one fused call
    (`jax.nn.dot_product_attention`, "xla" or "cudnn"): full-width decode waves only (row r is lane r), never over a
    ring.

    q: [lanes, heads, hd]; q_pos: [lanes]; k, v: [lanes, max_seq, kv_heads, hd] -> [lanes, heads * hd]. The
    shapes never change, so neither do a lane's bits; what lies past a lane's length is masked, never read into it.
    """
    out = jax.nn.dot_product_attention(q[:, None], k, v, scale=cfg.query_scale or 1.0 / cfg.head_dim ** 0.5,
                                       key_value_seq_lengths=q_pos + 1, implementation=implementation)
    return out.reshape(q.shape[0], cfg.num_heads * cfg.head_dim)


def first_block(q_pos: jax.Array, window: jax.Array | int | None, block: int) -> jax.Array | int:
    """The first KV block any row's window reaches (0 without a window): the blocks before it are masked for every
    row. q_pos: [rows, Q]."""
    if window is None:
        return 0
    return jnp.maximum(jnp.min(q_pos) - window + 1, 0) // block


def kernel_decode_attention(cfg: ModelConfig, q: jax.Array, q_pos: jax.Array, kv: LayerKV, layer: jax.Array | int,
                            lanes: jax.Array) -> jax.Array:
    """The CPU decode attention kernel (kernels/cpu_kernel.py), each row reading its own lane's positions in place
    (around a ring, in position order; float32, bfloat16 or int8 KV, widened as `LayerKV.read` widens it): any wave
    width, and a prefill chunk's rows. q: [rows, heads, hd]; q_pos, lanes: [rows] -> [rows, heads * hd]. The window is
    an attribute of the kernel's call: in a stacked walk a layer's comes from a choice of two calls."""

    def call(window: int | None) -> jax.Array:
        b = kv.buffers  # float32, bfloat16 or int8 with its scales, read in place
        return cpu_kernel.decode_attention(q, b.k, b.v, kv.index, lanes, q_pos, window, cfg.query_scale, kv.ring,
                                           kv.scratch_pos, k_scale=b.k_scale, v_scale=b.v_scale)

    window = window_at(cfg, layer)
    if window is None or isinstance(window, int):
        o = call(window)
    else:
        o = jax.lax.cond(window < NO_WINDOW, lambda: call(cfg.sliding_window), lambda: call(None))
    return o.reshape(q.shape[0], cfg.num_heads * cfg.head_dim)


def attend(cfg: ModelConfig, attention: str, q: jax.Array, positions: jax.Array, kv: LayerKV,
           layer: jax.Array | int, lanes: jax.Array, n_blocks: jax.Array, block: int) -> jax.Array:
    """q: [rows, Q, heads, hd]; positions: [rows, Q] -> [rows, Q, heads * hd]. With "kernel" every query row, a
    decode row or each of a prefill chunk's Q rows, attends through the decode attention kernel over its own lane's
    positions up to its own (the step wrote every row's k and v first), so a prompt position gets the same bits
    whether a prefill chunk, a packed step or a decode wave feeds it. Otherwise a prefill chunk (Q > 1) walks KV
    blocks and a decode wave runs `attention` ("blocked", or a dense implementation, "xla" or "cudnn")."""
    rows, nq = q.shape[:2]
    if attention == "kernel":
        flat = q.reshape(rows * nq, *q.shape[2:])
        row_lanes = jnp.repeat(lanes, nq)  # each query row on its row's lane
        o = kernel_decode_attention(cfg, flat, positions.reshape(rows * nq), kv, layer, row_lanes)
        return o.reshape(rows, nq, cfg.num_heads * cfg.head_dim)
    if nq == 1 and attention != "blocked":
        k, v = kv.read(slice(None), slice(None), q.dtype)  # [lanes, max_seq, kvh, hd]
        return dense_decode_attention(cfg, q[:, 0], positions[:, 0], k, v, attention)[:, None]
    q = q.reshape(rows, nq, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
    return blocked_attention(cfg, q, positions, kv, layer, lanes, n_blocks, block)
