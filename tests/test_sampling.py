"""Sampling against a float64 reference (tests/sampling_reference.py), on the CPU kernel (kernels/sample.cc) and on
the JAX path: the kept sets of top-k, top-p and min-p on random rows, ties and near-ties at the cut; the drawn tokens
and their distribution over many seeded draws; a seed's tokens repeat, and a row's token is the same alone and among
others in any position. And a request's sampling parameters as the faces build them."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_reference import reference_draw, reference_keep

from jaxstation.chat.request import sampling_params
from jaxstation.engine.rows import Sample, SamplingParams, read_samples, sampling_arrays
from jaxstation.engine.sampling import TOP_LOGPROBS, SampleOut, SamplingArrays, _filter_mask, draw_xla, row_bits, sample
from jaxstation.kernels import cpu_kernel


def arrays(params: list[SamplingParams], counters: list[int] | None = None) -> SamplingArrays:
    return jax.tree.map(jnp.asarray, sampling_arrays([(p, c) for p, c in zip(
        params, counters or [0] * len(params), strict=True)]))


@jax.jit
def kernel(logits: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """The kernel's token and cut of each row (it keeps logits / temperature >= cut): [rows] int32, [rows] float32."""
    return cpu_kernel.sample(logits, s.temperature, s.top_k, s.top_p, s.min_p, row_bits(s.seed, s.counter))


def test_filters_equal_a_sorted_vocabulary() -> None:
    rng = np.random.default_rng(3)
    rows, vocab = 48, 4096
    scaled = (rng.standard_normal((rows, vocab)) * rng.uniform(0.3, 6.0, (rows, 1))).astype(np.float32)
    scaled[::3, :64] = scaled[::3].max(axis=1, keepdims=True) + 1  # a run of ties at the top
    scaled[1::3, 100:160] = -np.inf  # masked tokens
    top_k = rng.choice([0, 1, 3, 40, 64, 65, 500], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.01, 0.3, 0.9, 0.999], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.05, 0.3], rows).astype(np.float32)
    s = SamplingArrays(temperature=jnp.ones(rows), top_k=jnp.asarray(top_k), top_p=jnp.asarray(top_p),
                       min_p=jnp.asarray(min_p), seed=jnp.zeros(rows, jnp.uint32), counter=jnp.zeros(rows, jnp.int32))
    got = np.asarray(_filter_mask(jnp.asarray(scaled), s))
    for r in range(rows):
        want = reference_keep(scaled[r], int(top_k[r]), float(top_p[r]), float(min_p[r]))
        assert np.array_equal(got[r], want), (r, top_k[r], top_p[r], min_p[r], got[r].sum(), want.sum())
        assert got[r].sum() >= 1
    assert got[0].sum() >= 64  # ties at the top are all kept, whatever k


def float32_around(v: float) -> tuple[float, float]:
    """The float32 values just below and just above v."""
    f = np.float32(v)
    below = f if float(f) < v else np.nextafter(f, np.float32(-np.inf))
    above = f if float(f) > v else np.nextafter(f, np.float32(np.inf))
    return float(below), float(above)


