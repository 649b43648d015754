"""Per-lane sampling on the device: greedy, temperature, top-k, top-p and min-p, with one seeded uniform per row.

A sampled row keeps exactly the tokens its filters define and draws by inverse CDF: the first kept token, in
vocabulary order, whose running probability exceeds the row's uniform, which comes from its seed folded with the
lane's generated-token count. So a seed repeats its tokens, and a lane's token never depends on the other rows: each
row is sampled from its own logits and uniform, with float sums in fixed orders, whatever the wave's width. On CPU the
kernels draw (`draw_kernel`); elsewhere the JAX path does (`draw_xla`), with the same row bits (`row_bits`). A wave
with no sampled row runs neither (`lax.cond`); greedy rows take the first maximum either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxstation.kernels import cpu_kernel
from jaxstation.kernels.rowwise import log_softmax, peak_and_first, row_cumsum, row_sum, softmax

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


@partial(jax.tree_util.register_dataclass, data_fields=["packed"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SampleOut:
    """A step's samples as one int32 array, so that the host reads them in one transfer (each array read back costs a
    wait of its own): per row its token, the float32 bits of its log-probability under the model, its TOP_LOGPROBS best
    tokens, then the bits of their log-probabilities. In a program or on the host (`of` numpy arrays) alike."""

    packed: jax.Array | np.ndarray  # [rows, 2 + 2 * TOP_LOGPROBS] int32

    @classmethod
    def of(cls, tokens, logprob, top_ids, top_logprobs) -> SampleOut:
        """tokens [rows] int32, logprob [rows] float32, top_ids [rows, TOP_LOGPROBS] int32, top_logprobs likewise
        float32; numpy arrays give numpy."""
        xp = np if all(isinstance(a, np.ndarray) for a in (tokens, logprob, top_ids, top_logprobs)) else jnp
        return cls(xp.concatenate([tokens[:, None].astype(np.int32), _bits(logprob[:, None], np.int32),
                                   top_ids.astype(np.int32), _bits(top_logprobs, np.int32)], axis=1))

    @property
    def tokens(self) -> jax.Array | np.ndarray:  # [rows] int32
        return self.packed[:, 0]

    @property
    def logprob(self) -> jax.Array | np.ndarray:  # [rows] float32
        return _bits(self.packed[:, 1], np.float32)

    @property
    def top_ids(self) -> jax.Array | np.ndarray:  # [rows, TOP_LOGPROBS] int32
        return self.packed[:, 2:2 + TOP_LOGPROBS]

    @property
    def top_logprobs(self) -> jax.Array | np.ndarray:  # [rows, TOP_LOGPROBS] float32
        return _bits(self.packed[:, 2 + TOP_LOGPROBS:], np.float32)


def _bits(x: jax.Array | np.ndarray, dtype: type) -> jax.Array | np.ndarray:
    """x's bits read as `dtype` (of the same width), numpy or in a program."""
    return x.view(dtype) if isinstance(x, np.ndarray) else jax.lax.bitcast_convert_type(x, dtype)


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


def row_bits(seed: jax.Array, counter: jax.Array) -> jax.Array:
    """Each row's 64 random bits, from its seed [rows] uint32 and generated-token count [rows] int32 -> [rows, 2]
    uint32."""
    def bits(seed: jax.Array, counter: jax.Array) -> jax.Array:
        return jax.random.bits(jax.random.fold_in(jax.random.PRNGKey(seed), counter), (2,), jnp.uint32)

    return jax.vmap(bits)(seed, counter)


CDF_BLOCK = 512  # the JAX draw's block of the vocabulary


