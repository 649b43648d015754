"""Scheduler unit tests against FakeEngine (tests/fake_engine.py), with the real decode thread.

Each turn of the loop is: fill free lanes, retire cancelled lanes, run at most one prefill chunk, then one decode
wave over the lanes past their prompt. The fake's tokens are hand-computable, so both the call trace and the outputs
are asserted exactly.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest
from fake_engine import FakeEngine, expected

from jaxstation.engine import host_memory
from jaxstation.engine.activity import BUCKET_S, BUCKETS, Activity, LaneView
from jaxstation.engine.jobs import Cancelled, Job, QueueFull, ShuttingDown, StepFailed
from jaxstation.engine.metrics import StationMetrics
from jaxstation.engine.prefix_cache import PrefixCache
from jaxstation.engine.rows import SamplingParams
from jaxstation.engine.scheduler import Scheduler

TIMEOUT = 5.0


def make(lanes: int = 2, chunk: int = 4, continuous: bool = True, max_queue: int = 64,
         terminal_ids: frozenset[int] = frozenset(), **fake_kw) -> tuple[FakeEngine, Scheduler]:
    fake = FakeEngine(lanes=lanes, chunk=chunk, **fake_kw)
    return fake, Scheduler(fake, continuous=continuous, max_queue=max_queue, terminal_ids=terminal_ids)


@pytest.fixture
def stations():
    """Schedulers made by a test; each is drained (with its fake released) at teardown."""
    made: list[tuple[FakeEngine, Scheduler]] = []

    def _make(**kw):
        made.append(make(**kw))
        return made[-1]

    yield _make
    for fake, sched in made:
        fake.release()
        if sched.alive:
            assert sched.drain(TIMEOUT)


def wait_for(pred, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition never held")
        time.sleep(0.002)


def requests(sched: Scheduler, outcome: str) -> float:
    """The station's requests counter for `outcome`, as /metrics reports it."""
    return sched.metrics.registry.get_sample_value("jaxstation_requests_total", {"outcome": outcome}) or 0.0


def nth(n: int, then) -> object:
    """An on_token callback that calls `then()` at a job's n-th token."""
    seen = []
    return lambda sample: seen.append(sample.token) or (len(seen) == n and then())


def D(*lanes_prompts):  # a decode call of the trace
    return ("decode", tuple(lanes_prompts))


def P(lane, start, prompt):  # a prefill call of the trace
    return ("prefill", lane, start, tuple(prompt))


# ---- fill, retire, reuse ------------------------------------------------------------------------------------

def test_fill_retire_and_reuse_order(stations):
    fake, sched = stations(lanes=2)
    a, b, c, d, e = ([1], [2, 3], [4], [5, 6, 7], [8])
    lengths = {"a": 3, "b": 6, "c": 2, "d": 4, "e": 2}
    prompts = {"a": a, "b": b, "c": c, "d": d, "e": e}
    jobs = {k: Job(tokens=prompts[k], max_new_tokens=lengths[k]) for k in "abcde"}
    futures = {k: sched.submit(jobs[k]) for k in "abcde"}  # all queued before the thread starts
    sched.start()
    results = {k: f.result(TIMEOUT) for k, f in futures.items()}

    for k in "abcde":
        assert results[k].generated == expected(prompts[k], lengths[k])
        assert results[k].finish_reason == "length"
        assert results[k].prompt_tokens == len(prompts[k])
    assert {k: fake.lanes_of(prompts[k]) for k in "abcde"} == {"a": [0], "b": [1], "c": [0], "d": [0], "e": [1]}
    # The exact trace: a freed lane is refilled (and its prefill run) on the turn right after the retiring wave.
    assert fake.calls == [
        P(0, 0, a),
        P(1, 0, b), D((0, tuple(a))),
        D((0, tuple(a)), (1, tuple(b))),  # a retires (3 tokens)
        P(0, 0, c), D((1, tuple(b))),  # c takes lane 0 at once
        D((0, tuple(c)), (1, tuple(b))),  # c retires (2 tokens)
        P(0, 0, d), D((1, tuple(b))),
        D((0, tuple(d)), (1, tuple(b))),  # b retires (6 tokens)
        P(1, 0, e), D((0, tuple(d))),
        D((0, tuple(d)), (1, tuple(e))),  # d and e retire together
    ]
    assert fake.errors == []
    assert sched.busy_lanes == 0 and not sched.pending


