"""The compiled steps over the KV arena: `decode_step_batch` (one token for every lane) and `prefill_chunk` (a
fixed-size chunk of one lane's prompt, optionally scoring every prompt row for `echo`).

Batch invariance is built in, not tested in:
- shapes are fixed per station (lanes, chunk, block), so every request goes through the same compiled programs;
- rows never mix: matmuls, norms and sampling are row-wise and attention reads only the row's own lane;
- attention walks fixed-size KV blocks with an online softmax. The number of blocks follows the longest live lane,
  and a block that is fully masked for a row leaves that row's running state untouched (`where`, not arithmetic),
  so how many blocks a wave runs never changes a row's bits;
- a decode wave may run narrower than the arena (a few rows gathered from chosen lanes) only when every matmul runs
  on the CPU kernel, whose rows are computed alike at any width (jaxstation/kernels/cpu_kernel.py); the other row-wise
  operations do not depend on the row count.
An idle row is pointed at the arena's last slot (`scratch_pos`), which no request ever uses.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxstation.engine.arena import KVArena
from jaxstation.engine.sampling import SampleOut, SamplingArrays, sample, token_logprobs
from jaxstation.kernels import cpu_kernel
from jaxstation.kernels.rowwise import log_softmax, row_sum
from jaxstation.model.config import ModelConfig
from jaxstation.model.layers import Params, attn_out, embed_tokens, lm_logits, mlp_block, over_layers, qkv_proj
from jaxstation.model.quant import precision_for


def _blocked_attention(cfg: ModelConfig, q: jax.Array, q_pos: jax.Array, arena: KVArena, layer: jax.Array,
                       lanes: jax.Array, n_blocks: jax.Array, block: int) -> jax.Array:
    """Online-softmax attention of q over each row's arena lane, block by block.

    q: [rows, Q, kv_heads, group, head_dim]; q_pos: [rows, Q]; lanes: [rows] -> [rows, Q, heads * head_dim].
    """
    rows, nq = q.shape[:2]
    kvh, hd = cfg.num_kv_heads, cfg.head_dim
    scale = 1.0 / jnp.sqrt(jnp.float32(hd))
    stat_shape = (rows, nq, kvh, cfg.group_size)
    precision = precision_for(q.dtype)

    def body(b, carry):
        m, denom, acc = carry  # [rows, Q, kvh, group], same, [rows, Q, kvh, group, hd]
        k_pos = b * block + jnp.arange(block, dtype=jnp.int32)
        kb = arena.k[layer, lanes[:, None], k_pos[None, :]]  # [rows, block, kvh, hd]
        vb = arena.v[layer, lanes[:, None], k_pos[None, :]]
        s = jnp.einsum("rqkgd,rbkd->rqkgb", q, kb, preferred_element_type=jnp.float32, precision=precision) * scale
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [rows, Q, block]
        if cfg.sliding_window is not None:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - cfg.sliding_window
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
    _, denom, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.astype(q.dtype).reshape(rows, nq, cfg.num_heads * hd)


def _dense_decode_attention(cfg: ModelConfig, q: jax.Array, q_pos: jax.Array, k: jax.Array, v: jax.Array,
                            implementation: str) -> jax.Array:
    """One query per lane over that lane's whole slab, masked to its own length, in one fused call.

    q: [lanes, heads, hd]; q_pos: [lanes]; k, v: [lanes, max_seq, kv_heads, hd] -> [lanes, heads * hd]. The
    shapes never change, so neither do a lane's bits; what lies past a lane's length is masked, never read into it.
    """
    out = jax.nn.dot_product_attention(q[:, None], k, v, scale=1.0 / cfg.head_dim ** 0.5,
                                       key_value_seq_lengths=q_pos + 1, implementation=implementation)
    return out.reshape(q.shape[0], cfg.num_heads * cfg.head_dim)


def _layers(cfg: ModelConfig, params: Params, arena: KVArena, x: jax.Array, positions: jax.Array,
            lanes: jax.Array, n_blocks: jax.Array, block: int, *, attention: str = "blocked"
            ) -> tuple[jax.Array, KVArena]:
    """Run every layer over rows of arena `lanes`: write their k/v at `positions`, attend, MLP.

    x: [rows, Q, d]; positions: [rows, Q] int32 (consecutive within a row); lanes: [rows] int32 (one lane for a
    prefill chunk). attention: "blocked" (the online-softmax block walk), or for decode waves "kernel" (the CPU
    decode attention kernel, jaxstation/kernels/cpu_kernel.py) or, for full-width waves only (row r is lane r), a
    `jax.nn.dot_product_attention` implementation ("xla" or "cudnn").
    """
    rows, nq = x.shape[:2]
    inv_freq = jnp.asarray(cfg.inv_freq())

    def body(i, layer, carry):
        x, k_all, v_all = carry
        q, k, v = qkv_proj(cfg, layer, x, positions, inv_freq)  # [rows, Q, heads|kvh, hd]
        if nq == 1:  # decode: one position per lane, scattered
            k_all = k_all.at[i, lanes, positions[:, 0]].set(k[:, 0].astype(k_all.dtype))
            v_all = v_all.at[i, lanes, positions[:, 0]].set(v[:, 0].astype(v_all.dtype))
        else:  # prefill: one lane, a contiguous run of positions
            start = (i, lanes[0], positions[0, 0], 0, 0)
            k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), start)
            v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), start)
        if nq == 1 and attention == "kernel":
            o = cpu_kernel.decode_attention(q[:, 0], k_all, v_all, i, lanes, positions[:, 0], cfg.sliding_window)
            o = o.reshape(rows, 1, cfg.num_heads * cfg.head_dim)
        elif nq == 1 and attention != "blocked":
            o = _dense_decode_attention(cfg, q[:, 0], positions[:, 0], k_all[i], v_all[i], attention)[:, None]
        else:
            q = q.reshape(rows, nq, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
            o = _blocked_attention(cfg, q, positions, KVArena(k_all, v_all), i, lanes, n_blocks, block)
        return mlp_block(cfg, layer, attn_out(layer, x, o)), k_all, v_all

    x, k_all, v_all = over_layers(params, body, (x, arena.k, arena.v))
    return x, KVArena(k_all, v_all)


@partial(jax.jit, static_argnames=("cfg", "block", "attention", "return_logits"), donate_argnames=("arena",))
def decode_step_batch(cfg: ModelConfig, params: Params, arena: KVArena, positions: jax.Array, tokens: jax.Array,
                      n_blocks: jax.Array, sampling: SamplingArrays, lanes: jax.Array | None = None, *, block: int,
                      attention: str = "blocked", return_logits: bool = False
                      ) -> tuple[KVArena, SampleOut, jax.Array | None]:
    """Advance every row's lane by one token with one read of the weights.

    positions, tokens: [rows] int32 (an idle row sits at the scratch slot); n_blocks: KV blocks covering the
    longest live row (unused by the dense attentions); lanes: [rows] int32, the arena lane of each row, or None for
    a full-width wave (row r is lane r). Returns the updated arena, one sample per row and, if asked, the logits
    [rows, vocab].
    """
    rows = tokens.shape[0]
    if lanes is None:
        lanes = jnp.arange(rows, dtype=jnp.int32)
    elif attention not in ("blocked", "kernel"):
        raise ValueError(f"attention={attention!r} runs full-width waves only")
    x = embed_tokens(params, tokens)[:, None, :]  # [rows, 1, d]
    x, arena = _layers(cfg, params, arena, x, positions[:, None], lanes, n_blocks, block, attention=attention)
    logits = lm_logits(cfg, params, x[:, 0])  # [rows, vocab]
    return arena, sample(logits, sampling), (logits if return_logits else None)


@partial(jax.jit, static_argnames=("cfg", "block", "last", "return_logits", "prompt_logprobs"),
         donate_argnames=("arena",))
def prefill_chunk(cfg: ModelConfig, params: Params, arena: KVArena, lane: jax.Array, start: jax.Array,
                  tokens: jax.Array, n_valid: jax.Array, sampling: SamplingArrays, targets: jax.Array | None = None,
                  *, block: int, last: bool, return_logits: bool = False, prompt_logprobs: bool = False
                  ) -> tuple[KVArena, SampleOut | None, jax.Array | None, SampleOut | None]:
    """Write one chunk of a lane's prompt into the arena: tokens [chunk] at positions [start, start + chunk).

    Rows past n_valid are padding; their k/v land past the prompt, where they are overwritten before any read.
    With `last`, also sample from the logits of the last valid row (sampling arrays have one row).
    With `prompt_logprobs`, also score every row: the log-softmax log-probability of targets [chunk] (the next prompt
    token of each row; the host ignores rows that have none) and the top TOP_LOGPROBS tokens. The [chunk, vocab]
    logits stay on the device; only [chunk] and [chunk, TOP_LOGPROBS] arrays come back.
    """
    chunk = tokens.shape[0]
    positions = (start + jnp.arange(chunk, dtype=jnp.int32))[None]  # [1, chunk]
    n_blocks = (start + n_valid + block - 1) // block
    x = embed_tokens(params, tokens)[None]  # [1, chunk, d]
    x, arena = _layers(cfg, params, arena, x, positions, jnp.reshape(lane, (1,)), n_blocks, block)
    scored = None
    if prompt_logprobs:
        logprobs = log_softmax(lm_logits(cfg, params, x[0]))  # [chunk, vocab], never leaves
        scored = token_logprobs(logprobs, targets)
    if not last:
        return arena, None, None, scored
    h = jax.lax.dynamic_index_in_dim(x[0], n_valid - 1, axis=0, keepdims=True)  # [1, d]
    logits = lm_logits(cfg, params, h)  # [1, vocab]
    return arena, sample(logits, sampling), (logits if return_logits else None), scored
