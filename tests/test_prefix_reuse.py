"""Prefix reuse on the real default model: the numerics it rests on, and bit-identical requests through the scheduler.

The KV tests read the arena itself: prefill-written KV of a prefix is exactly what a fresh prefill of a longer
sequence writes there (whether the prefix ended in a full `last` chunk or a padded one), and on the decode attention
kernel decode-written KV of the same tokens is too. The scheduler tests run the shared engine (4 lanes, chunk 32,
block 128) with the prefix cache and compare every sample (token, logprob and top logprobs, as floats) with a fresh
run's.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import prefill_all

from jaxstation.engine.engine import Engine, generate
from jaxstation.engine.jobs import Job, Result
from jaxstation.engine.rows import DecodeRow, SamplingParams
from jaxstation.engine.scheduler import Scheduler

CHUNK = 32
SEEDED = SamplingParams(temperature=0.9, top_k=50, seed=4321)
TIMEOUT = 120


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 49152, size=n).tolist()


def lane_kv(engine: Engine, lane: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(engine.arena.k[:, lane, a:b]), np.asarray(engine.arena.v[:, lane, a:b])


# ---- the numerics -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [64, 50, 33])
def test_prefill_written_kv_of_a_prefix_equals_a_longer_prompts(engine, n):
    long = ids(1, 150)
    prefill_all(engine, 0, long, SamplingParams())
    prefill_all(engine, 1, long[:n], SamplingParams())  # n = 64 ends in a full `last` chunk; 50 and 33 in padded ones
    for a, b in zip(lane_kv(engine, 0, 0, n), lane_kv(engine, 1, 0, n), strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("fixture", ["integer_engine", "exact_engine"])
def test_decode_written_kv_is_what_prefill_writes_on_the_attention_kernel(request, fixture):
    """A prefill chunk's rows attend through the decode attention kernel, as decode rows do, so the two paths write
    the same bits, on the integer products too (where a last-bit difference would move an activation's 8-bit code)."""
    engine = request.getfixturevalue(fixture)
    assert engine.attention == "kernel"
    prompt = ids(2, 70)
    prefill_all(engine, 0, prompt, SamplingParams())
    prefill_all(engine, 1, prompt[:60], SamplingParams())
    for j, pos in enumerate(range(60, 70)):  # feed the same tokens at the same positions, one decode wave each
        rows: list[DecodeRow | None] = [None] * engine.lanes
        rows[1] = DecodeRow(prompt[pos], pos, SamplingParams(), j + 1)
        engine.decode(rows)
    (k0, v0), (k1, v1) = lane_kv(engine, 0, 60, 70), lane_kv(engine, 1, 60, 70)
    assert np.array_equal(k0, k1) and np.array_equal(v0, v1)


@pytest.mark.parametrize("cached_len", [64, 70])
def test_restarting_at_the_chunk_boundary_writes_fresh_bits(engine, cached_len):
    """A lane holding prefill KV of P[:cached_len] plus decode KV, refilled with P from the last boundary below."""
    prompt = ids(3, 130)
    fresh_sample, fresh_logits = prefill_all(engine, 0, prompt, SamplingParams(), return_logits=True)
    prefill_all(engine, 2, prompt[:cached_len], SamplingParams())
    for j in range(5):  # decode junk after the cached prefix, as a retired request would leave it
        rows: list[DecodeRow | None] = [None] * engine.lanes
        rows[2] = DecodeRow(7 + j, cached_len + j, SamplingParams(), j + 1)
        engine.decode(rows)
    restart = cached_len // CHUNK * CHUNK
    sample = logits = None
    for start in range(restart, len(prompt), CHUNK):
        sample, logits = engine.prefill(2, prompt, start, SamplingParams(), return_logits=True)
    assert sample == fresh_sample
    assert np.array_equal(np.asarray(logits), np.asarray(fresh_logits))
    for a, b in zip(lane_kv(engine, 0, 0, len(prompt)), lane_kv(engine, 2, 0, len(prompt)), strict=True):
        assert np.array_equal(a, b)


# ---- through the scheduler --------------------------------------------------------------------------------------

def start(engine: Engine, continuous: bool = True) -> Scheduler:
    sched = Scheduler(engine, continuous=continuous, max_queue=64, terminal_ids=frozenset())
    sched.start()
    return sched


def run(sched: Scheduler, prompt: list[int], n: int, sampling: SamplingParams, reuse: bool = True) -> Result:
    return sched.submit(Job(tokens=prompt, max_new_tokens=n, sampling=sampling, reuse_prefix=reuse)
                        ).result(TIMEOUT)


def assert_same_samples(got: Result, ref: Result) -> None:
    assert got.generated == ref.generated
    assert got.finish_reason == ref.finish_reason
    assert [(s.logprob, s.top) for s in got.samples] == [(s.logprob, s.top) for s in ref.samples]  # float bits


@pytest.fixture(scope="module")
def scheduler(engine):
    sched = start(engine)
    yield sched
    assert sched.drain(10)


@pytest.mark.parametrize("turn1_len", [64, 60])  # 60 + 10 generated would cross the boundary at 64
@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_multi_turn_equals_a_fresh_run(engine, scheduler, turn1_len, sampling):
    turn1 = ids(10 + turn1_len, turn1_len)
    r1 = run(scheduler, turn1, 10, sampling)
    turn2 = turn1 + r1.generated + ids(20, 17)
    reused = run(scheduler, turn2, 10, sampling)
    assert reused.timing["cached_tokens"] == turn1_len // CHUNK * CHUNK
    fresh = run(scheduler, turn2, 10, sampling, reuse=False)
    assert fresh.timing["cached_tokens"] == 0
    assert_same_samples(reused, fresh)
    if sampling == SamplingParams():
        assert reused.generated == generate(engine, turn2, 10, sampling, lane=3)


def test_same_prompt_alone_after_a_hit_and_in_a_busy_wave(engine, scheduler):
    system = ids(30, 90)
    target = system + ids(31, 12)
    alone = run(scheduler, target, 12, SEEDED, reuse=False)
    run(scheduler, system + ids(32, 20), 3, SamplingParams())  # caches the system prompt
    hit = run(scheduler, target, 12, SEEDED)
    assert hit.timing["cached_tokens"] == 64  # 90 system tokens match (+ none of the user's): 64
    assert_same_samples(hit, alone)
    # busy: three long neighbours decode beside the target, which hits its own lane's cache again
    neighbours = [scheduler.submit(Job(tokens=ids(40 + i, 20 + 60 * i), max_new_tokens=40)) for i in range(3)]
    busy = run(scheduler, target, 12, SEEDED)
    assert busy.timing["cached_tokens"] == 96  # the previous target (102 tokens) is cached now: 101 -> 96
    assert_same_samples(busy, alone)
    assert all(f.result(TIMEOUT).generated for f in neighbours)


def test_serialize_all_reuses_with_the_same_bits(engine):
    sched = start(engine, continuous=False)
    try:
        turn1 = ids(50, 40)
        r1 = run(sched, turn1, 6, SEEDED)
        turn2 = turn1 + r1.generated + ids(51, 5)
        reused = run(sched, turn2, 8, SEEDED)
        assert reused.timing["cached_tokens"] == 32
        assert_same_samples(reused, run(sched, turn2, 8, SEEDED, reuse=False))
        value = sched.metrics.registry.get_sample_value
        assert (value("jaxstation_prefix_cache_lookups_total"), value("jaxstation_prefix_cache_hits_total")) == (2, 1)
        assert (value("jaxstation_prefix_cache_reused_tokens_total"),
                value("jaxstation_prefix_cache_prefill_saved_tokens_total")) == (40, 32)
    finally:
        assert sched.drain(10)


def test_a_rebuilt_arena_is_never_reused(engine):
    sched = start(engine, continuous=False)
    try:
        prompt = ids(60, 70)
        first = run(sched, prompt, 5, SamplingParams())
        engine.reset()  # the arena is rebuilt (zeros): a stale entry would now give wrong tokens
        again = run(sched, prompt + [5], 5, SamplingParams())
        assert again.timing["cached_tokens"] == 0
        assert again.generated == generate(engine, prompt + [5], 5, SamplingParams(), lane=3)
        assert first.generated == generate(engine, prompt, 5, SamplingParams(), lane=3)
    finally:
        assert sched.drain(10)



def test_a_prompt_logprobs_job_neither_reuses_nor_leaves_kv(engine):
    sched = start(engine, continuous=False)  # an empty cache
    try:
        prompt = ids(70, 80)

        def scored(tokens: list[int]) -> Result:
            r = sched.submit(Job(tokens=tokens, max_new_tokens=2, prompt_logprobs=True)).result(TIMEOUT)
            assert len(r.prompt_logprobs) == len(tokens) - 1
            return r

        assert scored(prompt).timing["cached_tokens"] == 0
        assert run(sched, prompt + [9], 2, SamplingParams()).timing["cached_tokens"] == 0  # it left nothing
        assert scored(prompt + [9, 10]).timing["cached_tokens"] == 0  # 81 tokens are cached now: not reused
        assert run(sched, prompt + [9, 10], 2, SamplingParams()).timing["cached_tokens"] == 64
    finally:
        assert sched.drain(10)