def test_an_idle_thread_hands_the_freed_memory_back_once_after_work(stations, monkeypatch):
    """Idle for IDLE_RELEASE_S after a step, the decode thread hands the freed memory back, once, and outside cond;
    idle from the start, or idle again without a step since, it does not."""
    monkeypatch.setattr(host_memory, "IDLE_RELEASE_S", 0.05)
    released: list[bool] = []
    fake, sched = stations(lanes=2)

    def release(execution_threads: bool = False) -> int:  # records whether another thread can take cond meanwhile
        def take() -> None:
            if got := sched.cond.acquire(blocking=False):
                sched.cond.release()
            released.append(got)

        other = threading.Thread(target=take)
        other.start()
        other.join()
        return 0

    monkeypatch.setattr(host_memory, "release_freed_memory", release)
    sched.start()
    time.sleep(0.3)
    assert released == []  # no step yet
    for n, prompt in enumerate(([1, 2], [3]), start=1):
        assert sched.submit(Job(tokens=prompt, max_new_tokens=3)).result(TIMEOUT).generated == expected(prompt, 3)
        wait_for(lambda n=n: len(released) == n)
    time.sleep(0.3)
    assert len(released) == 2  # once after each job, not again while idle
    assert released == [True, True]  # another thread could take cond meanwhile
    assert fake.errors == []


def test_per_request_seed_changes_tokens(stations):
    fake, sched = stations(lanes=2)
    f1 = sched.submit(Job(tokens=[3, 4], max_new_tokens=4, sampling=SamplingParams(temperature=1.0, seed=7)))
    f2 = sched.submit(Job(tokens=[3, 4], max_new_tokens=4))
    sched.start()
    assert f1.result(TIMEOUT).generated == expected([3, 4], 4, seed=7)
    assert f2.result(TIMEOUT).generated == expected([3, 4], 4)
    assert fake.errors == []


def test_prefill_is_chunked_and_interleaved(stations):
    fake, sched = stations(lanes=3, chunk=4)
    short = [9]
    long1 = list(range(1, 15))  # 14 tokens: chunks at 0, 4, 8, 12
    long2 = list(range(20, 29))  # 9 tokens: chunks at 0, 4, 8
    f_short = sched.submit(Job(tokens=short, max_new_tokens=12))
    f1 = sched.submit(Job(tokens=long1, max_new_tokens=2))
    f2 = sched.submit(Job(tokens=long2, max_new_tokens=2))
    sched.start()
    assert f_short.result(TIMEOUT).generated == expected(short, 12)
    assert f1.result(TIMEOUT).generated == expected(long1, 2)
    assert f2.result(TIMEOUT).generated == expected(long2, 2)

    # Chunks go in order, the oldest prefilling lane first: long1's four chunks, then long2's three.
    assert [(lane, start) for lane, start, p in fake.prefills if p != tuple(short)] == [
        (1, 0), (1, 4), (1, 8), (1, 12), (2, 0), (2, 4), (2, 8)]
    # At most one prefill chunk per turn: once `short` decodes, every prefill chunk is followed by a decode wave
    # holding it, so it stalls by at most one chunk per token.
    kinds = [c[0] for c in fake.calls]
    assert kinds[:2] == ["prefill", "prefill"]  # short's prefill, then long1's first chunk (short not decoding yet)
    for i in range(1, len(kinds)):
        if kinds[i] == "prefill":
            assert kinds[i + 1] == "decode", fake.calls
            assert 0 in [lane for lane, _ in fake.calls[i + 1][1]]
    assert sum(k == "prefill" for k in kinds) == 1 + 4 + 3
    assert fake.errors == []


