"""The compiled steps over the KV arena: `step_rows` (one token per row: a decode wave, or a packed step of prompt
pieces and decode rows) and `prefill_chunk` (a fixed-size chunk of one lane's prompt, optionally scoring every prompt
row for `echo`).

Batch invariance is built in, not tested in: shapes are fixed per station (lanes, chunk, block), so every request goes
through the same compiled programs; rows never mix (matmuls, norms and sampling are row-wise, and each attention,
engine/attention.py, reads only a row's own lane); a decode wave runs narrower than the arena only when every matmul
runs on the CPU kernel, whose rows are computed alike at any width. An idle row is pointed at the arena's last slot
(`scratch_pos`), which no request ever uses. With `penalties`, a step picks each token from its penalized logits and
counts it in the arena's token state (engine/penalties.py): row-wise too, one program for rows with and without them.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxstation.engine.arena import KVArena
from jaxstation.engine.attention import attend
from jaxstation.engine.penalties import PenaltyArrays, sample_penalized
from jaxstation.engine.sampling import SampleOut, SamplingArrays, sample, token_logprobs
from jaxstation.kernels.rowwise import log_softmax
from jaxstation.model.config import ModelConfig
from jaxstation.model.layers import (
    Params,
    attn_out,
    embed_tokens,
    lm_logits,
    mlp_block,
    over_layers,
    qkv_proj,
    rotary,
    rotary_at,
)


def run_layers(cfg: ModelConfig, params: Params, arena: KVArena, x: jax.Array, positions: jax.Array,
               lanes: jax.Array, n_blocks: jax.Array, block: int, adapters: jax.Array | None = None, *,
               attention: str = "blocked") -> tuple[jax.Array, KVArena]:
    """Run every layer over rows of arena `lanes`: write their k/v at `positions`, attend, MLP.

    x: [rows, Q, d]; positions: [rows, Q] int32 (consecutive within a row); lanes: [rows] int32 (one lane for a
    prefill chunk). attention: the step's attention (`attention.attend`; with "kernel" a prefill chunk's rows attend
    through the decode attention kernel too). Each layer writes to and reads
    from its kind's buffer (`KVArena.layer`: the full one, or a windowed layer's ring). adapters: [rows] int32, each
    row's LoRA slot (model/lora.py), or None where the station serves no adapters.
    """
    rots = rotary(cfg, positions)

    def body(i, layer, carry):
        x, arena = carry
        q, k, v = qkv_proj(cfg, layer, x, rotary_at(cfg, rots, i), adapters)  # [rows, Q, heads|kvh, hd]
        # k and v are computed whole before they are written: fused into the arena's scatter, XLA 0.11+ on CPU
        # computes them differently at different wave widths (a row's bits changed between 1 and 4 rows)
        k, v = jax.lax.optimization_barrier((k, v))
        kv = arena.layer(i).write(lanes, positions, k, v)
        o = attend(cfg, attention, q, positions, kv, i, lanes, n_blocks, block)
        return mlp_block(cfg, layer, attn_out(cfg, layer, x, o, adapters), adapters), arena.with_layer(i, kv)

    return over_layers(params, body, (x, arena))


def choose(logits: jax.Array, sampling: SamplingArrays, arena: KVArena, lanes: jax.Array,
           penalties: PenaltyArrays | None) -> tuple[SampleOut, KVArena]:
    """Sample each row of logits [rows, vocab] (rows on arena `lanes` [rows]), penalized when `penalties` are given."""
    if penalties is None:
        return sample(logits, sampling), arena
    out, tokens = sample_penalized(logits, sampling, arena.tokens, lanes, penalties)
    return out, dataclasses.replace(arena, tokens=tokens)


@partial(jax.jit, static_argnames=("cfg", "block", "attention", "return_logits"), donate_argnames=("arena",))
def step_rows(cfg: ModelConfig, params: Params, arena: KVArena, positions: jax.Array, tokens: jax.Array,
              n_blocks: jax.Array, sampling: SamplingArrays, lanes: jax.Array | None = None,
              penalties: PenaltyArrays | None = None, picks: jax.Array | None = None,
              adapters: jax.Array | None = None, *, block: int,
              attention: str = "blocked", return_logits: bool = False
              ) -> tuple[KVArena, SampleOut, jax.Array | None]:
    """Feed one token per row into its lane with one read of the weights: a decode wave, or a packed step.

    positions, tokens: [rows] int32 (an idle row sits at the scratch slot); n_blocks: KV blocks covering the
    longest live row (unused by the dense attentions); lanes: [rows] int32, the arena lane of each row, or None for
    a full-width wave (row r is lane r); penalties: per sampled row, or None for none (the arena then needs no token
    state). Returns the updated arena, one sample per sampled row and, if asked, the model's logits [sampled, vocab].

    picks: [slots] int32, the rows to sample from (default: every row). With picks, rows of one lane may share the
    step at consecutive positions (a packed admission step: prompt pieces of several lanes, and decode rows): every
    row writes its k/v before any row attends, and each attends only to its lane's positions up to its own.
    adapters: [rows] int32, each row's LoRA slot, or None where the station serves no adapters.
    """
    rows = tokens.shape[0]
    if lanes is None:
        lanes = jnp.arange(rows, dtype=jnp.int32)
    elif attention not in ("blocked", "kernel"):
        raise ValueError(f"attention={attention!r} runs full-width waves only")
    x = embed_tokens(cfg, params, tokens)[:, None, :]  # [rows, 1, d]
    x, arena = run_layers(cfg, params, arena, x, positions[:, None], lanes, n_blocks, block, adapters,
                          attention=attention)
    h = x[:, 0] if picks is None else x[picks, 0]  # [slots, d]
    logits = lm_logits(cfg, params, h)  # [slots, vocab]
    out, arena = choose(logits, sampling, arena, lanes if picks is None else lanes[picks], penalties)
    return arena, out, (logits if return_logits else None)


@partial(jax.jit, static_argnames=("cfg", "block", "last", "return_logits", "prompt_logprobs", "attention"),
         donate_argnames=("arena",))
def prefill_chunk(cfg: ModelConfig, params: Params, arena: KVArena, lane: jax.Array, start: jax.Array,
                  tokens: jax.Array, n_valid: jax.Array, sampling: SamplingArrays, targets: jax.Array | None = None,
                  penalties: PenaltyArrays | None = None, adapter: jax.Array | None = None, *, block: int, last: bool,
                  return_logits: bool = False,
                  prompt_logprobs: bool = False, attention: str = "blocked"
                  ) -> tuple[KVArena, SampleOut | None, jax.Array | None, SampleOut | None]:
    """Write one chunk of a lane's prompt into the arena: tokens [chunk] at positions [start, start + chunk).

    Rows past n_valid are padding; their k/v land past the prompt, where they are overwritten before any read.
    With `last`, also sample from the logits of the last valid row (sampling and penalty arrays have one row).
    With `prompt_logprobs`, also score every row: the log-softmax log-probability of targets [chunk] (the next prompt
    token of each row; the host ignores rows that have none) and the top TOP_LOGPROBS tokens. The [chunk, vocab]
    logits stay on the device; only [chunk] and [chunk, TOP_LOGPROBS] arrays come back. adapter: the lane's LoRA
    slot (int32), or None where the station serves no adapters. attention: the engine's decode attention; with
    "kernel" each row attends as a packed step's row does, so the chunk gives its positions a packed step's bits.
    """
    chunk = tokens.shape[0]
    positions = (start + jnp.arange(chunk, dtype=jnp.int32))[None]  # [1, chunk]
    n_blocks = (start + n_valid + block - 1) // block
    x = embed_tokens(cfg, params, tokens)[None]  # [1, chunk, d]
    x, arena = run_layers(cfg, params, arena, x, positions, jnp.reshape(lane, (1,)), n_blocks, block,
                          None if adapter is None else jnp.reshape(adapter, (1,)), attention=attention)
    scored = None
    if prompt_logprobs:
        logprobs = log_softmax(lm_logits(cfg, params, x[0]))  # [chunk, vocab], never leaves
        scored = token_logprobs(logprobs, targets)
    if not last:
        return arena, None, None, scored
    h = jax.lax.dynamic_index_in_dim(x[0], n_valid - 1, axis=0, keepdims=True)  # [1, d]
    logits = lm_logits(cfg, params, h)  # [1, vocab]
    out, arena = choose(logits, sampling, arena, jnp.reshape(lane, (1,)), penalties)
    return arena, out, (logits if return_logits else None), scored
