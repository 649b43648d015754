"""Restart points inside a prompt (engine/prefix_windows.py, `WindowCopies.prefill_passed`): with rings, a long
prompt's prefill copies the window before every multiple of `restart_spacing` tokens it passes, so a prompt that
shares a long prefix with it and diverges inside it restarts just below the divergence. On the fake engine, which
points are copied and kept across a lane's next turn, and their bound; on tiny Gemma 3, a restart from memory with a
fresh prefill's bits, alone and beside another request, in packed and chunked prefill, also from a free lane's
copies, and the tier's bytes holding the windows."""

from __future__ import annotations

import pytest
from conftest import FIXTURES
from fake_engine import expected
from test_prefix_tier import (
    SEEDED,
    TIMEOUT,
    RingedFake,
    assert_restarts_as_fresh,
    assert_same_samples,
    next_turn,
    run,
    saved,
    small_ids,
    take_the_lanes,
    turn,
)

from jaxstation.config.settings import MiB
from jaxstation.engine.engine import Engine
from jaxstation.engine.prefix_windows import restart_spacing
from jaxstation.engine.scheduler import Scheduler
from jaxstation.model.loader import load_model


def test_the_spacing_is_two_windows_rounded_up_to_the_chunk() -> None:
    assert restart_spacing(512, 32) == 1024  # Gemma 3 270M at the default chunk
    assert restart_spacing(8, 8) == 16  # tiny Gemma 3 below
    assert restart_spacing(4, 4) == 8  # the ringed fake engine
    assert restart_spacing(10, 8) == 24


def test_a_long_prompt_keeps_a_restart_point_every_spacing_and_a_next_turn_on_its_lane_keeps_them() -> None:
    """The fake engine with rings (4-token chunks, a window of 4: a restart point every 8 tokens): a 33-token prompt
    copies the windows before 8, 16, 24 and 32 (its end) as its prefill passes them; its next turn reuses the lane at
    32 and copies only its own end, 36; once other prompts take the lanes, the tier's entry holds all five, and a
    prompt diverging at 21 restarts at 16."""
    fake = RingedFake(lanes=2, chunk=4)
    sched = Scheduler(fake, continuous=True, max_queue=64, terminal_ids=frozenset(), prefix_cache_ram=MiB)
    sched.start()
    try:
        first = list(range(100, 133))
        run(sched, first, 3)
        lane = next(c[1] for c in fake.calls if c[0] == "window")
        second = next_turn(first)
        assert run(sched, second, 3).timing["cached_tokens"] == 32
        assert [c for c in fake.calls if c[0] == "window"] == [("window", lane, n) for n in (8, 16, 24, 32, 36)]
        run(sched, [5] * 9, 3)
        run(sched, [6] * 9, 3)
        assert sched.prefix_tier.host.get(tuple(second[:36]), 0).restarts == (8, 16, 24, 32, 36)
        target = first[:21] + [1] * 8
        r = run(sched, target, 2)
        assert (r.generated, r.timing["cached_tokens"]) == (expected(target, 2), 16)
        assert not fake.errors and saved(sched, "memory") == 16
    finally:
        assert sched.drain(10)


def test_inner_copies_waiting_beside_the_lanes_stop_at_the_tiers_capacity() -> None:
    """A tier of 90 bytes on the ringed fake engine (a window copy is 48 bytes): a 33-token prompt copies the windows
    before 8 and 16, skips 24 since the 96 bytes waiting reach the capacity, and still copies its end, 32."""
    fake = RingedFake(lanes=2, chunk=4)
    sched = Scheduler(fake, continuous=True, max_queue=64, terminal_ids=frozenset(), prefix_cache_ram=90)
    sched.start()
    try:
        run(sched, list(range(100, 133)), 3)
        assert [c[2] for c in fake.calls if c[0] == "window"] == [8, 16, 32]
    finally:
        assert sched.drain(10)