# ---- stop conditions ----------------------------------------------------------------------------------------

def _first_unique_at(seq: list[int], k: int) -> int:
    assert seq[k] not in seq[:k], "pick another prompt: the token repeats"
    return seq[k]


def test_stop_id_is_not_included(stations):
    prompt = [10, 11, 12]
    seq = expected(prompt, 10)
    stop = _first_unique_at(seq, 3)
    _, sched = stations(lanes=2)
    seen: list[int] = []
    f = sched.submit(Job(tokens=prompt, max_new_tokens=10, stop_ids=frozenset({stop, 999_999}),
                         on_token=lambda s: seen.append(s.token)))
    f_first = sched.submit(Job(tokens=prompt, max_new_tokens=10, stop_ids=frozenset({seq[0]})))
    sched.start()
    r = f.result(TIMEOUT)
    assert (r.generated, r.finish_reason) == (seq[:3], "stop")
    assert [s.token for s in r.samples] == seq[:3]
    assert seen == seq[:3]  # on_token never sees the stop token
    r0 = f_first.result(TIMEOUT)  # the very first (prefill) token is a stop id
    assert (r0.generated, r0.finish_reason) == ([], "stop")


def test_a_sentence_end_is_included_and_ends_the_request(stations):
    prompt = [7, 8]
    seq = expected(prompt, 10)
    terminal = _first_unique_at(seq, 2)
    _, sched = stations(lanes=2, terminal_ids=frozenset({terminal}))
    f_on = sched.submit(Job(tokens=prompt, max_new_tokens=10, stop_at_sentence_end=True))
    f_off = sched.submit(Job(tokens=prompt, max_new_tokens=10))
    sched.start()
    r_on, r_off = f_on.result(TIMEOUT), f_off.result(TIMEOUT)
    assert (r_on.generated, r_on.finish_reason) == (seq[:3], "sentence_end")
    assert (r_off.generated, r_off.finish_reason) == (seq, "length")


def test_max_new_tokens_one_retires_after_prefill(stations):
    fake, sched = stations(lanes=2)
    f = sched.submit(Job(tokens=[1, 2, 3, 4, 5], max_new_tokens=1))
    sched.start()
    r = f.result(TIMEOUT)
    assert (r.generated, r.finish_reason) == (expected([1, 2, 3, 4, 5], 1), "length")
    assert [c[0] for c in fake.calls] == ["prefill", "prefill"]  # two chunks, no decode


# ---- resetting the prefix cache ------------------------------------------------------------------------------

def test_a_reset_asked_mid_turn_waits_for_the_turn_and_drops_the_lane_it_freed(stations):
    """The decode thread owns the prefix cache: a reset asked while a step runs is done between that turn and the
    next, so the lane the turn frees loses its prefix too, and the cache is never changed under the thread."""
    fake, sched = stations(lanes=1, chunk=4)
    prompt = list(range(1, 10))  # 9 tokens: prefill at 0, 4 and 8, then one decode
    fake.hold()
    first = sched.submit(Job(tokens=prompt, max_new_tokens=2))
    sched.start()
    fake.step(3)
    fake.wait_blocked()  # parked in the decode step that finishes the job
    reset = sched.reset_prefix_cache()
    assert not reset.done()
    fake.release()
    assert first.result(TIMEOUT).generated == expected(prompt, 2)
    assert reset.result(TIMEOUT) == 1
    again = sched.submit(Job(tokens=prompt, max_new_tokens=2)).result(TIMEOUT)
    assert (again.generated, again.timing["cached_tokens"]) == (expected(prompt, 2), 0)
    assert fake.starts_of(prompt) == [0, 0]
    assert fake.errors == []