def _inverse_cdf(scaled: jax.Array, keep: jax.Array, u: jax.Array) -> jax.Array:
    """The first kept token, in vocabulary order, whose running weight exceeds u times the kept total: weights
    exp(scaled - max) in float32, summed by blocks of CDF_BLOCK (`row_sum`), running sums by `row_cumsum`. scaled,
    keep: [rows, vocab]; u: [rows] in [0, 1) -> [rows] int32."""
    rows, n = scaled.shape
    blocks = -(-n // CDF_BLOCK)
    w = jnp.where(keep, jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), 0.0)
    w = jnp.pad(w, ((0, 0), (0, blocks * CDF_BLOCK - n))).reshape(rows, blocks, CDF_BLOCK)
    mass = row_sum(w)  # [rows, blocks]
    running = row_cumsum(mass)  # [rows, blocks]
    target = u * running[:, -1]  # [rows]
    last = jnp.max(jnp.where(mass > 0, jnp.arange(blocks), 0), axis=-1)  # [rows]: the last block with weight
    b = jnp.minimum(jnp.sum(running <= target[:, None], axis=-1), last)  # [rows]: where the target falls
    before = jnp.where(b > 0, jnp.take_along_axis(running, jnp.maximum(b - 1, 0)[:, None], axis=1)[:, 0], 0.0)
    inner = jnp.take_along_axis(w, b[:, None, None], axis=1)[:, 0]  # [rows, CDF_BLOCK]
    j = jnp.sum(before[:, None] + row_cumsum(inner) <= target[:, None], axis=-1)  # [rows]
    last_in = jnp.max(jnp.where(inner > 0, jnp.arange(CDF_BLOCK), 0), axis=-1)  # where rounding leaves it unreached
    return (b * CDF_BLOCK + jnp.minimum(j, last_in)).astype(jnp.int32)


def draw_xla(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """The JAX path's sampled token of each row (a greedy row's is meaningless). logits: [rows, vocab] -> [rows].
    It finds the cut-offs by bisection (`_filter_mask`: 64 passes over a row, two 32-step bisections) and draws in
    float32 with `rowwise` sums."""
    sampling = s.temperature > 0.0
    scaled = logits / jnp.where(sampling, s.temperature, 1.0)[:, None]
    filtered = (s.top_k > 0) | (s.top_p < 1.0) | (s.min_p > 0.0)
    keep = jax.lax.cond(jnp.any(sampling & filtered), _filter_mask, lambda x, _: jnp.ones(x.shape, bool), scaled, s)
    u = (row_bits(s.seed, s.counter)[:, 0] >> 8).astype(jnp.float32) * 2.0 ** -24  # [rows]: the top 24 bits
    return _inverse_cdf(scaled, keep, u)


def draw_kernel(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """The CPU kernel's sampled token of each row (a greedy row's is 0). logits: [rows, vocab] -> [rows].
    kernels/sample.cc finds each row's cut-offs by histograms over the values' order and draws, in double, in about
    one pass over the row (on a 262,144-token vocabulary the JAX path's 64 passes cost several times a greedy step's
    sampling); its row bits are the kernels' Threefry, the bits `row_bits` gives, in one call."""
    bits = cpu_kernel.row_bits(s.seed, s.counter)  # the bits `row_bits` gives, in one call
    return cpu_kernel.sample(logits, s.temperature, s.top_k, s.top_p, s.min_p, bits)[0]


def sample(logits: jax.Array, s: SamplingArrays, chosen_from: Callable[[], jax.Array] | None = None,
           choose_from_it: jax.Array | None = None) -> SampleOut:
    """logits: [rows, vocab] float32, the model's -> one token per row plus its log-probabilities under the model.

    chosen_from: what the token is picked from where `choose_from_it` (a scalar bool) holds, else the logits
    themselves: a function giving [rows, vocab] (the penalized logits, engine/penalties.py), called only under that
    condition, so that a wave without penalties neither computes nor copies a second [rows, vocab] array."""
    peak, first = peak_and_first(logits)  # one pass serves the log-softmax and the greedy pick
    logprobs = log_softmax(logits, peak)
    sampling = s.temperature > 0.0
    draw = draw_kernel if cpu_kernel.available() else draw_xla

    def pick(x: jax.Array, greedy: jax.Array) -> jax.Array:
        return jax.lax.cond(jnp.any(sampling), lambda: jnp.where(sampling, draw(x, s), greedy), lambda: greedy)

    def pick_penalized() -> jax.Array:
        x = chosen_from()
        return pick(x, peak_and_first(x)[1])

    tokens = pick(logits, first) if chosen_from is None else jax.lax.cond(
        choose_from_it, pick_penalized, lambda: pick(logits, first))
    return token_logprobs(logprobs, tokens)


def token_logprobs(logprobs: jax.Array, tokens: jax.Array) -> SampleOut:
    """Each row's log-probability of `tokens` [rows] and its TOP_LOGPROBS best tokens. logprobs: [rows, vocab]."""
    top = cpu_kernel.top_k if cpu_kernel.available() else jax.lax.top_k  # the same values and indices, in one pass
    top_lp, top_ids = top(logprobs, TOP_LOGPROBS)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return SampleOut.of(tokens, chosen, top_ids, top_lp)