@pytest.fixture(scope="module")
def tiny_gemma3():
    return load_model(str(FIXTURES / "tiny-gemma3"), "float32", "unroll", "kernel")


def ring_station(model, budget: int) -> tuple[Engine, Scheduler]:
    """Tiny Gemma 3 on 2 lanes of 64 positions with rings, 8-token chunks, packed steps of `budget` rows (0: off), and
    a started scheduler with a 1 MiB tier."""
    engine = Engine(model, lanes=2, max_seq=64, chunk=8, block=16, attention="blocked", prefill_budget=budget,
                    wave_widths=(2,))
    sched = Scheduler(engine, continuous=True, max_queue=16, terminal_ids=frozenset(), prefix_cache_ram=MiB)
    sched.start()
    return engine, sched


@pytest.mark.parametrize("budget", [16, 0], ids=["packed", "chunked"])
def test_a_session_diverging_inside_a_long_prompt_restarts_below_the_divergence(tiny_gemma3, budget: int) -> None:
    """Tiny Gemma 3 (1 global layer, 2 windowed with a window of 8, 2 KV heads of 32, float32 KV; 8-token chunks):
    restart points every 16 tokens. A first session's 50-token prompt leaves, once other prompts take the lanes, one
    entry: 48 positions of the global layer and the windows before 16, 32 and 48, all counted in the tier's bytes. A
    second session sharing its first 37 tokens restarts at 32 from memory, a third sharing 40 at 32 beside a
    neighbour decoding in the other lane, and their tokens and logprobs equal a fresh prefill's."""
    engine, sched = ring_station(tiny_gemma3, budget)
    vocab = engine.cfg.vocab_size
    try:
        first = small_ids(1, 50, vocab)
        turn(sched, first, 2, SEEDED).future.result(TIMEOUT)
        take_the_lanes(sched, engine, 10)
        entry = sched.prefix_tier.host.get(tuple(first[:48]), 0)
        assert entry.restarts == (16, 32, 48)
        global_part, window = 48 * 1 * 2 * 32 * 4 * 2, 7 * 2 * 2 * 32 * 4 * 2  # positions x layers x heads x dim x
        assert entry.nbytes == sched.prefix_tier.host.nbytes == global_part + 3 * window == 46_080  # 4 B x (k, v)
        assert sched.metrics.registry.get_sample_value("jaxstation_prefix_cache_memory_bytes") == 46_080
        for shared, beside in ((37, False), (40, True)):
            assert_restarts_as_fresh(sched, first[:shared] + small_ids(100 + shared, 50 - shared, vocab), 32, beside)
            take_the_lanes(sched, engine, 20 + shared)
    finally:
        assert sched.drain(10)


def test_a_session_beside_the_first_ones_free_lane_restarts_from_its_copies(tiny_gemma3) -> None:
    """The first session's 50-token prompt and a 12-token reply leave its lane free, its 32-slot rings holding
    positions 30 to 61 only: a second session sharing 37 tokens cannot restart at 32 from the lane, so the lane's
    prefix goes to the tier with its window copies (16, 32, 48) and the second session restarts at 32 from there,
    with a fresh prefill's tokens and logprobs."""
    engine, sched = ring_station(tiny_gemma3, 16)
    vocab = engine.cfg.vocab_size
    try:
        first = small_ids(1, 50, vocab)
        turn(sched, first, 12, SEEDED).future.result(TIMEOUT)
        assert len(sched.prefix_tier.host) == 0
        target = first[:37] + small_ids(137, 13, vocab)
        hit = turn(sched, target, 6, SEEDED)
        got = hit.future.result(TIMEOUT)
        assert hit.cached_tokens == 32 and saved(sched, "memory") == 32
        assert sched.prefix_tier.host.get(tuple(first[:48]), 0).restarts == (16, 32, 48)
        assert_same_samples(got, turn(sched, target, 6, SEEDED, reuse=False).future.result(TIMEOUT))
    finally:
        assert sched.drain(10)