def test_a_reset_of_an_idle_or_unstarted_scheduler_answers_at_once(stations):
    fake, sched = stations(lanes=2, chunk=4)
    assert sched.reset_prefix_cache().result(0) == 0  # no decode thread yet
    sched.start()
    prompt = list(range(1, 10))
    assert sched.submit(Job(tokens=prompt, max_new_tokens=2)).result(TIMEOUT).timing["cached_tokens"] == 0
    assert sched.submit(Job(tokens=prompt, max_new_tokens=2)).result(TIMEOUT).timing["cached_tokens"] == 8
    assert sched.reset_prefix_cache().result(TIMEOUT) == 1
    assert sched.submit(Job(tokens=prompt, max_new_tokens=2)).result(TIMEOUT).timing["cached_tokens"] == 0
    assert fake.starts_of(prompt) == [0, 8, 0]


# ---- the published snapshot ---------------------------------------------------------------------------------

def test_the_snapshot_shows_each_lane_the_counts_and_the_cached_prefixes(stations):
    """Other threads read only `activity.snapshot`, which the decode thread replaces after its turns."""
    fake, sched = stations(lanes=2, chunk=4)
    assert sched.activity.snapshot.lanes == (LaneView("free"), LaneView("free"))
    prompt = list(range(1, 10))  # 9 tokens: prefill at 0, 4 and 8
    fake.hold()
    first = sched.submit(Job(tokens=prompt, max_new_tokens=2))
    second = sched.submit(Job(tokens=[50, 51], max_new_tokens=3))
    sched.start()
    fake.step(1)  # the first turn prefills the first chunk of lane 0 and publishes
    fake.wait_blocked()
    snap = sched.activity.snapshot
    assert snap.lanes == (LaneView("prefilling", 9, 4, 0), LaneView("prefilling", 2, 0, 0)) and snap.queued == 0
    fake.release()
    assert [first.result(TIMEOUT).generated, second.result(TIMEOUT).generated] == [expected(prompt, 2),
                                                                                 expected([50, 51], 3)]
    wait_for(lambda: sched.activity.snapshot.lanes == (LaneView("cached", 9), LaneView("cached", 2)))
    snap = sched.activity.snapshot
    assert (snap.generated_tokens, snap.prefilled_tokens, snap.prefix_lookups, snap.prefix_hits) == (5, 11, 2, 0)
    assert sched.submit(Job(tokens=prompt, max_new_tokens=2)).result(TIMEOUT).timing["cached_tokens"] == 8
    wait_for(lambda: sched.activity.snapshot.prefix_hits == 1)
    snap = sched.activity.snapshot
    assert (snap.prefix_lookups, snap.prefix_reused_tokens, snap.prefilled_tokens) == (3, 8, 12)


def test_the_snapshot_rates_cover_the_last_complete_buckets():
    now = [100.0]
    activity = Activity(1, StationMetrics(), clock=lambda: now[0])
    for _ in range(10):
        activity.generated()
    activity.prefilled(20)
    activity.publish([None], 0, PrefixCache(1, 4))
    snap = activity.snapshot
    assert snap.rates(now[0]) == ([0.0] * BUCKETS, [0.0] * BUCKETS)  # its bucket is not over yet
    generated, prefilled = snap.rates(now[0] + BUCKET_S)
    assert len(generated) == BUCKETS and generated[-1] == 10 / BUCKET_S and prefilled[-1] == 20 / BUCKET_S
    assert sum(snap.rates(now[0] + BUCKET_S * (BUCKETS + 1))[0]) == 0  # out of the window: an idle station reads 0
    assert activity.metrics.registry.get_sample_value("jaxstation_generated_tokens_total") == 10


# ---- cancellation -------------------------------------------------------------------------------------------

