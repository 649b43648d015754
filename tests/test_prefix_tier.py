"""The prefix cache's host tier (engine/prefix_tier.py): its entries and their bound, the scheduler's use of it on the
fake engine, its setting, on the default model a restore that gives the bits of a fresh prefill, and on a tiny model
the same with int8 and bfloat16 KV and under a LoRA adapter (whose entries no other adapter or the base restores)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from adapter_util import random_lora, write_peft
from conftest import FIXTURES
from fake_engine import FakeEngine, expected

from jaxstation.config.memory import PREFIX_CACHE_RAM_CAP, prefix_cache_ram
from jaxstation.config.settings import ConfigError, MiB, StationConfig, resolve
from jaxstation.engine.engine import Engine
from jaxstation.engine.jobs import Job, Result, StepFailed
from jaxstation.engine.prefix_entries import TierEntry
from jaxstation.engine.prefix_tier import HostTier
from jaxstation.engine.rows import SamplingParams
from jaxstation.engine.scheduler import Scheduler
from jaxstation.model.loader import load_model
from jaxstation.server.adapters import Adapters

TIMEOUT = 120
SEEDED = SamplingParams(temperature=0.9, top_k=50, seed=99)
GREEDY = SamplingParams()


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 49152, size=n).tolist()


def run(sched: Scheduler, prompt: list[int], n: int, sampling: SamplingParams = GREEDY,
        reuse: bool = True) -> Result:
    return sched.submit(Job(tokens=prompt, max_new_tokens=n, sampling=sampling, reuse_prefix=reuse)).result(TIMEOUT)


def saved(sched: Scheduler, tier: str) -> float:
    """Prompt tokens not prefilled thanks to `tier` (lane or memory), as /metrics reports them."""
    return sched.metrics.registry.get_sample_value("jaxstation_prefix_cache_tier_saved_tokens_total",
                                                   {"tier": tier}) or 0.0


# ---- the entries and their bound -------------------------------------------------------------------------------

def entry(tokens: list[int], adapter: int = 0) -> TierEntry:
    return TierEntry(tuple(tokens), adapter, np.zeros((len(tokens), 10), np.uint8))  # 10 bytes a token


def test_the_least_recently_used_entry_goes_first_and_the_bytes_stay_bound() -> None:
    tier = HostTier(capacity=20 * 10, chunk=4)  # 20 tokens
    a, b, c = [1] * 8, [2] * 8, [3] * 8
    assert tier.put(entry(a)) == tier.put(entry(b)) == 0
    found = tier.find(a + [9], 0, tier.chunk)
    tier.used(found.entry)  # a is the most recent now
    assert found.matched == 8
    assert tier.find(b + [9], 1, tier.chunk) is None  # another adapter's prompt reuses nothing
    assert tier.put(entry(c)) == 1  # 24 tokens: b, the least recently used, goes
    assert tier.keys() == [(0, tuple(a)), (0, tuple(c))] and tier.nbytes == 160 <= tier.capacity
    assert tier.put(entry([4] * 12)) == 1 and tier.keys() == [(0, tuple(c)), (0, (4,) * 12)]
    assert tier.nbytes == 200 <= tier.capacity and tier.evictions == 2
    assert tier.put(entry([5] * 24)) == 0 and len(tier) == 2  # larger than the whole tier: not kept


def test_an_entry_replaces_those_it_extends_and_a_covered_one_is_not_kept() -> None:
    tier = HostTier(capacity=1000, chunk=4)
    tier.put(entry([1] * 4))
    tier.put(entry([1] * 8))
    assert tier.keys() == [(0, (1,) * 8)] and tier.nbytes == 80
    assert tier.covering((1,) * 4, 0) is not None and tier.covering((1,) * 4, 7) is None


def windowed(tokens: list[int], *restarts: int) -> TierEntry:
    """An entry with rings: 10 bytes a token, 3 a window copy."""
    windows = tuple((n, np.zeros(3, np.uint8)) for n in restarts)
    return TierEntry(tuple(tokens), 0, np.zeros((len(tokens), 10), np.uint8), windows)


def test_with_rings_an_entry_restarts_only_at_its_windows_and_takes_over_those_it_extends() -> None:
    """An entry with rings restarts at the furthest of its windows at or below the match, not at any chunk boundary;
    an entry that extends another keeps the other's windows (a turn's prompt end stays a restart point)."""
    tier = HostTier(capacity=1000, chunk=4)
    first = [1] * 8
    tier.put(windowed(first, 8))
    assert reach(tier, first + [2] * 5) == (8, 8)
    second = first + [2] * 8
    tier.put(windowed(second, 16))
    assert tier.keys() == [(0, tuple(second))] and tier.nbytes == 16 * 10 + 2 * 3
    found = tier.find(first + [2] * 6 + [5] * 3, 0, tier.chunk)  # matches 14: restarts at 8
    assert (found.entry.tokens, found.matched, found.reused, found.entry.restarts) == (tuple(second), 14, 8, (8, 16))
    assert reach(tier, second + [5]) == (16, 16)
    assert tier.find([1] * 7, 0, tier.chunk) is None  # matches 6, below the first window
    assert tier.find([1] * 6 + [3] * 4, 0, tier.chunk) is None


def reach(tier: HostTier, prompt: list[int]) -> tuple[int, int]:
    """(the prompt tokens the tier's best entry matches, its restart point for them)."""
    found = tier.find(prompt, 0, tier.chunk)
    return found.matched, found.reused


# ---- the scheduler, on the fake engine -------------------------------------------------------------------------

def test_conversations_beyond_the_lanes_resume_from_the_tier_on_the_fake_engine() -> None:
    fake = FakeEngine(lanes=2, chunk=4)
    sched = Scheduler(fake, continuous=True, max_queue=64, terminal_ids=frozenset(), prefix_cache_ram=MiB)
    sched.start()
    try:
        turns = [[10 * c + i for i in range(9)] for c in range(1, 5)]  # 4 conversations on 2 lanes
        for prompt in turns:
            assert run(sched, prompt, 3).generated == expected(prompt, 3)
        for prompt in turns:  # the next turn: prompt 9 tokens, 8 cached (two chunks), found in memory
            nxt = prompt + expected(prompt, 3) + [7]
            r = run(sched, nxt, 2)
            assert (r.generated, r.timing["cached_tokens"]) == (expected(nxt, 2), 8)
        assert not fake.errors
        assert (saved(sched, "memory"), saved(sched, "lane")) == (32, 0)
        assert [c[0] for c in fake.calls].count("restore") == 4
    finally:
        assert sched.drain(10)


def test_the_tier_evicts_the_least_recently_used_conversation_within_its_bytes() -> None:
    fake = FakeEngine(lanes=2, chunk=4)  # an entry: 16 bytes a token (`FakeEngine.save_prefix`)
    sched = Scheduler(fake, continuous=True, max_queue=64, terminal_ids=frozenset(), prefix_cache_ram=2 * 8 * 16)
    value = sched.metrics.registry.get_sample_value
    sched.start()
    try:
        turns = [[10 * c + i for i in range(9)] for c in range(1, 5)]  # 8 tokens cached each: two fit
        for prompt in turns:
            run(sched, prompt, 3)
        cached = []
        for prompt in turns:  # c0 is reused (and so more recent than c1), then c1 is gone: c2's spill evicted it
            nxt = prompt + expected(prompt, 3) + [7]
            r = run(sched, nxt, 2)
            assert r.generated == expected(nxt, 2)
            assert value("jaxstation_prefix_cache_memory_bytes") <= 2 * 8 * 16
            cached.append(r.timing["cached_tokens"])
        assert cached == [8, 0, 8, 0] and not fake.errors
        # evicted: c1 (by c2's spill), c0 (by c3's), c3 and c2 (by c0's next turn, 12 tokens), c0's next turn (by c1's)
        assert value("jaxstation_prefix_cache_memory_evictions_total") == 5
    finally:
        assert sched.drain(10)


class RingedFake(FakeEngine):
    """The fake engine with rings: `save_window` copies the lane's records of the 3 positions before n (a window of
    4), and `restore_prefix` needs one taken at the same n. `fail_next_window` makes the next copy raise."""

    arena = SimpleNamespace(rings=(), k=jax.numpy.zeros(0))
    cfg = SimpleNamespace(sliding_window=4)  # inner restart points every 8 tokens at 4-token chunks

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.fail_next_window = False

    def save_window(self, lane: int, n: int) -> np.ndarray:
        self.calls.append(("window", lane, n))
        if self.fail_next_window:
            self.fail_next_window = False
            raise MemoryError("no host memory for the window")
        return self.save_prefix(lane, n)[n - 3:]

    def restore_prefix(self, lane: int, kv: np.ndarray, n: int, window: np.ndarray | None = None) -> None:
        if window is None or not np.array_equal(window, kv[n - 3:n]):
            self.errors.append(f"lane {lane} restored at {n} without the window before it")
        super().restore_prefix(lane, kv, n)


def test_with_rings_a_next_turn_restarts_at_the_previous_prompts_end_and_only_there(
        caplog: pytest.LogCaptureFixture) -> None:
    """Rings on the fake engine: each prompt's window is copied as its prefill ends; a next turn after its lane was
    taken restarts at the previous prompt's last boundary (8), a prompt that leaves it at 6 restarts nowhere (no
    window at 4), and a prompt whose window copy failed is not kept."""
    fake = RingedFake(lanes=2, chunk=4)
    sched = Scheduler(fake, continuous=True, max_queue=64, terminal_ids=frozenset(), prefix_cache_ram=MiB)
    sched.start()
    try:
        a, b, c = [[10 * k + i for i in range(9)] for k in (1, 2, 3)]
        run(sched, a, 3)
        fake.fail_next_window = True
        with caplog.at_level("WARNING", logger="jaxstation.engine.prefix_windows"):
            run(sched, b, 3)
        assert [r.getMessage() for r in caplog.records] == [
            "prefix cache in host memory: saving lane 1's window before 8 failed (MemoryError: no host memory for "
            "the window); not kept"]
        run(sched, c, 3)  # takes a's lane: a goes to memory with its window
        run(sched, [5] * 9, 3)  # takes b's lane: b has no window, and is not kept
        assert sched.prefix_tier.host.keys() == [(0, tuple(a[:8]))]
        assert [c for c in fake.calls if c[0] == "window"] == [("window", lane, 8) for lane in (0, 1, 0, 1)]
        r = run(sched, a[:6] + [1] * 5, 2)  # matches 6: no restart point at or below it
        assert r.timing["cached_tokens"] == 0
        r = run(sched, next_turn(b), 2)
        assert (r.generated, r.timing["cached_tokens"]) == (expected(next_turn(b), 2), 0)
        r = run(sched, next_turn(a), 2)
        assert (r.generated, r.timing["cached_tokens"]) == (expected(next_turn(a), 2), 8)
        assert not fake.errors and saved(sched, "memory") == 8
    finally:
        assert sched.drain(10)


# ---- failed copies: what they cost is reuse, never a request or the decode thread --------------------------------

def tiered_fake(lanes: int = 2) -> tuple[FakeEngine, Scheduler]:
    fake = FakeEngine(lanes=lanes, chunk=4)
    sched = Scheduler(fake, continuous=True, max_queue=64, terminal_ids=frozenset(), prefix_cache_ram=MiB)
    sched.start()
    return fake, sched


def next_turn(prompt: list[int]) -> list[int]:
    return prompt + expected(prompt, 3) + [7]


def test_a_failed_save_keeps_nothing_and_the_request_completes(caplog: pytest.LogCaptureFixture) -> None:
    fake, sched = tiered_fake()
    try:
        a, b, c = [[10 * k + i for i in range(9)] for k in (1, 2, 3)]
        run(sched, a, 3)
        run(sched, b, 3)
        fake.fail_next_save = True  # c takes a's lane: a's KV is saved, and that copy raises MemoryError
        with caplog.at_level("WARNING", logger="jaxstation.engine.prefix_tier"):
            assert run(sched, c, 3).generated == expected(c, 3)
        assert [r.getMessage() for r in caplog.records] == [
            "prefix cache in host memory: saving lane 0's 8 tokens failed (MemoryError: no host memory for the "
            "copy); not kept"]
        assert ("save", 0, 8) in fake.calls and len(sched.prefix_tier.host) == 0
        r = run(sched, next_turn(a), 2)  # a's KV was not kept: a fresh prefill, the same tokens
        assert (r.generated, r.timing["cached_tokens"]) == (expected(next_turn(a), 2), 0)
        r = run(sched, next_turn(b), 2)  # b was spilled by a's turn, and comes back from memory
        assert (r.generated, r.timing["cached_tokens"]) == (expected(next_turn(b), 2), 8)
        assert sched.alive and requests_ok(sched) == 5 and not fake.errors and fake.resets == 0
    finally:
        assert sched.drain(10)


def test_a_failed_restore_drops_its_entry_and_the_request_prefills_afresh(caplog: pytest.LogCaptureFixture) -> None:
    fake, sched = tiered_fake()
    try:
        turns = [[10 * k + i for i in range(9)] for k in range(1, 5)]  # 4 conversations on 2 lanes: 2 in memory
        for prompt in turns:
            run(sched, prompt, 3)
        assert len(sched.prefix_tier.host) == 2
        fake.fail_next_restore = True  # writes one chunk of the entry into the lane, then raises
        first = next_turn(turns[0])
        with caplog.at_level("WARNING", logger="jaxstation.engine.prefix_tier"):
            r = run(sched, first, 2)
        assert (r.generated, r.timing["cached_tokens"]) == (expected(first, 2), 0)
        assert fake.starts_of(first) == [0] and ("restore", 0, 8) in fake.calls
        assert [r.getMessage() for r in caplog.records] == [
            "prefix cache in host memory: restoring 8 tokens into lane 0 failed (RuntimeError: restore boom); the "
            "request prefills afresh"]
        assert (0, tuple(turns[0][:8])) not in sched.prefix_tier.host.keys()  # the entry is gone
        assert saved(sched, "memory") == 0
        second = next_turn(turns[1])  # the next request is served, from memory
        r = run(sched, second, 2)
        assert (r.generated, r.timing["cached_tokens"]) == (expected(second, 2), 8)
        again = first + [5]  # the half-written lane was never offered for reuse: first's own prefill is
        r = run(sched, again, 2)
        assert r.generated == expected(again, 2) and fake.starts_of(again) == [12]
        assert sched.alive and requests_ok(sched) == 7 and not fake.errors and fake.resets == 0
    finally:
        assert sched.drain(10)


def test_a_tier_that_raises_fails_its_turn_as_a_step_does_and_serving_goes_on() -> None:
    fake, sched = tiered_fake()
    try:
        admit, trips = sched.prefix_tier.admit, []

        def broken(a):  # the first admission raises past the tier's own handling
            if not trips:
                trips.append(a)
                raise MemoryError("out of host memory")
            return admit(a)

        sched.prefix_tier.admit = broken
        with pytest.raises(StepFailed, match="step failed: MemoryError: out of host memory"):
            run(sched, [1, 2, 3], 3)
        assert sched.alive and fake.resets == 1
        assert run(sched, [4, 5, 6], 3).generated == expected([4, 5, 6], 3)
        assert requests_ok(sched) == 1 and not fake.errors
    finally:
        assert sched.drain(10)


def requests_ok(sched: Scheduler) -> float:
    return sched.metrics.registry.get_sample_value("jaxstation_requests_total", {"outcome": "ok"}) or 0.0


# ---- the setting ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["lots", "1.5"])
def test_a_bad_prefix_cache_ram_names_what_the_user_typed(text: str) -> None:
    with pytest.raises(ConfigError, match=f"MOONSHINE_PREFIX_CACHE_RAM='{text}' is not an integer"):
        resolve(None, {"MOONSHINE_PREFIX_CACHE_RAM": text})
    with pytest.raises(ConfigError, match="MOONSHINE_PREFIX_CACHE_RAM=-3 must be >= 0"):
        resolve(None, {"MOONSHINE_PREFIX_CACHE_RAM": "-3"})


def test_prefix_cache_ram_defaults_to_a_quarter_of_free_ram_at_most_8_gib() -> None:
    assert prefix_cache_ram(StationConfig(), available=4 << 30) == 1 << 30
    assert prefix_cache_ram(StationConfig(), available=64 << 30) == PREFIX_CACHE_RAM_CAP == 8 << 30
    assert prefix_cache_ram(StationConfig(prefix_cache_ram=0)) == 0
    assert prefix_cache_ram(StationConfig(prefix_cache_ram=3), available=0) == 3 * MiB
    assert prefix_cache_ram(StationConfig(prefix_reuse="off")) == 0
    assert resolve(None, {"MOONSHINE_PREFIX_CACHE_RAM": "512"}).prefix_cache_ram == 512


# ---- the default model ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiered(engine: Engine):
    sched = Scheduler(engine, continuous=True, max_queue=64, terminal_ids=frozenset(), prefix_cache_ram=64 * MiB)
    sched.start()
    yield sched
    assert sched.drain(10)


def assert_same_samples(got: Result, ref: Result) -> None:
    assert (got.generated, got.finish_reason) == (ref.generated, ref.finish_reason)
    assert [(s.logprob, s.top) for s in got.samples] == [(s.logprob, s.top) for s in ref.samples]


def test_a_restore_from_memory_gives_a_fresh_prefills_bits(engine: Engine, tiered: Scheduler) -> None:
    first = ids(1, 70)
    r1 = run(tiered, first, 4, SEEDED)
    for i in range(engine.lanes):  # a prompt per lane, the last into first's lane: first's KV goes to memory
        run(tiered, ids(100 + i, 40), 1)
    target = first + r1.generated + ids(2, 9)
    memory = saved(tiered, "memory")
    hit = run(tiered, target, 6, SEEDED)
    assert hit.timing["cached_tokens"] == 64 and saved(tiered, "memory") == memory + 64
    fresh = run(tiered, target, 6, SEEDED, reuse=False)
    assert_same_samples(hit, fresh)
    # beside other requests: the target's lane was taken again by the fresh run; neighbours decode beside it
    for i in range(engine.lanes):
        run(tiered, ids(200 + i, 40), 1)
    neighbours = [tiered.submit(Job(tokens=ids(300 + i, 30 + 20 * i), max_new_tokens=20)) for i in range(2)]
    busy = run(tiered, target, 6, SEEDED)
    assert busy.timing["cached_tokens"] == 64
    assert_same_samples(busy, fresh)
    assert all(f.result(TIMEOUT).generated for f in neighbours)
    value = tiered.metrics.registry.get_sample_value
    assert 0 < value("jaxstation_prefix_cache_memory_bytes") <= 64 * MiB
    assert value("jaxstation_prefix_cache_memory_entries") >= 1


# ---- a tiny model: the smaller KV dtypes and a LoRA adapter -----------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gemma3():
    return load_model(str(FIXTURES / "tiny-gemma3"), "float32", "unroll", "kernel")


def small_engine(model, kv_dtype: str = "auto", max_loras: int = 0, attention: str = "blocked") -> Engine:
    """Tiny Gemma 3 (a ring of its windowed layers' window), two lanes, 8-token chunks, one decode wave width: few
    and small programs."""
    return Engine(model, lanes=2, max_seq=64, chunk=8, block=16, attention=attention, prefill_budget=16,
                  wave_widths=(2,), kv_dtype=kv_dtype, max_loras=max_loras, max_lora_rank=4)


def small_ids(seed: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def turn(sched: Scheduler, prompt: list[int], n: int, sampling: SamplingParams = GREEDY, reuse: bool = True,
         adapter=None) -> Job:
    lora = {"lora": adapter.slot, "lora_load": adapter.load} if adapter is not None else {}
    job = Job(tokens=prompt, max_new_tokens=n, sampling=sampling, reuse_prefix=reuse, **lora)
    sched.submit(job)
    return job


def take_the_lanes(sched: Scheduler, engine: Engine, seed: int) -> None:
    for i in range(engine.lanes):  # other prompts take every lane: the next hit can come from the tier only
        turn(sched, small_ids(seed + i, 12, engine.cfg.vocab_size), 1).future.result(TIMEOUT)


def assert_restarts_as_fresh(sched: Scheduler, target: list[int], restart: int, beside: bool) -> None:
    """`target` (seeded) restarts at `restart` from the tier in memory, alone or beside a request decoding in the other
    lane, and gives a fresh prefill's tokens and logprobs."""
    memory = saved(sched, "memory")
    neighbour = turn(sched, small_ids(40, 20, sched.engine.cfg.vocab_size), 8) if beside else None
    hit = turn(sched, target, 6, SEEDED)
    got = hit.future.result(TIMEOUT)
    assert hit.cached_tokens == restart and saved(sched, "memory") == memory + restart
    assert_same_samples(got, turn(sched, target, 6, SEEDED, reuse=False).future.result(TIMEOUT))
    if neighbour is not None:
        assert len(neighbour.future.result(TIMEOUT).generated) == 8


@pytest.mark.parametrize("attention", ["blocked", "kernel"])
@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_a_restore_with_a_smaller_kv_dtype_gives_a_fresh_prefills_bits(tiny_gemma3, kv_dtype: str, attention: str
                                                                       ) -> None:
    """The tier keeps an int8 arena's k, v and scales, a bfloat16 one's k and v, as stored: a next turn restored from
    it (restart at 24, the first prompt's last chunk boundary) gives a fresh prefill's tokens and logprobs, alone and
    beside a request decoding in the other lane, whether the blocked walk or the kernel reads the arena."""
    engine = small_engine(tiny_gemma3, kv_dtype, attention=attention)
    vocab = engine.cfg.vocab_size
    sched = Scheduler(engine, continuous=True, max_queue=16, terminal_ids=frozenset(), prefix_cache_ram=MiB)
    sched.start()
    try:
        first = small_ids(1, 25, vocab)
        reply = turn(sched, first, 4, SEEDED).future.result(TIMEOUT)
        take_the_lanes(sched, engine, 10)
        for beside in (False, True):
            assert_restarts_as_fresh(sched, first + reply.generated + small_ids(2 + beside, 3, vocab), 24, beside)
            take_the_lanes(sched, engine, 20)
        assert sched.metrics.registry.get_sample_value("jaxstation_prefix_cache_memory_entries") >= 1
    finally:
        assert sched.drain(10)


def test_an_entry_under_an_adapter_restores_for_that_adapter_only(tiny_gemma3, tmp_path) -> None:
    """An entry is keyed on the adapter load that computed its KV: a next turn under adapter X restores it and gives
    a fresh prefill's bits under X; the same prompt under adapter Y or the base model restores nothing."""
    engine = small_engine(tiny_gemma3, max_loras=2)
    cfg, vocab = engine.cfg, engine.cfg.vocab_size
    adapters = Adapters(engine, in_use=set)
    x = adapters.load("x", str(write_peft(tmp_path / "x", random_lora(cfg, rank=4, seed=1, b_std=0.3), rank=4,
                                          alpha=8.0)))
    y = adapters.load("y", str(write_peft(tmp_path / "y", random_lora(cfg, rank=4, seed=2, b_std=0.3), rank=4,
                                          alpha=8.0)))
    sched = Scheduler(engine, continuous=True, max_queue=16, terminal_ids=frozenset(), prefix_cache_ram=MiB)
    sched.start()
    try:
        first = small_ids(1, 25, vocab)
        reply = turn(sched, first, 4, SEEDED, adapter=x).future.result(TIMEOUT)
        target = first + reply.generated + small_ids(2, 3, vocab)
        for other in (y, None):  # neither restores X's entry: each prefills from position 0
            take_the_lanes(sched, engine, 10)
            memory = saved(sched, "memory")
            job = turn(sched, target, 2, adapter=other)
            job.future.result(TIMEOUT)
            assert job.cached_tokens == 0 and saved(sched, "memory") == memory
        take_the_lanes(sched, engine, 20)
        memory = saved(sched, "memory")
        hit = turn(sched, target, 6, SEEDED, adapter=x)
        got = hit.future.result(TIMEOUT)
        assert hit.cached_tokens == 24 and saved(sched, "memory") == memory + 24
        fresh = turn(sched, target, 6, SEEDED, reuse=False, adapter=x).future.result(TIMEOUT)
        assert_same_samples(got, fresh)
        base = turn(sched, target, 6, SEEDED, reuse=False).future.result(TIMEOUT)
        assert [s.logprob for s in base.samples] != [s.logprob for s in got.samples]  # X changes the bits
    finally:
        assert sched.drain(10)
