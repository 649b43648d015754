"""Per-lane sampling on the device: greedy, temperature, top-k, top-p and min-p, with seeded Gumbel-max.

Each row is sampled from its own logits and its own key (seed folded with the lane's generated-token count), so a
lane's token never depends on the other rows; float sums are `rowwise.row_sum`, so neither does it depend on how many
rows the wave has. Filters and noise run under `lax.cond` on wave-wide predicates; a row
that asks for neither gets the same bits from either branch (an all-true mask, zero noise it never reads).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxstation.kernels import cpu_kernel
from jaxstation.kernels.rowwise import log_softmax, row_sum, softmax

TOP_LOGPROBS = 5  # how many alternatives a step returns per row


@partial(jax.tree_util.register_dataclass,
         data_fields=["temperature", "top_k", "top_p", "min_p", "seed", "counter"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    temperature: jax.Array  # [rows] float32; 0 = greedy
    top_k: jax.Array  # [rows] int32; 0 = off
    top_p: jax.Array  # [rows] float32; 1 = off
    min_p: jax.Array  # [rows] float32; 0 = off
    seed: jax.Array  # [rows] uint32
    counter: jax.Array  # [rows] int32: tokens the row has generated so far


@partial(jax.tree_util.register_dataclass, data_fields=["tokens", "logprob", "top_ids", "top_logprobs"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SampleOut:
    tokens: jax.Array  # [rows] int32
    logprob: jax.Array  # [rows] float32: the chosen token's log-probability under the model
    top_ids: jax.Array  # [rows, TOP_LOGPROBS] int32
    top_logprobs: jax.Array  # [rows, TOP_LOGPROBS] float32


def _ordered_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same total order (-inf lowest), so a search can bisect over values."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _smallest_key(keys: jax.Array, holds) -> jax.Array:
    """Per row, the smallest key v in [min, max] of the row with holds(v) true, for `holds` monotone (false, then
    true) and true at the row's max. 32 halvings of the uint32 range: exact, no sort. keys: [rows, vocab]."""
    lo, hi = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)  # [rows]

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = holds(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def _filter_mask(scaled: jax.Array, s: SamplingArrays) -> jax.Array:
    """Which tokens survive top-k, top-p and min-p. scaled: [rows, vocab] temperature-scaled logits.

    Cut-offs are found by bisection over the values' order instead of a vocabulary sort (which XLA's CPU sort makes
    the costliest part of a wide wave):
    - top-k keeps values >= the k-th largest, the smallest v with fewer than k values above it;
    - top-p keeps values >= the smallest v whose strictly-greater mass is below top_p: the shortest prefix of the
      sorted distribution that reaches top_p, ties at the cut included;
    - min-p keeps p >= min_p * p_max.
    """
    keys = _ordered_keys(scaled)  # [rows, vocab]
    above = lambda v: keys > v[:, None]  # noqa: E731 - [rows, vocab] for a per-row threshold key v [rows]
    keep = jnp.ones(scaled.shape, bool)
    kth = _smallest_key(keys, lambda v: jnp.sum(above(v), axis=-1) < s.top_k)
    keep &= jnp.where(s.top_k[:, None] > 0, keys >= kth[:, None], True)
    probs = softmax(scaled)
    p_cut = _smallest_key(keys, lambda v: row_sum(jnp.where(above(v), probs, 0.0)) < s.top_p)
    keep &= jnp.where(s.top_p[:, None] < 1.0, keys >= p_cut[:, None], True)
    # min-p: p >= min_p * p_max  <=>  scaled >= max + log(min_p)
    m_cut = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(jnp.maximum(s.min_p[:, None], 1e-30))
    keep &= jnp.where(s.min_p[:, None] > 0.0, scaled >= m_cut, True)
    return keep


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (the first index of the maximum) as two plain reductions, which XLA's CPU
    backend vectorizes; its variadic arg-reduce is several times slower on a [rows, vocab] array. -> [...] int32."""
    n = x.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), iota, n), axis=-1)
    return jnp.minimum(first, n - 1)  # a row of NaNs has no maximum: its last index


def sample(logits: jax.Array, s: SamplingArrays, chosen_from: jax.Array | None = None) -> SampleOut:
    """logits: [rows, vocab] float32, the model's -> one token per row plus its log-probabilities under the model.

    chosen_from: [rows, vocab], what the token is picked from (the penalized logits, engine/penalties.py); default
    the logits themselves."""
    logprobs = log_softmax(logits)
    logits = logits if chosen_from is None else chosen_from
    greedy = first_argmax(logits)
    sampling = s.temperature > 0.0
    scaled = logits / jnp.where(sampling, s.temperature, 1.0)[:, None]
    filtered = (s.top_k > 0) | (s.top_p < 1.0) | (s.min_p > 0.0)
    keep = jax.lax.cond(jnp.any(sampling & filtered), _filter_mask, lambda x, _: jnp.ones(x.shape, bool), scaled, s)

    def noise(seed: jax.Array, counter: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.PRNGKey(seed), counter)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    def draw() -> jax.Array:
        gumbel = jax.vmap(noise)(s.seed, s.counter)  # [rows, vocab]
        return jnp.where(sampling, first_argmax(jnp.where(keep, scaled, -jnp.inf) + gumbel), greedy)

    tokens = jax.lax.cond(jnp.any(sampling), draw, lambda: greedy)
    return token_logprobs(logprobs, tokens)


def token_logprobs(logprobs: jax.Array, tokens: jax.Array) -> SampleOut:
    """Each row's log-probability of `tokens` [rows] and its TOP_LOGPROBS best tokens. logprobs: [rows, vocab]."""
    top = cpu_kernel.top_k if cpu_kernel.available() else jax.lax.top_k  # the same values and indices, in one pass
    top_lp, top_ids = top(logprobs, TOP_LOGPROBS)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return SampleOut(tokens=tokens, logprob=chosen, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_lp)