def test_cancel_running_job_frees_its_lane_within_one_wave(stations):
    fake, sched = stations(lanes=2)
    a, b, c = [1], [2], [3]
    job_a = Job(tokens=a, max_new_tokens=100)
    job_a.on_token = nth(3, lambda: sched.cancel(job_a))
    fa = sched.submit(job_a)
    fb = sched.submit(Job(tokens=b, max_new_tokens=6))
    fc = sched.submit(Job(tokens=c, max_new_tokens=2))
    sched.start()
    with pytest.raises(Cancelled):
        fa.result(TIMEOUT)
    assert fb.result(TIMEOUT).generated == expected(b, 6)
    assert fc.result(TIMEOUT).generated == expected(c, 2)
    assert fake.calls[:7] == [
        P(0, 0, a),
        P(1, 0, b), D((0, (1,))),
        D((0, (1,)), (1, (2,))),  # a's 3rd token: cancelled
        D((1, (2,))),  # the next turn retires a: one wave without it
        P(0, 0, c), D((1, (2,))),  # and the turn after, c fills lane 0
    ]
    assert fake.lanes_of(c) == [0]
    assert fake.errors == []


def test_finish_early_retires_as_stop_with_the_tokens_so_far(stations):
    fake, sched = stations(lanes=1)
    a, b = [1], [2]
    job_a = Job(tokens=a, max_new_tokens=100)
    job_a.on_token = nth(3, lambda: sched.finish_early(job_a))
    fa = sched.submit(job_a)
    fb = sched.submit(Job(tokens=b, max_new_tokens=2))
    sched.start()
    ra = fa.result(TIMEOUT)
    assert (ra.generated, ra.finish_reason) == (expected(a, 3), "stop")
    assert fb.result(TIMEOUT).generated == expected(b, 2)
    assert fake.lanes_of(b) == [0]
    assert requests(sched, "ok") == 2
    assert requests(sched, "cancelled") == 0
    assert fake.errors == []


def test_cancel_from_another_thread_mid_wave(stations):
    fake, sched = stations(lanes=1)
    fake.hold()
    job_a = Job(tokens=[1], max_new_tokens=1000)
    fa = sched.submit(job_a)
    fb = sched.submit(Job(tokens=[2], max_new_tokens=3))
    sched.start()
    fake.step(5)
    fake.wait_blocked()  # parked inside a's 6th step
    assert fake.lanes_of([1]) == [0] and not fa.done()
    sched.cancel(job_a)
    fake.release()
    with pytest.raises(Cancelled):
        fa.result(TIMEOUT)
    assert fb.result(TIMEOUT).generated == expected([2], 3)
    # a ran its prefill and 5 decodes (the held 6th completes), then b took its lane
    assert [c[0] for c in fake.calls] == ["prefill"] + ["decode"] * 5 + ["prefill", "decode", "decode"]
    assert fake.errors == []


def test_cancelled_pending_job_never_runs(stations):
    fake, sched = stations(lanes=1)
    fake.hold()
    fa = sched.submit(Job(tokens=[1], max_new_tokens=3))
    job_b = Job(tokens=[2], max_new_tokens=3)
    fb = sched.submit(job_b)
    fc = sched.submit(Job(tokens=[3], max_new_tokens=3))
    sched.start()
    fake.wait_blocked()  # a is in lane 0, b and c wait
    sched.cancel(job_b)
    fake.release()
    assert fa.result(TIMEOUT).generated == expected([1], 3)
    with pytest.raises(Cancelled):
        fb.result(TIMEOUT)
    assert fc.result(TIMEOUT).generated == expected([3], 3)
    assert fake.lanes_of([2]) == []
    assert fake.lanes_of([3]) == [0]


