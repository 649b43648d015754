"""Prefix reuse, host side: `PrefixCache` alone, then the scheduler's fill over FakeEngine (tests/fake_engine.py).

The fake records who wrote each KV position (prefill or decode, and which token) and reports a prefill that starts on
a prefix its lane does not hold as prefill-written KV of exactly those tokens, so `fake.errors == []` asserts that no
request ever started on a stale, foreign or decode-written prefix.
"""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, expected

from jaxstation.engine.jobs import Cancelled, Job, StepFailed
from jaxstation.engine.prefix_cache import Pick, PrefixCache, common_prefix
from jaxstation.engine.rows import SamplingParams
from jaxstation.engine.scheduler import Scheduler

TIMEOUT = 5.0
CHUNK = 4


# ---- PrefixCache alone ---------------------------------------------------------------------------------------

def test_pick_longest_reusable_prefix_rounded_down_to_a_chunk():
    cache = PrefixCache(lanes=3, chunk=CHUNK)
    versions = [5, 6, 7]
    cache.store(0, [1, 2, 3, 4, 5, 6, 7, 8, 9], 5)
    cache.store(1, [1, 2, 3, 4, 5, 6], 6)
    cache.store(2, [9, 9], 7)
    # lane 0 matches 7 tokens, lane 1 six: both round down to 4, the tie goes to the least recently used (lane 0)
    assert cache.pick([1, 2, 3, 4, 5, 6, 7, 0, 0], [0, 1, 2], versions) == Pick(0, 7, 4)
    # lane 0 matches 9 (-> 8), lane 1 six (-> 4)
    assert cache.pick([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [0, 1, 2], versions) == Pick(0, 9, 8)
    # the prompt's last token is always prefilled: an identical prompt of 9 matches 8
    assert cache.pick([1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 1, 2], versions) == Pick(0, 8, 8)
    # only free lanes are candidates
    assert cache.pick([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2], versions) == Pick(1, 6, 4)
    # a match shorter than a chunk reuses nothing; the victim is the least recently used lane
    assert cache.pick([1, 2, 3, 0, 0], [0, 1, 2], versions) == Pick(0, 0, 0)
    assert cache.pick([8], [0, 1, 2], versions) == Pick(0, 0, 0)


def test_victims_empty_lanes_first_then_least_recently_used():
    cache = PrefixCache(lanes=4, chunk=CHUNK)
    versions = [0, 0, 0, 0]
    assert cache.pick([1, 2], [0, 1, 2, 3], versions).lane == 0  # all empty: the lowest lane
    cache.store(0, [1] * 8, 0)
    cache.store(2, [2] * 8, 0)
    assert cache.pick([3] * 8, [0, 1, 2, 3], versions).lane == 1  # an empty lane before any cached one
    cache.store(1, [3] * 8, 0)
    cache.store(3, [4] * 8, 0)
    assert cache.pick([5] * 8, [0, 1, 2, 3], versions).lane == 0  # stored first
    cache.take(0)  # lane 0 runs a request: its entry is gone
    assert cache.pick([1] * 8, [0, 1, 2, 3], versions) == Pick(0, 0, 0)  # no hit, and lane 0 is now empty
    assert cache.pick([5] * 8, [1, 2, 3], versions).lane == 2


def test_reuse_off_picks_by_lru_and_reuses_nothing():
    cache = PrefixCache(lanes=2, chunk=CHUNK)
    cache.store(1, list(range(12)), 0)
    cache.store(0, [7] * 12, 0)
    assert cache.pick(list(range(12)) + [1], [0, 1], [0, 0]) == Pick(1, 12, 12)
    assert cache.pick(list(range(12)) + [1], [0, 1], [0, 0], reuse=False) == Pick(1, 0, 0)


def test_a_changed_lane_version_voids_the_entry():
    cache = PrefixCache(lanes=2, chunk=CHUNK)
    cache.store(0, list(range(12)), 3)
    cache.store(1, list(range(8)), 4)
    assert cache.pick(list(range(13)), [0, 1], [3, 4]) == Pick(0, 12, 12)
    assert cache.pick(list(range(13)), [0, 1], [9, 4]) == Pick(1, 8, 8)  # lane 0 was written since
    assert cache.pick(list(range(13)), [0, 1], [3, 4]) == Pick(1, 8, 8)  # and stays void
    cache.clear()
    assert cache.pick(list(range(13)), [0, 1], [3, 4]) == Pick(0, 0, 0)


# ---- the scheduler over FakeEngine ---------------------------------------------------------------------------

@pytest.fixture
def station():
    made: list[tuple[FakeEngine, Scheduler]] = []

    def _make(lanes: int = 2, continuous: bool = True) -> tuple[FakeEngine, Scheduler]:
        fake = FakeEngine(lanes=lanes, chunk=CHUNK)
        sched = Scheduler(fake, continuous=continuous, max_queue=64, terminal_ids=frozenset())
        sched.start()
        made.append((fake, sched))
        return fake, sched

    yield _make
    for fake, sched in made:
        fake.release()
        assert sched.drain(TIMEOUT)


def run(sched: Scheduler, prompt: list[int], n: int, **kw):
    return sched.submit(Job(tokens=prompt, max_new_tokens=n, **kw)).result(TIMEOUT)


def assert_runs(sched: Scheduler, prompt: list[int], n: int, cached: int) -> None:
    """`prompt` gives its fresh-run tokens, with `cached` prompt tokens reused."""
    r = run(sched, prompt, n)
    assert (r.generated, r.timing["cached_tokens"]) == (expected(prompt, n), cached)


def two_cached(sched: Scheduler) -> tuple[list[int], list[int]]:
    p, q = [1] * 9, [2] * 9
    run(sched, p, 2)
    run(sched, q, 2)
    return p, q


def counters(sched: Scheduler) -> tuple[float, ...]:
    """The prefix cache's counters and the prompt tokens prefilled, as /metrics reports them."""
    names = ("prefix_cache_lookups", "prefix_cache_hits", "prefix_cache_reused_tokens",
             "prefix_cache_prefill_saved_tokens", "prompt_tokens")
    return tuple(sched.metrics.registry.get_sample_value(f"jaxstation_{n}_total") or 0.0 for n in names)


@pytest.mark.parametrize("continuous", [True, False])
@pytest.mark.parametrize("seed", [0, 77])
def test_multi_turn_reuses_only_the_prefill_written_prefix(station, continuous, seed):
    fake, sched = station(continuous=continuous)
    sampling = SamplingParams(temperature=1.0, seed=seed) if seed else SamplingParams()
    turn1 = list(range(10, 21))  # 11 tokens: chunks at 0, 4, 8
    r1 = run(sched, turn1, 6, sampling=sampling)
    assert (r1.generated, r1.timing["cached_tokens"]) == (expected(turn1, 6, seed), 0)
    turn2 = turn1 + r1.generated + [5, 6, 7]  # 20 tokens
    r2 = run(sched, turn2, 5, sampling=sampling)
    assert r2.generated == expected(turn2, 5, seed)
    # turn 1's prompt was prefill-written (11 tokens); its generated tokens were written by decode: 11 -> 8
    assert r2.timing["cached_tokens"] == 8
    assert fake.starts_of(turn2) == [8] and fake.lanes_of(turn2) == fake.lanes_of(turn1)
    turn3 = turn2 + r2.generated + [1]  # turn 2's whole prompt is now prefill-written: 20 -> 20
    r3 = run(sched, turn3, 3, sampling=sampling)
    assert (r3.generated, r3.timing["cached_tokens"]) == (expected(turn3, 3, seed), 20)
    assert counters(sched) == (3, 2, 11 + 20, 8 + 20, 11 + (20 - 8) + (26 - 20))
    assert fake.errors == []


def test_shared_system_prompt_hits_and_a_different_first_token_misses(station):
    fake, sched = station(lanes=2)
    system = list(range(100, 113))  # 13 tokens: 12 reusable
    first = run(sched, system + [1, 2], 3)
    assert first.timing["cached_tokens"] == 0
    for user in ([3], [4, 5, 6], [7] * 9):
        r = run(sched, system + user, 3)
        assert r.generated == expected(system + user, 3)
        assert r.timing["cached_tokens"] == 12
    other = [999] + system[1:] + [1, 2]  # differs in the first token only
    r = run(sched, other, 3)
    assert (r.generated, r.timing["cached_tokens"]) == (expected(other, 3), 0)
    assert fake.starts_of(other) == [0]
    assert fake.errors == []


def test_lru_eviction_with_more_prefixes_than_lanes(station):
    fake, sched = station(lanes=2)
    a, b, c = ([1] * 9, [2] * 9, [3] * 9)
    for p in (a, b):  # a in lane 0, b in lane 1
        run(sched, p, 2)
    assert run(sched, a + [4], 2).timing["cached_tokens"] == 8  # a hit: lane 0 is now the most recently used
    assert run(sched, c, 2).timing["cached_tokens"] == 0  # c evicts b (least recently used), not a
    assert fake.lanes_of(c) == fake.lanes_of(b)
    rb = run(sched, b + [4], 2)  # b is gone: a miss, never b's stale lane; it evicts a+[4] (older than c)
    assert (rb.generated, rb.timing["cached_tokens"]) == (expected(b + [4], 2), 0)
    assert fake.starts_of(b + [4]) == [0]
    assert_runs(sched, c + [5], 2, 8)
    assert_runs(sched, a + [4], 2, 0)
    assert fake.errors == []


def test_concurrent_jobs_each_take_their_own_cached_lane(station):
    fake, sched = station(lanes=3)
    prompts = [[10 + i] * 9 for i in range(3)]
    for p in prompts:
        run(sched, p, 2)
    lanes = {tuple(p): fake.lanes_of(p)[0] for p in prompts}
    fake.hold()
    futures = [sched.submit(Job(tokens=p + [7], max_new_tokens=4)) for p in reversed(prompts)]
    fake.release()
    for p, f in zip(reversed(prompts), futures, strict=True):
        r = f.result(TIMEOUT)
        assert (r.generated, r.timing["cached_tokens"]) == (expected(p + [7], 4), 8)
        assert fake.lanes_of(p + [7]) == [lanes[tuple(p)]]
    assert fake.errors == []


def test_reuse_prefix_false_prefills_everything_and_is_not_a_lookup(station):
    fake, sched = station(lanes=1)
    prompt = list(range(1, 14))
    run(sched, prompt, 2)
    r = run(sched, prompt + [1], 2, reuse_prefix=False)
    assert (r.generated, r.timing["cached_tokens"]) == (expected(prompt + [1], 2), 0)
    assert fake.starts_of(prompt + [1]) == [0]
    assert counters(sched)[:2] == (1, 0)
    assert run(sched, prompt + [2], 2).timing["cached_tokens"] == 12  # its own prefill is cached for the next
    assert fake.errors == []


def test_cancelled_mid_prefill_leaves_its_prefilled_chunks(station):
    fake, sched = station(lanes=1)
    prompt = list(range(1, 30))  # 29 tokens: 8 chunks
    job = Job(tokens=prompt, max_new_tokens=3)
    fake.on_step = lambda kind: len(fake.prefills) == 2 and sched.cancel(job)  # cancelled as its 3rd chunk starts
    sched.submit(job)
    with pytest.raises(Cancelled):
        job.future.result(TIMEOUT)
    fake.on_step = None
    assert_runs(sched, prompt, 3, 12)
    assert fake.errors == []


def test_a_failed_step_drops_every_cached_prefix(station):
    fake, sched = station(lanes=2)
    p, q = two_cached(sched)
    fake.fail_next_decode = True
    with pytest.raises(StepFailed):
        run(sched, [3] * 9, 4)
    assert fake.resets == 1
    for prompt in (p + [5], q + [5]):
        assert_runs(sched, prompt, 2, 0)
    assert fake.errors == []


def test_an_arena_rebuilt_or_lane_written_elsewhere_is_never_reused(station):
    fake, sched = station(lanes=2)
    p, q = two_cached(sched)
    fake.reset()  # e.g. rebuilt by another caller holding the engine: the scheduler saw no failure
    assert_runs(sched, p + [5], 2, 0)
    run(sched, q, 2)
    lane_q = fake.lanes_of(q)[-1]
    fake.begin(lane_q, [7] * 9, SamplingParams(), frozenset())  # someone else writes q's lane
    fake.prefill(lane_q, [7] * 9, 0, SamplingParams())
    assert_runs(sched, q + [5], 2, 0)
    assert fake.errors == []


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 130, 200])
def test_common_prefix_at_every_offset(n):
    a = tuple(range(200))
    b = a[:n] + (-1,) + a[n + 1:]
    assert common_prefix(a, b[:200]) == n
    assert common_prefix(a, a[:n]) == n
