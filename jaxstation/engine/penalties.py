"""Penalties, logit biases, min_tokens and constraint masks on the device, from per-lane token state kept in the
arena and per-row inputs.

The state (`TokenState`) describes the request a lane runs: how often it has generated each token, which tokens its
prompt holds and which are its stop ids, and its logit bias; what a request asks for travels per row
(`PenaltyArrays`). Every operation is elementwise on a row and its own lane's state, so a row's bits never depend on
the wave. The whole pass runs under `lax.cond` on whether any row of the wave asks for it, and a row that asks for
nothing keeps its logits' bits (a per-row select), so a wave without controls pays two predicates and a count update
of one element per row, and never copies its logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxstation.engine.sampling import SampleOut, SamplingArrays, sample

MAX_LOGIT_BIAS = 300  # entries in one request's logit_bias, as OpenAI allows
PROMPT, HELD = 1, 2  # TokenState.marks bits: in the prompt; a stop id held back until min_tokens


@partial(jax.tree_util.register_dataclass, data_fields=["counts", "marks", "bias"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TokenState:
    counts: jax.Array  # [lanes, vocab] int32: how often the lane's request has generated each token
    marks: jax.Array  # [lanes, vocab] int8: PROMPT | HELD bits
    bias: jax.Array  # [lanes, vocab] float32: the request's logit_bias


def allocate_token_state(lanes: int, vocab: int) -> TokenState:
    return TokenState(counts=jnp.zeros((lanes, vocab), jnp.int32), marks=jnp.zeros((lanes, vocab), jnp.int8),
                      bias=jnp.zeros((lanes, vocab), jnp.float32))


@partial(jax.tree_util.register_dataclass,
         data_fields=["active", "presence", "frequency", "repetition", "min_tokens", "constrained", "mask"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PenaltyArrays:
    active: jax.Array  # [rows] bool: the row's lane state is its request's and the request asks for a control now
    presence: jax.Array  # [rows] float32; 0 = off
    frequency: jax.Array  # [rows] float32; 0 = off
    repetition: jax.Array  # [rows] float32; 1 = off
    min_tokens: jax.Array  # [rows] int32; 0 = off
    constrained: jax.Array  # [rows] bool: the row's tokens are limited to its mask
    mask: jax.Array  # [rows, words] int32: token t allowed iff bit t % 32 of word t // 32 (engine/constraints.py)


def lane_rows(vocab: int, prompt: Iterable[int], held: Iterable[int], logit_bias: Iterable[tuple[int, float]],
              allowed: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """A request's marks [vocab] int8 (its prompt tokens, and `held`: the stop ids min_tokens holds back) and its
    bias row [vocab] float32, built on the host: -inf outside `allowed` when that is not empty, plus the logit bias."""
    marks = np.zeros(vocab, np.int8)
    marks[np.fromiter(prompt, np.int64)] |= PROMPT
    marks[np.fromiter(held, np.int64)] |= HELD
    bias = np.zeros(vocab, np.float32)
    if allowed:
        bias[:] = -np.inf
        bias[np.asarray(allowed, np.int64)] = 0.0
    for token, value in logit_bias:
        bias[token] = value
    return marks, bias


@partial(jax.jit, donate_argnames=("state",))
def start_lane(state: TokenState, lane: jax.Array, marks: jax.Array, bias: jax.Array) -> TokenState:
    """A request takes `lane`: zero its counts, write its marks and bias rows ([vocab] each): its whole prompt,
    whatever prefill skips on a prefix-cache hit, and a bias of -inf outside its allowed tokens where it names them.
    The compiled steps read the rows of their lanes and scatter-add each sampled token into its lane's counts."""
    return TokenState(counts=state.counts.at[lane].set(0), marks=state.marks.at[lane].set(marks),
                      bias=state.bias.at[lane].set(bias))


def unpack_mask(mask: jax.Array, vocab: int) -> jax.Array:
    """A bitmask [rows, words] int32 as [rows, vocab] bool (a shift and an and per token)."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [rows, words, 32]
    return bits.reshape(mask.shape[0], -1)[:, :vocab] != 0


def penalize(logits: jax.Array, state: TokenState, lanes: jax.Array, p: PenaltyArrays, counter: jax.Array
             ) -> jax.Array:
    """The logits each row's token is chosen from, in this order: the model's logits + logit_bias; its stop ids at
    -inf while it has generated fewer than min_tokens; a logit of a token in the prompt or already generated divided
    by repetition_penalty if positive, else multiplied by it; minus frequency_penalty * count + presence_penalty *
    (count > 0); last, a constrained row's tokens outside its mask (engine/constraints.py) at -inf, a mask that needs
    no lane state. The penalties and the mask each run under a `lax.cond` of their own. logits: [rows, vocab]; lanes:
    [rows] the lane of each row; counter: [rows] tokens each row's request has generated."""

    def apply(logits: jax.Array) -> jax.Array:
        counts = state.counts[lanes]  # [rows, vocab]
        marks = state.marks[lanes]  # [rows, vocab]
        x = logits + state.bias[lanes]
        held = ((marks & HELD) != 0) & (counter < p.min_tokens)[:, None]
        x = jnp.where(held, -jnp.inf, x)
        seen = ((marks & PROMPT) != 0) | (counts > 0)
        rep = jnp.where(seen, p.repetition[:, None], jnp.float32(1.0))
        x = jnp.where(x > 0, x / rep, x * rep)
        x = x - (p.frequency[:, None] * counts.astype(jnp.float32)
                 + p.presence[:, None] * (counts > 0).astype(jnp.float32))
        return jnp.where(p.active[:, None], x, logits)

    def constrain(x: jax.Array) -> jax.Array:
        return jnp.where(p.constrained[:, None] & ~unpack_mask(p.mask, x.shape[1]), -jnp.inf, x)

    x = jax.lax.cond(jnp.any(p.active), apply, lambda x: x, logits)
    return jax.lax.cond(jnp.any(p.constrained), constrain, lambda x: x, x)


def sample_penalized(logits: jax.Array, s: SamplingArrays, state: TokenState, lanes: jax.Array, p: PenaltyArrays
                     ) -> tuple[SampleOut, TokenState]:
    """`sample` from the penalized logits (log-probabilities stay the model's), then count each active row's token
    in its lane. logits: [rows, vocab]; lanes: [rows]."""
    out = sample(logits, s, lambda: penalize(logits, state, lanes, p, s.counter),
                 jnp.any(p.active) | jnp.any(p.constrained))
    counts = state.counts.at[lanes, out.tokens].add(p.active.astype(jnp.int32))
    return out, dataclasses.replace(state, counts=counts)