def test_cancelled_pending_job_does_not_hold_up_the_freed_lane(stations):
    fake, sched = stations(lanes=2)
    a, b, c, d = [1], [2], [3], [4]
    fa = sched.submit(Job(tokens=a, max_new_tokens=3))
    fb = sched.submit(Job(tokens=b, max_new_tokens=8))
    job_c = Job(tokens=c, max_new_tokens=3)
    fc = sched.submit(job_c)
    fd = sched.submit(Job(tokens=d, max_new_tokens=2))
    sched.cancel(job_c)
    sched.start()
    assert fa.result(TIMEOUT).generated == expected(a, 3)
    assert fb.result(TIMEOUT).generated == expected(b, 8)
    assert fd.result(TIMEOUT).generated == expected(d, 2)
    with pytest.raises(Cancelled):
        fc.result(TIMEOUT)
    assert fake.calls[:6] == [
        P(0, 0, a),
        P(1, 0, b), D((0, (1,))),
        D((0, (1,)), (1, (2,))),  # a retires
        P(0, 0, d), D((1, (2,))),  # the next fill skips the cancelled c and gives lane 0 to d at once
    ]


def test_future_cancelled_by_its_caller_does_not_fail_the_wave(stations):
    fake, sched = stations(lanes=2)
    fake.hold()
    fa = sched.submit(Job(tokens=[1], max_new_tokens=4))
    fb = sched.submit(Job(tokens=[2], max_new_tokens=6))
    sched.start()
    fake.wait_blocked()
    assert fa.cancel()  # concurrent.futures lets a caller cancel a pending Future (e.g. via asyncio.wrap_future)
    fake.release()
    assert fb.result(TIMEOUT).generated == expected([2], 6)
    assert fa.cancelled()
    assert fake.resets == 0
    assert requests(sched, "error") == 0



def test_a_reset_whose_caller_went_away_leaves_the_decode_thread_serving(stations):
    """A handler awaiting /reset_prefix_cache through asyncio.wrap_future is cancelled (a shutdown): that cancels
    the reset's Future, which the decode thread answers later."""
    fake, sched = stations(lanes=1)
    fake.hold()
    first = sched.submit(Job(tokens=[1], max_new_tokens=2))
    sched.start()
    fake.wait_blocked()

    async def reset_then_go_away() -> None:
        task = asyncio.ensure_future(asyncio.wrap_future(sched.reset_prefix_cache()))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(reset_then_go_away())
    fake.release()
    assert first.result(TIMEOUT).generated == expected([1], 2)
    assert sched.submit(Job(tokens=[2], max_new_tokens=2)).result(TIMEOUT).generated == expected([2], 2)
    assert sched.alive and requests(sched, "error") == 0


def test_cancelled_queued_jobs_leave_the_queue_at_once(stations):
    """After a partial QueueFull a request cancels the jobs it queued (chat.run): they free their slots at once,
    not when the decode thread reaches them."""
    fake, sched = stations(lanes=1, max_queue=3)
    fake.hold()
    running = sched.submit(Job(tokens=[1], max_new_tokens=2))
    sched.start()
    fake.wait_blocked()  # lane 0 is busy; the decode thread is parked in a step
    queued = [Job(tokens=[i], max_new_tokens=2) for i in (2, 3, 4)]
    futures = [sched.submit(job) for job in queued]
    with pytest.raises(QueueFull):
        sched.submit(Job(tokens=[5], max_new_tokens=2))
    for job in queued:
        sched.cancel(job)
    depth = sched.metrics.registry.get_sample_value("jaxstation_queue_depth")
    assert (len(sched.pending), depth) == (0, 0)
    for future in futures:
        with pytest.raises(Cancelled):
            future.result(0)
    later = sched.submit(Job(tokens=[6], max_new_tokens=2))
    fake.release()
    assert running.result(TIMEOUT).generated == expected([1], 2)
    assert later.result(TIMEOUT).generated == expected([6], 2)
    assert fake.lanes_of([2]) == fake.lanes_of([3]) == fake.lanes_of([4]) == []
    assert requests(sched, "cancelled") == 3


