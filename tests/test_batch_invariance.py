"""Batch invariance on the default model: a request's logits and tokens do not depend on its lane or its neighbours.

Everything drives the shared engine (4 lanes, chunk 32, block 128) directly. Neighbour prompts are longer than 128
tokens, so their waves run more KV blocks than the target needs; the target's bits must not change.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import prefill_all, run_wave

from jaxstation.engine.engine import generate
from jaxstation.engine.rows import DecodeRow, SamplingParams

TARGET = [504, 3575, 282, 4649, 314, 7042, 30, 198, 1780, 314, 260, 2988, 282]  # 13 tokens: one block
STEPS = 6
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1234)


def _random_prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 49152, size=n).tolist()


@pytest.fixture(scope="module")
def alone_greedy(engine):
    """The target alone in lane 0, greedy: reference tokens and logits."""
    return run_wave(engine, {0: (TARGET, SamplingParams())}, STEPS)[0]


def _assert_bit_equal(got, ref, what: str) -> None:
    assert got[0] == ref[0], f"{what}: tokens differ"
    assert len(got[1]) == len(ref[1]) == STEPS + 1
    for step, (a, b) in enumerate(zip(got[1], ref[1], strict=True)):
        assert a.dtype == b.dtype == np.float32
        assert np.array_equal(a, b), f"{what}: logits differ at step {step} (max abs {np.abs(a - b).max()})"


@pytest.mark.parametrize("lane", [0, 1, 2, 3])
def test_logits_bit_equal_alone_at_any_lane(engine, alone_greedy, lane):
    got = run_wave(engine, {lane: (TARGET, SamplingParams())}, STEPS)[lane]
    _assert_bit_equal(got, alone_greedy, f"alone in lane {lane}")


@pytest.mark.parametrize("lane,n_others", [(0, 3), (1, 1), (2, 2), (3, 3), (3, 1)])
def test_logits_bit_equal_among_neighbours(engine, alone_greedy, lane, n_others):
    rng = np.random.default_rng(100 * lane + n_others)
    others = [i for i in range(engine.lanes) if i != lane]
    rng.shuffle(others)
    lanes = {lane: (TARGET, SamplingParams())}
    for j, other in enumerate(others[:n_others]):
        # the first neighbour is always past one KV block (> 128 tokens); the rest are random, shorter or longer
        n = int(rng.integers(129, 200)) if j == 0 else int(rng.integers(2, 200))
        sp = SamplingParams() if j % 2 else SamplingParams(temperature=1.0, top_k=int(rng.integers(0, 50)),
                                                          seed=int(rng.integers(0, 2**31)))
        lanes[other] = (_random_prompt(rng, n), sp)
    assert max(len(p) for p, _ in lanes.values()) > engine.block >= len(TARGET) + STEPS
    got = run_wave(engine, lanes, STEPS)[lane]
    _assert_bit_equal(got, alone_greedy, f"lane {lane} among {n_others} neighbours")


# ---------------------------------------------------------------------------------------------- seeded sampling

@pytest.fixture(scope="module")
def alone_seeded(engine):
    return run_wave(engine, {0: (TARGET, SEEDED)}, STEPS, return_logits=False)[0][0]


def test_seeded_sampling_reproducible(engine, alone_seeded):
    again = run_wave(engine, {0: (TARGET, SEEDED)}, STEPS, return_logits=False)[0][0]
    assert again == alone_seeded
    assert len(alone_seeded) == STEPS + 1


@pytest.mark.parametrize("lane", [1, 3])
def test_seeded_sampling_invariant_among_neighbours(engine, alone_seeded, lane):
    rng = np.random.default_rng(7 + lane)
    neighbours = [
        SamplingParams(),  # greedy
        SamplingParams(temperature=1.3, seed=99),  # sampling, no filters
        SamplingParams(temperature=0.5, top_k=5, min_p=0.05, seed=4321),  # other filters
    ]
    lanes = {lane: (TARGET, SEEDED)}
    for other, sp in zip([i for i in range(engine.lanes) if i != lane], neighbours, strict=True):
        lanes[other] = (_random_prompt(rng, int(rng.integers(129, 220))), sp)
    got = run_wave(engine, lanes, STEPS, return_logits=False)
    assert got[lane][0] == alone_seeded


def test_unfiltered_sampling_unchanged_by_filtered_neighbour(engine):
    """A row with temperature only must get the same token whether or not the wave runs the filter branch."""
    sp = SamplingParams(temperature=1.0, seed=77)
    alone = run_wave(engine, {2: (TARGET, sp)}, STEPS, return_logits=False)[2][0]
    with_filter = run_wave(engine, {2: (TARGET, sp), 0: (TARGET, SEEDED)}, STEPS, return_logits=False)
    assert with_filter[2][0] == alone


def test_different_seeds_give_different_tokens(engine, alone_seeded):
    runs = {
        seed: run_wave(engine, {1: (TARGET, SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=seed))},
                       STEPS, return_logits=False)[1][0]
        for seed in (1, 2, 3)
    }
    runs[1234] = alone_seeded
    assert len({tuple(t) for t in runs.values()}) >= 3, runs


def test_top_k_1_equals_greedy(engine, alone_greedy):
    sp = SamplingParams(temperature=0.7, top_k=1, seed=5)
    assert run_wave(engine, {3: (TARGET, sp)}, STEPS, return_logits=False)[3][0] == alone_greedy[0]
    # and through generate, over a longer run
    greedy = generate(engine, TARGET, 16, SamplingParams(), lane=1)
    assert generate(engine, TARGET, 16, SamplingParams(temperature=1.5, top_k=1, seed=11), lane=2) == greedy


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def test_logprob_and_top(engine):
    lanes = {0: (TARGET, SamplingParams()), 2: (TARGET[:7], SEEDED)}
    samples_seen = 0
    for lane, (prompt, sp) in lanes.items():
        sample, logits = prefill_all(engine, lane, prompt, sp, return_logits=True)
        _check_sample(sample, np.asarray(logits)[0])
        samples_seen += 1
    # one decode wave with both lanes live (one greedy, one sampling with filters)
    rows = [None] * engine.lanes
    rows[0] = DecodeRow(TARGET[0], len(TARGET), SamplingParams(), 1)
    rows[2] = DecodeRow(TARGET[1], 7, SEEDED, 1)
    samples, logits = engine.decode(rows, return_logits=True)
    for lane in lanes:
        _check_sample(samples[lane], np.asarray(logits)[lane])
        samples_seen += 1
    assert samples_seen == 4


def _check_sample(sample, logits: np.ndarray) -> None:
    lsm = _log_softmax(logits)
    assert abs(sample.logprob - lsm[sample.token]) <= 1e-5
    ids = [t for t, _ in sample.top]
    assert len(ids) == 5
    assert ids == np.argsort(-logits, kind="stable")[:5].tolist()
    for t, lp in sample.top:
        assert abs(lp - lsm[t]) <= 1e-5