def exclusive_mass(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x's positions in descending order and the float64 probability before each."""
    order = np.argsort(-x, kind="stable")
    probs = np.exp(x[order].astype(np.float64) - float(x[order[0]]))
    probs /= probs.sum()
    return order, np.cumsum(probs) - probs


def tie_rows(rng: np.random.Generator, vocab: int = 4096) -> list[tuple[np.ndarray, SamplingParams]]:
    """Rows whose cut falls on ties and near-ties: equal values and float neighbours at the k-th value; top_p the
    float32 just above and just below the mass before a position, inside a run of ties, and between -0 and +0; a value
    at the min-p bound and its neighbours."""
    base = (rng.standard_normal(vocab) * 2).astype(np.float32)
    rows = []
    for k in (5, 40):
        x = base.copy()
        order = np.argsort(-x, kind="stable")
        v, low = x[order[k - 1]], order[k + 10:k + 15]
        x[low[:3]] = v
        x[low[3]], x[low[4]] = np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))
        rows.append((x, SamplingParams(temperature=1.0, top_k=k, seed=1)))
    order, exclusive = exclusive_mass(base)
    for j in (1, 7, 30):
        rows += [(base, SamplingParams(temperature=1.0, top_p=p, seed=2)) for p in float32_around(exclusive[j])]
    x = base.copy()
    x[order[20:23]] = x[order[20]]  # a run of three ties at positions 20-22: top_p between them keeps all three
    _, exclusive = exclusive_mass(x)
    rows.append((x, SamplingParams(temperature=1.0, top_p=float((exclusive[20] + exclusive[22]) / 2), seed=3)))
    x = np.minimum(base - base.max(), np.float32(-0.5))
    x[0], x[8] = -0.0, 0.0  # the max twice, -0 first: +0 and -0 are one value
    _, exclusive = exclusive_mass(x)
    rows.append((x, SamplingParams(temperature=1.0, top_p=float(exclusive[1] * 1.5), seed=5)))
    for min_p in (0.05, 0.3):
        bound = float(base.max()) + math.log(float(np.float32(min_p)))
        x = base.copy()
        below, above = float32_around(bound)
        x[order[200:203]] = [below, np.float32(bound), above]
        rows.append((x, SamplingParams(temperature=1.0, min_p=min_p, seed=4)))
    return rows


def random_rows(rng: np.random.Generator, rows: int, vocab: int) -> list[tuple[np.ndarray, SamplingParams]]:
    """Random rows and parameters: a run of ties at the top of every third row, masked tokens in another third."""
    x = (rng.standard_normal((rows, vocab)) * rng.uniform(0.3, 6.0, (rows, 1))).astype(np.float32)
    x[::3, :64] = x[::3].max(axis=1, keepdims=True) + 1
    x[1::3, 100:160] = -np.inf
    return [(x[r], SamplingParams(temperature=float(rng.choice([0.5, 0.8, 1.0, 1.7])),
                                  top_k=int(rng.choice([0, 1, 3, 40, 64, 65, 500])),
                                  top_p=float(rng.choice([1.0, 0.01, 0.3, 0.9, 0.999])),
                                  min_p=float(rng.choice([0.0, 0.05, 0.3])), seed=int(rng.integers(2**32))))
            for r in range(rows)]


def wide_rows(rng: np.random.Generator, vocab: int = 262144) -> list[tuple[np.ndarray, SamplingParams]]:
    """Gemma 3's vocabulary: a flat row whose top-p cut lies far below the max, a row whose values straddle zero,
    top-k beyond the values near the max, one value everywhere, top-k one short of the vocabulary."""
    flat = (rng.standard_normal(vocab) * 0.5).astype(np.float32)
    peaked = (rng.standard_normal(vocab) * 4 - 20).astype(np.float32)
    peaked[rng.integers(vocab, size=30)] = 3.0
    return [(flat, SamplingParams(temperature=2.0, top_p=0.999, seed=5)),
            (flat, SamplingParams(temperature=0.7, top_p=0.95, top_k=100000, seed=6)),
            (peaked, SamplingParams(temperature=0.8, top_p=0.95, seed=7)),
            (peaked, SamplingParams(temperature=0.8, top_k=40, min_p=0.05, seed=8)),
            (peaked, SamplingParams(temperature=1.0, top_k=50000, seed=9)),
            (np.full(vocab, 1.5, np.float32), SamplingParams(temperature=1.0, top_p=0.5, seed=10)),
            (flat, SamplingParams(temperature=1.0, top_k=vocab - 1, seed=11)),
            (flat, SamplingParams(temperature=1.3, seed=12))]


def check_kernel_rows(cases: list[tuple[np.ndarray, SamplingParams]]) -> None:
    """The kernel keeps exactly the reference's tokens and draws the reference's token."""
    tokens, cuts = map(np.asarray, kernel(jnp.asarray(np.stack([x for x, _ in cases])), arrays([p for _, p in cases])))
    for r, (x, p) in enumerate(cases):
        scaled = x / np.float32(p.temperature)
        want = reference_keep(scaled, p.top_k, *(float(np.float32(v)) for v in (p.top_p, p.min_p)))
        assert np.array_equal(scaled >= cuts[r], want), (r, p, (scaled >= cuts[r]).sum(), want.sum())
        assert tokens[r] == reference_draw(x, p, 0), (r, p)


@pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernels do not build here")
def test_the_kernel_keeps_and_draws_as_the_reference() -> None:
    rng = np.random.default_rng(5)
    check_kernel_rows(random_rows(rng, 40, 4096) + tie_rows(rng))
    check_kernel_rows(wide_rows(rng))


def sampled_rows() -> str:
    """A digest of the kernel's tokens and cut-offs on random, tied and Gemma-sized rows: the same on every
    instruction set the kernels build for (tests/test_gguf_blocks.py)."""
    rng = np.random.default_rng(9)
    digest = hashlib.sha256()
    for cases in (random_rows(rng, 40, 4096) + tie_rows(rng), wide_rows(rng)):
        out = kernel(jnp.asarray(np.stack([x for x, _ in cases])), arrays([p for _, p in cases]))
        for a in out:
            digest.update(np.asarray(a).tobytes())
    return digest.hexdigest()[:16]


def test_the_jax_path_draws_as_the_reference() -> None:
    cases = random_rows(np.random.default_rng(6), 8, 4096)
    tokens = np.asarray(jax.jit(draw_xla)(jnp.asarray(np.stack([x for x, _ in cases])), arrays([p for _, p in cases])))
    assert tokens.tolist() == [reference_draw(x, p, 0) for x, p in cases]


DRAWS = 40000


@pytest.mark.parametrize("path", ["kernel", "jax"])
def test_many_seeded_draws_follow_the_kept_probabilities(path: str) -> None:
    """DRAWS draws of one row (one seed, counters 0..DRAWS-1) never leave the kept set, and their counts pass a
    chi-square test against the kept probabilities (p-value above 1e-4; fixed seed, so the test is deterministic)."""
    if path == "kernel" and not cpu_kernel.available():
        pytest.skip("the CPU kernels do not build here")
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(64) * 2).astype(np.float32)
    p = SamplingParams(temperature=0.9, top_k=30, top_p=0.9, min_p=0.01, seed=1234)
    s = arrays([p] * DRAWS, list(range(DRAWS)))
    draw = jax.jit(sample if path == "kernel" else draw_xla)
    out = draw(jnp.asarray(np.broadcast_to(x, (DRAWS, 64))), s)
    tokens = np.asarray(out.tokens if path == "kernel" else out)
    scaled = x / np.float32(p.temperature)
    keep = reference_keep(scaled, p.top_k, float(np.float32(p.top_p)), float(np.float32(p.min_p)))
    weights = np.where(keep, np.exp(scaled.astype(np.float64) - scaled.max()), 0.0)
    expected = DRAWS * weights[keep] / weights.sum()
    counts = np.bincount(tokens, minlength=64)
    assert counts[~keep].sum() == 0 and keep.sum() > 5
    chi2, dof = float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1
    bound = dof * (1 - 2 / (9 * dof) + 3.719 * math.sqrt(2 / (9 * dof))) ** 3  # Wilson-Hilferty, 1 - 1e-4
    assert chi2 < bound, (chi2, dof, bound)


@pytest.mark.parametrize("path", ["kernel", "jax"])
def test_a_seeded_row_is_the_same_alone_among_others_and_again(path: str) -> None:
    """Tokens of every row of a wave of 8 equal those of the row alone, in every position, and again; greedy and
    sampled rows, every filter."""
    if path == "kernel" and not cpu_kernel.available():
        pytest.skip("the CPU kernels do not build here")
    rng = np.random.default_rng(8)
    cases = random_rows(rng, 7, 4096)
    cases.insert(3, (cases[0][0], SamplingParams()))
    draw = jax.jit(lambda x, s: sample(x, s).tokens) if path == "kernel" else jax.jit(draw_xla)
    for step in range(2):
        logits, params = np.stack([x for x, _ in cases]), [p for _, p in cases]
        counters = [step] * len(cases)
        wave = np.asarray(draw(jnp.asarray(logits), arrays(params, counters)))
        assert np.array_equal(wave, np.asarray(draw(jnp.asarray(logits), arrays(params, counters))))
        for r in range(len(cases)):
            if path == "jax" and params[r].temperature == 0:
                continue  # draw_xla's token of a greedy row is meaningless
            alone = np.asarray(draw(jnp.asarray(logits[r:r + 1]), arrays(params[r:r + 1], counters[r:r + 1])))
            assert alone[0] == wave[r], (step, r)
            moved = np.roll(np.arange(len(cases)), 5)  # row r in another position beside the others
            shuffled = np.asarray(draw(jnp.asarray(logits[moved]), arrays([params[i] for i in moved],
                                                                          [counters[i] for i in moved])))
            assert shuffled[np.flatnonzero(moved == r)[0]] == wave[r]