def test_raising_on_token_cancels_only_its_own_job(stations):
    fake, sched = stations(lanes=2)
    seen_a: list[int] = []
    seen_b: list[int] = []

    def bad(sample):
        seen_a.append(sample.token)
        if len(seen_a) == 2:
            raise ValueError("consumer broke")

    fa = sched.submit(Job(tokens=[4, 4], max_new_tokens=50, on_token=bad))
    fb = sched.submit(Job(tokens=[5], max_new_tokens=8, on_token=lambda s: seen_b.append(s.token)))
    sched.start()
    with pytest.raises(Cancelled):
        fa.result(TIMEOUT)
    rb = fb.result(TIMEOUT)
    assert rb.generated == expected([5], 8)
    assert seen_b == rb.generated  # once per token, in order
    assert seen_a == expected([4, 4], 2)
    assert fake.errors == []


# ---- step failure -------------------------------------------------------------------------------------------

def test_step_exception_fails_only_the_jobs_in_flight(stations):
    fake, sched = stations(lanes=2)

    trip = nth(2, lambda: setattr(fake, "fail_next_decode", True))  # a's 2nd token: the next decode raises
    fa = sched.submit(Job(tokens=[1], max_new_tokens=10, on_token=trip))
    fb = sched.submit(Job(tokens=[2], max_new_tokens=10))
    fc = sched.submit(Job(tokens=[3], max_new_tokens=4))
    fd = sched.submit(Job(tokens=[4, 5], max_new_tokens=3))
    sched.start()
    for f in (fa, fb):
        with pytest.raises(StepFailed, match="step failed: RuntimeError: boom"):
            f.result(TIMEOUT)
    assert fc.result(TIMEOUT).generated == expected([3], 4)
    assert fd.result(TIMEOUT).generated == expected([4, 5], 3)
    assert fake.resets == 1
    assert fake.lanes_of([3]) == [0] and fake.lanes_of([4, 5]) == [1]
    assert sched.alive
    assert requests(sched, "error") == 2
    assert requests(sched, "ok") == 2
    assert fake.errors == []


def test_prefill_exception_fails_the_lanes_and_serving_goes_on(stations):
    fake, sched = stations(lanes=2)
    fake.fail_next_prefill = True
    fa = sched.submit(Job(tokens=[1], max_new_tokens=3))
    sched.start()
    with pytest.raises(StepFailed, match="boom"):
        fa.result(TIMEOUT)
    fb = sched.submit(Job(tokens=[2], max_new_tokens=3))
    assert fb.result(TIMEOUT).generated == expected([2], 3)
    assert fake.resets == 1


# ---- backpressure and shutdown ------------------------------------------------------------------------------

def test_queue_full_past_max_queue(stations):
    fake, sched = stations(lanes=1, max_queue=3)
    futures = [sched.submit(Job(tokens=[i], max_new_tokens=2)) for i in range(3)]
    with pytest.raises(QueueFull):
        sched.submit(Job(tokens=[9], max_new_tokens=2))
    assert len(sched.pending) == 3
    sched.start()
    for i, f in enumerate(futures):
        assert f.result(TIMEOUT).generated == expected([i], 2)
    assert sched.submit(Job(tokens=[9], max_new_tokens=2)).result(TIMEOUT).generated == expected([9], 2)


def test_drain_finishes_in_flight_and_queued_work_then_stops(stations):
    fake, sched = stations(lanes=1)
    fake.hold()
    fa = sched.submit(Job(tokens=[1], max_new_tokens=4))
    fb = sched.submit(Job(tokens=[2], max_new_tokens=2))
    sched.start()
    fake.wait_blocked()
    outcome: list[bool] = []
    drainer = threading.Thread(target=lambda: outcome.append(sched.drain(TIMEOUT)))
    drainer.start()
    wait_for(lambda: not sched.accepting)
    with pytest.raises(ShuttingDown):
        sched.submit(Job(tokens=[3], max_new_tokens=2))
    assert not fa.done()
    fake.release()
    drainer.join(TIMEOUT)
    assert outcome == [True]
    assert fa.result(0).generated == expected([1], 4)
    assert fb.result(0).generated == expected([2], 2)
    assert not sched.alive
    with pytest.raises(ShuttingDown):
        sched.submit(Job(tokens=[3], max_new_tokens=2))


def test_drain_timeout_fails_the_rest_with_shutting_down(stations):
    fake, sched = stations(lanes=1, step_delay=0.005)
    fa = sched.submit(Job(tokens=[1], max_new_tokens=10_000))
    fb = sched.submit(Job(tokens=[2], max_new_tokens=2))
    sched.start()
    wait_for(lambda: len(fake.calls) > 2)
    assert sched.drain(0.2) is False
    assert not sched.alive
    for f in (fa, fb):
        with pytest.raises(ShuttingDown):
            f.result(0)


def test_drain_deadline_answers_every_job_before_the_thread_ends(stations):
    """The server reads a dead decode thread with an unanswered Future as a crash (500): at the drain deadline the
    queued job must be failed (never started) and the running one failed by the decode thread on its way out."""
    fake, sched = stations(lanes=1, continuous=False, step_delay=0.005)
    running = Job(tokens=[1], max_new_tokens=10_000)
    queued = Job(tokens=[2], max_new_tokens=2)
    thread_alive_when_answered: dict[str, bool] = {}
    for name, job in (("running", running), ("queued", queued)):
        job.future.add_done_callback(lambda f, name=name: thread_alive_when_answered.setdefault(name, sched.alive))
        sched.submit(job)
    sched.start()
    wait_for(lambda: len(fake.calls) > 2)
    assert sched.drain(0.2) is False
    assert thread_alive_when_answered == {"running": True, "queued": True}
    with pytest.raises(ShuttingDown, match="before this request started"):
        queued.future.result(0)
    with pytest.raises(ShuttingDown, match="before this request finished"):
        running.future.result(0)
    assert all(call[0] != "prefill" or call[3] != (2,) for call in fake.calls)  # the queued job never ran


def test_idle_thread_sleeps(stations):
    fake, sched = stations(lanes=2)
    sched.start()
    assert sched.submit(Job(tokens=[1], max_new_tokens=5)).result(TIMEOUT).generated == expected([1], 5)
    time.sleep(0.05)
    waves, calls = sched.waves, len(fake.calls)
    assert waves == 5  # 1 prefill + 4 decodes
    time.sleep(0.3)
    assert (sched.waves, len(fake.calls)) == (waves, calls)
    # no busy loop: the thread is parked in Condition.wait
    thread = next(t for t in threading.enumerate() if t.name == "jaxstation-decode")
    frame = sys._current_frames()[thread.ident]
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    assert names[0] == "wait" and "_run" in names
    assert sched.alive
    # and it wakes for new work
    assert sched.submit(Job(tokens=[2], max_new_tokens=2)).result(TIMEOUT).generated == expected([2], 2)


# ---- serialize-all ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("continuous", [False, True])
def test_serialize_all_runs_one_job_at_a_time(stations, continuous):
    fake, sched = stations(lanes=3, continuous=continuous)
    busy: list[int] = []
    fake.on_step = lambda kind: busy.append(sched.busy_lanes)
    prompts = [[1], list(range(2, 9)), [3, 3], [4] * 5, [5]]
    lengths = [4, 3, 6, 2, 5]
    futures = [sched.submit(Job(tokens=p, max_new_tokens=n)) for p, n in zip(prompts, lengths, strict=True)]
    sched.start()
    for p, n, f in zip(prompts, lengths, futures, strict=True):
        assert f.result(TIMEOUT).generated == expected(p, n)  # same tokens in either mode
    if continuous:
        assert max(busy) == 3
    else:
        assert max(busy) == 1
        assert all(len(w) == 1 for w in fake.decode_waves)
        # each job's calls are one contiguous block, in submission order
        owners = [c[3] if c[0] == "prefill" else c[1][0][1] for c in fake.calls]
        blocks = [o for i, o in enumerate(owners) if i == 0 or o != owners[i - 1]]
        assert blocks == [tuple(p) for p in prompts]
    assert fake.errors == []