def test_bounded_parameters_are_the_checked_ones_and_direct_ones_still_check() -> None:
    """`bounded` (values a face's types already bounded) builds what the checking constructor builds; built directly,
    SamplingParams still refuses what lies out of bounds."""
    fields = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "seed": 3, "presence_penalty": 0.5,
              "frequency_penalty": -1.0, "repetition_penalty": 1.1, "logit_bias": ((5, 1.0),),
              "allowed_token_ids": (1, 2), "min_tokens": 2}
    assert SamplingParams.bounded(**fields) == SamplingParams(**fields)
    base = SamplingParams(temperature=0.5, top_k=3)
    assert SamplingParams.bounded(base, seed=9) == dataclasses.replace(base, seed=9)
    assert SamplingParams.bounded() == SamplingParams()
    with pytest.raises(TypeError, match="top_q"):
        SamplingParams.bounded(top_q=0.5)
    for bad in ({"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"min_p": 1.5}, {"presence_penalty": 3.0},
                {"repetition_penalty": 0.0}, {"logit_bias": ((1, 101.0),)}, {"allowed_token_ids": (-1,)},
                {"min_tokens": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_the_chat_faces_defaults() -> None:
    """What a chat face did not send: temperature 1, every filter off; top_k -1 is off too."""
    assert sampling_params() == SamplingParams(temperature=1.0)
    assert sampling_params(0, 0.5, -1, 0.1) == SamplingParams(temperature=0.0, top_p=0.5, min_p=0.1)
    assert sampling_params(top_k=7) == SamplingParams(temperature=1.0, top_k=7)


def test_a_steps_samples_come_back_in_one_array_with_every_bit() -> None:
    """SampleOut packs tokens, log-probabilities and the top alternatives into one int32 array, in a program and on
    the host alike; read back, every float keeps its bits (-0.0, -inf, a NaN's payload)."""
    rng = np.random.default_rng(0)
    tokens = np.array([7, 0, 262143], np.int32)
    logprob = np.array([-0.0, -np.inf, np.float32(-1.25e-30)], np.float32)
    top_ids = rng.integers(0, 262144, (3, TOP_LOGPROBS)).astype(np.int32)
    top_lp = rng.standard_normal((3, TOP_LOGPROBS)).astype(np.float32)
    top_lp[1, 2] = np.array([0x7FC01234], np.uint32).view(np.float32)[0]  # a NaN with a payload
    host = SampleOut.of(tokens, logprob, top_ids, top_lp)
    device = jax.jit(SampleOut.of)(tokens, logprob, top_ids, top_lp)
    assert isinstance(host.packed, np.ndarray) and host.packed.shape == (3, 2 + 2 * TOP_LOGPROBS)
    np.testing.assert_array_equal(np.asarray(device.packed), host.packed)
    for out in (host, device, jax.jit(lambda o: o)(device)):
        pairs = ((out.tokens, tokens), (out.logprob, logprob), (out.top_ids, top_ids), (out.top_logprobs, top_lp))
        for got, want in pairs:
            assert np.asarray(got).dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got).view(np.int32), want.view(np.int32))
    samples = read_samples(device)
    assert samples[0] == Sample(7, -0.0, tuple(zip(top_ids[0].tolist(), top_lp[0].tolist(), strict=True)))
    assert math.copysign(1.0, samples[0].logprob) == -1.0 and samples[1].logprob == -math.inf
    assert np.float32(samples[1].top[2][1]).view(np.uint32) == 0x7FC01234
