"""Windowed layers that keep only their window (engine/arena.py): a ring engine gives every request the full arena's
tokens and logprobs, bit for bit, at prompts and contexts past the ring, alone and beside others, through chunked and
packed prefill, decode waves and verify steps; and prefix reuse on a ring stays exact, reusing a lane only while its
rings still hold the window before the restart (engine/prefix_cache.py's RingHold).

Gemma 2 (soft-capped scores: the blocked walk) and Gemma 3 (the decode attention kernel), window 8, on four lanes of 64
positions with 16-row packed steps: a ring of 32 slots (8 + 16 - 1, rounded up to the 16-position block).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, prefill_all, run_wave, station_plan

from jaxstation.config.memory import check_memory
from jaxstation.config.plan import auto_max_seq
from jaxstation.config.settings import ConfigError, GiB, MiB, StationConfig
from jaxstation.engine.arena import arena_bytes, arena_layout
from jaxstation.engine.engine import Engine, generate
from jaxstation.engine.jobs import Job, Result
from jaxstation.engine.prefix_cache import PrefixCache, RingHold
from jaxstation.engine.rows import DecodeRow, PromptPiece, SamplingParams
from jaxstation.engine.scheduler import Scheduler
from jaxstation.model.loader import checkpoint_weight_bytes, load_model
from jaxstation.model.shapes import ARCHITECTURES

SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11)


def _engine(name: str, kv_windows: str) -> Engine:
    model = load_model(str(FIXTURES / name), "float32", "unroll", "kernel")
    attention = "blocked" if model.cfg.attn_softcap else "kernel"
    return Engine(model, lanes=4, max_seq=64, chunk=8, block=16, attention=attention, prefill_budget=16,
                  speculative=True, kv_windows=kv_windows)


@pytest.fixture(scope="module", params=["tiny-gemma2", "tiny-gemma3"])
def engines(request) -> tuple[Engine, Engine]:
    """(a ring engine, a full-arena engine) of one model."""
    return _engine(request.param, "ring"), _engine(request.param, "full")


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def _same(a: dict[int, tuple[list[int], list[np.ndarray]]], b: dict[int, tuple[list[int], list[np.ndarray]]]) -> None:
    assert a.keys() == b.keys()
    for lane in a:
        assert a[lane][0] == b[lane][0], lane
        for x, y in zip(a[lane][1], b[lane][1], strict=True):
            np.testing.assert_array_equal(x, y)


def test_the_ring_is_smaller_and_windowed_layers_keep_it(engines: tuple[Engine, Engine]) -> None:
    ring, full = engines
    assert (ring.ring, full.ring) == (32, 0)
    assert ring.arena.rings.k.shape == (sum(ring.windowed), 4, 33, ring.cfg.num_kv_heads, ring.cfg.head_dim)
    assert ring.arena.k.shape[0] == ring.cfg.num_layers - sum(ring.windowed) > 0
    assert full.arena.rings is None and full.arena.k.shape[0] == full.cfg.num_layers
    ringed = arena_bytes(ring.cfg, 4, 64, ring.arena.k.dtype, ring.ring, ring.windowed)
    assert ring.arena.nbytes == ringed < arena_bytes(full.cfg, 4, 64, full.arena.k.dtype) == full.arena.nbytes


def test_waves_alone_and_beside_others_match_the_full_arena(engines: tuple[Engine, Engine]) -> None:
    """A 40-token seeded prompt (past the 32-slot ring) then 20 decode waves, alone and beside three neighbours of
    other lengths, on the ring and on the full arena: the same tokens and logits."""
    ring, full = engines
    vocab = ring.cfg.vocab_size
    target = {2: (_prompt(1, 40, vocab), SEEDED)}
    others = {lane: (_prompt(lane + 5, n, vocab), SamplingParams()) for lane, n in ((0, 35), (1, 9), (3, 23))}
    for lanes in (target, {**target, **others}):
        _same(run_wave(ring, lanes, steps=20), run_wave(full, lanes, steps=20))


def test_packed_prefill_and_verify_match_the_full_arena(engines: tuple[Engine, Engine]) -> None:
    """Prompts entering in packed steps beside each other, then verify steps whose drafts cross the ring's wrap."""
    ring, full = engines
    vocab = ring.cfg.vocab_size
    prompts = {0: _prompt(2, 45, vocab), 3: _prompt(3, 30, vocab)}

    def run(engine: Engine) -> list[tuple[int, float]]:
        out = []
        for lane, p in prompts.items():
            engine.begin(lane, p, SEEDED, frozenset())
        fed = dict.fromkeys(prompts, 0)
        while any(fed[lane] < len(p) for lane, p in prompts.items()):
            pieces = [PromptPiece(lane, p, fed[lane], min(8, len(p) - fed[lane]), SEEDED)
                      for lane, p in prompts.items() if fed[lane] < len(p)]
            out += [(s.token, s.logprob) for s in engine.pack(pieces, [None] * 4) if s]
            for piece in pieces:
                fed[piece.lane] += piece.length
        for step in range(3):
            rows: list[DecodeRow | None] = [None] * 4
            for lane, p in prompts.items():
                rows[lane] = DecodeRow(7, len(p) + 2 * step, SEEDED, 2 * step, drafts=(9,))
            out += [(s.token, s.logprob) for lane_samples in engine.verify(rows) if lane_samples
                    for s in lane_samples]
        return out

    assert run(ring) == run(full)


def test_generate_over_a_long_context_matches_the_full_arena(engines: tuple[Engine, Engine]) -> None:
    ring, full = engines
    prompt = _prompt(4, 50, ring.cfg.vocab_size)
    assert generate(ring, prompt, 13, SEEDED, lane=1) == generate(full, prompt, 13, SEEDED, lane=1)


def test_ring_hold_floors() -> None:
    hold = RingHold(lanes=2, ring=32, window=8)
    assert hold.floor(0) == 0
    hold.wrote(0, 0, 23)  # a prompt's chunks: nothing overwritten yet
    hold.wrote(0, 24, 31)
    assert hold.floor(0) == 0
    hold.wrote(0, 32, 39)  # position 39 took position 7's slot: a restart needs its window from 8 on
    assert hold.floor(0) == 8 + 8 - 1
    hold.wrote(0, 30, 30)  # a new request restarting at 30 keeps what lies before it
    assert hold.floor(0) == 15
    hold.wrote(0, 50, 55)  # a gap: nothing before 50 is known to continue into it
    assert hold.floor(0) == 50 + 7
    assert hold.floor(1) == 0 and RingHold(2, 0, 8).floor(0) == 0


def test_prefix_reuse_on_a_ring_is_exact_while_the_ring_holds_the_window(engines: tuple[Engine, Engine]) -> None:
    """Lane 1 holds a 24-token prompt and 3 generated tokens: a follow-up restarting at 24 reuses it and gets the
    full arena's fresh bits. After 30 generated tokens (positions up to 53 in 32 slots), the window before 24 has been
    overwritten, and the cache reuses nothing."""
    ring, full = engines
    vocab = ring.cfg.vocab_size
    cached, follow = _prompt(6, 24, vocab), _prompt(7, 9, vocab)
    cache = PrefixCache(ring.lanes, ring.chunk)

    def hold(generated: int) -> int:
        run_wave(ring, {1: (cached, SEEDED)}, steps=generated)
        cache.store(1, cached, ring.lane_versions[1], ring.reuse_floor(1))
        return cache.pick(cached + follow, [1], ring.lane_versions).reused

    assert hold(generated=30) == 0
    assert hold(generated=3) == 24
    prompt = cached + follow
    ring.begin(1, prompt, SEEDED, frozenset())
    reused = [ring.prefill(1, prompt, start, SEEDED, return_logits=True) for start in (24, 32)][-1]
    fresh = prefill_all(full, 2, prompt, SEEDED, return_logits=True)
    assert reused[0] == fresh[0]
    np.testing.assert_array_equal(np.asarray(reused[1]), np.asarray(fresh[1]))


def test_a_window_copy_restores_the_rings_bits_where_a_restart_at_its_boundary_reads_them(
        engines: tuple[Engine, Engine]) -> None:
    """Lane 0 prefills 25 tokens; its global layers' positions [0, 24) and the window before 24 (positions 17..23,
    slots 17..23 of the 32-slot ring) are copied to the host. Restored into lane 3, which held a longer prompt: lane 3
    holds lane 0's bits there, may restart at 24 and no lower, and the prefill from 24 gives a fresh prefill's bits
    on the full arena."""
    ring, full = engines
    vocab = ring.cfg.vocab_size
    prompt = _prompt(60, 25, vocab)
    prefill_all(ring, 0, prompt, SEEDED)
    slots = np.arange(17, 24) % ring.ring
    then = [np.asarray(a[:, 0]) for a in (ring.arena.rings.k, ring.arena.rings.v, ring.arena.k, ring.arena.v)]
    kv, window = ring.save_prefix(0, 24), ring.save_window(0, 24)
    assert window.k.shape == (sum(ring.windowed), 7, ring.cfg.num_kv_heads, ring.cfg.head_dim)
    run_wave(ring, {3: (_prompt(61, 40, vocab), SEEDED)}, steps=5)
    with pytest.raises(ValueError, match="restarts only from a copy of its window"):
        ring.restore_prefix(3, kv, 24)
    ring.restore_prefix(3, kv, 24, window)
    now = [np.asarray(a[:, 3]) for a in (ring.arena.rings.k, ring.arena.rings.v, ring.arena.k, ring.arena.v)]
    for a, b in zip(now[:2], then[:2], strict=True):
        np.testing.assert_array_equal(a[:, slots], b[:, slots])
    for a, b in zip(now[2:], then[2:], strict=True):
        np.testing.assert_array_equal(a[:, :24], b[:, :24])
    assert ring.reuse_floor(3) == 24
    target = prompt + _prompt(62, 10, vocab)
    ring.begin(3, target, SEEDED, frozenset())
    reused = [ring.prefill(3, target, start, SEEDED, return_logits=True) for start in (24, 32)][-1]
    fresh = prefill_all(full, 2, target, SEEDED, return_logits=True)
    assert reused[0] == fresh[0]
    np.testing.assert_array_equal(np.asarray(reused[1]), np.asarray(fresh[1]))


def _turn(sched: Scheduler, prompt: list[int], n: int, sampling: SamplingParams, reuse: bool = True) -> Job:
    job = Job(tokens=prompt, max_new_tokens=n, sampling=sampling, reuse_prefix=reuse)
    sched.submit(job)
    return job


def _same_result(got: Result, ref: Result) -> None:
    assert (got.generated, got.finish_reason) == (ref.generated, ref.finish_reason)
    assert [(s.logprob, s.top) for s in got.samples] == [(s.logprob, s.top) for s in ref.samples]


def test_a_next_turn_past_the_ring_hold_restarts_from_the_host_tier(engines: tuple[Engine, Engine],
                                                                    request: pytest.FixtureRequest) -> None:
    """A 25-token first turn and a 30-token reply (decode overwrites the window before 24 in the 32-slot ring), then
    four other prompts take every lane: the next turn (first + reply + 3 tokens) restores the tier's entry (the global
    layers' 24 positions and the window before 24, saved as the first prompt's prefill ended) and restarts at 24, and
    another next turn at 48, an inner restart point of the first next turn's prompt. Their tokens and logprobs,
    greedy alone and seeded beside a neighbour decoding in another lane, equal a fresh prefill's
    on a fresh engine (a ring engine of the same settings, its tier off)."""
    ring, _ = engines
    vocab = ring.cfg.vocab_size
    sched = Scheduler(ring, continuous=True, max_queue=16, terminal_ids=frozenset(), prefix_cache_ram=MiB)
    fresh = Scheduler(_engine(request.node.callspec.params["engines"], "ring"), continuous=True, max_queue=16,
                      terminal_ids=frozenset())
    sched.start()
    fresh.start()
    try:
        first = _prompt(20, 25, vocab)
        reply = _turn(sched, first, 30, SamplingParams()).future.result(60)
        assert len(reply.generated) == 30
        for i in range(ring.lanes):
            _turn(sched, _prompt(30 + i, 12, vocab), 1, SamplingParams()).future.result(60)
        memory = sched.metrics.registry.get_sample_value
        for turn, (sampling, beside) in enumerate(((SamplingParams(), False), (SEEDED, True))):
            # the second target is another next turn: the tier's entry of the first target (its restart points 24,
            # taken over from the first turn's entry, 32 and 48 inside its prompt, and 56) restarts it at 48, the
            # furthest at or below its match (55)
            target = first + reply.generated + _prompt(21 + turn, 3, vocab)
            before = memory("jaxstation_prefix_cache_tier_saved_tokens_total", {"tier": "memory"}) or 0
            neighbour = _turn(sched, _prompt(40, 20, vocab), 30, SamplingParams()) if beside else None
            hit = _turn(sched, target, 4, sampling)
            got = hit.future.result(60)
            ref = _turn(fresh, target, 4, sampling, reuse=False).future.result(60)
            restart = (24, 48)[turn]
            assert hit.cached_tokens == restart
            assert memory("jaxstation_prefix_cache_tier_saved_tokens_total", {"tier": "memory"}) == before + restart
            _same_result(got, ref)
            if neighbour is not None:
                assert len(neighbour.future.result(60).generated) == 30
            for i in range(ring.lanes):  # the target's lane goes to others: the next restore is from the tier again
                _turn(sched, _prompt(50 + i, 12, vocab), 1, SamplingParams()).future.result(60)
    finally:
        assert sched.drain(10) and fresh.drain(10)


GEMMA3_270M = dataclasses.replace(ARCHITECTURES["gemma-3-4b"], vocab_size=262144, hidden_size=640,
                                  intermediate_size=2048, num_layers=18, num_heads=4, num_kv_heads=1,
                                  sliding_window=512, max_position=32768,
                                  local_layers=tuple(i % 6 != 5 for i in range(18)))


def test_the_memory_check_counts_the_rings() -> None:
    """Gemma 3 270M's shape at 8 lanes of 32,768 positions in float32: 9.66 GB in full, and with rings of 640
    positions (512 + 128 - 1 rounded up to the block) on its 15 windowed layers, 1.64 GB: the check passes in 2 GiB
    with rings and names the setting to lower without them."""
    layout = arena_layout(GEMMA3_270M, 32768, 128, "ring", "unroll", chunk=32, budget=128, verify_rows=0)
    assert layout == (640, GEMMA3_270M.local_layers)
    full = arena_bytes(GEMMA3_270M, 8, 32768, jnp.float32)
    ringed = arena_bytes(GEMMA3_270M, 8, 32768, jnp.float32, *layout)
    assert (full, ringed) == (9_663_676_416, 1_610_612_736 + 2 * 15 * 8 * 641 * 256 * 4)
    config = StationConfig(lanes=8, max_seq=32768)
    check_memory(GEMMA3_270M, config, "float32", weights_resident=True, available=2 * GiB, layout=layout)
    with pytest.raises(ConfigError, match="MOONSHINE_MAX_SEQ"):
        check_memory(GEMMA3_270M, config, "float32", weights_resident=True, available=2 * GiB)
    assert arena_layout(GEMMA3_270M, 32768, 128, "full", "unroll", chunk=32, budget=128, verify_rows=0) == (0, ())
    assert arena_layout(GEMMA3_270M, 512, 128, "ring", "unroll", chunk=32, budget=128, verify_rows=0) == (0, ())
    with pytest.raises(ConfigError, match="MOONSHINE_KV_WINDOWS"):
        StationConfig(kv_windows="swa")


def test_the_real_gemma3_on_a_ring_gives_the_full_arenas_bits(gemma3_270m: Path) -> None:
    """Gemma 3 270M (window 512) on its station plan with 128-row packed steps: a ring of 640 positions. A seeded
    700-token prompt and 24 decode waves, alone and beside a 560-token greedy one: the full arena's tokens and
    logits, bit for bit; and a next turn restored from a tier's copy of that prompt gives them too."""
    plan = station_plan(StationConfig(model=str(gemma3_270m), lanes=2, max_seq=1024))
    model = load_model(gemma3_270m, plan.dtype, plan.layer_loop, plan.matmul)

    def engine(kv_windows: str) -> Engine:
        return Engine(model, lanes=2, max_seq=1024, chunk=32, block=128, attention=plan.attention,
                      prefill_budget=128, kv_windows=kv_windows)

    ring, full = engine("ring"), engine("full")
    assert (ring.ring, sum(ring.windowed)) == (640, 15)
    vocab = model.cfg.vocab_size
    target = {1: (_prompt(8, 700, vocab), SEEDED)}
    for lanes in (target, {**target, 0: (_prompt(9, 560, vocab), SamplingParams())}):
        _same(run_wave(ring, lanes, steps=24), run_wave(full, lanes, steps=24))
    # a host tier's entry of lane 1's prompt (global layers and the window before its last boundary, 672, copied as
    # the tier copies them), restored into lane 0 after 110 decode waves moved lane 1's rings past that window: the
    # next turn restarts at 672 and gives the full arena's fresh prefill bits, beside a new prompt in lane 1
    prompt = target[1][0]
    prefill_all(ring, 1, prompt, SEEDED)
    kv, window = ring.save_prefix(1, 672), ring.save_window(1, 672)
    run_wave(ring, target, steps=110)
    assert ring.reuse_floor(1) > 672  # the rings no longer hold the window a restart at 672 reads
    ring.restore_prefix(0, kv, 672, window)
    turn = {0: (prompt + _prompt(10, 40, vocab), SEEDED), 1: (_prompt(11, 90, vocab), SamplingParams())}
    _same(run_wave(ring, turn, steps=8, restarts={0: 672}), run_wave(full, turn, steps=8))


def test_max_seq_defaults_to_the_models_context_as_far_as_memory_allows(caplog, gemma3_270m) -> None:
    """Gemma 3 270M at 8 lanes: its whole 32,768-position context where memory is plentiful; where it is not, the
    longest multiple of the block whose arena, rings counted, and the file's weights take 3/4 of the free memory."""
    caplog.set_level("INFO", logger="jaxstation.config.plan")
    config = StationConfig(lanes=8, model=str(gemma3_270m))
    assert auto_max_seq(config, GEMMA3_270M, available=64 * GiB).max_seq == 32768
    assert "max_seq 32768: the model's context length" in caplog.text
    tight = auto_max_seq(config, GEMMA3_270M, available=GiB)
    layout = arena_layout(GEMMA3_270M, tight.max_seq, 128, "ring", "unroll", chunk=32, budget=128, verify_rows=0)
    room = int(GiB * 0.75) - checkpoint_weight_bytes(gemma3_270m, "gguf")
    assert 2048 < tight.max_seq < 32768 and tight.max_seq % 128 == 0
    assert arena_bytes(GEMMA3_270M, 8, tight.max_seq, jnp.bfloat16, *layout) <= room
    assert arena_bytes(GEMMA3_270M, 8, tight.max_seq + 128, jnp.bfloat16, *layout) > room
    assert f"max_seq {tight.max_seq}: the longest whose arena fits 75% of the free memory" in caplog.text
    check_memory(GEMMA3_270M, tight, "gguf", available=2 * GiB, layout=layout, kv_dtype="bfloat16")


def _small_engine(name: str, kv_dtype: str, attention: str) -> Engine:
    model = load_model(str(FIXTURES / name), "float32", "unroll", "kernel")
    return Engine(model, lanes=4, max_seq=64, chunk=8, block=16, attention=attention, prefill_budget=16,
                  kv_dtype=kv_dtype)


@pytest.mark.parametrize("attention", ["kernel", "blocked"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_a_smaller_arena_keeps_batch_invariance_and_exact_prefix_reuse(kv_dtype: str, attention: str) -> None:
    """A bfloat16 arena (on a ring) holds half the bytes, an int8 one about a quarter (a float32 scale per position
    and head); a seeded request's tokens and logits alone equal them beside three others, and a prefix reused from
    another request's lane gives a fresh run's bits, whether the kernel reads the arena in place or the blocked walk
    reads it. The values differ from the float32 arena's (k and v are rounded)."""
    engine = _small_engine("tiny-gemma3", kv_dtype, attention)
    assert engine.arena.rings.k.dtype == jnp.dtype(kv_dtype) and engine.ring == 32
    assert engine.arena.nbytes == arena_bytes(engine.cfg, 4, 64, jnp.dtype(kv_dtype), 32, engine.windowed)
    vocab = engine.cfg.vocab_size
    target = {2: (_prompt(1, 40, vocab), SEEDED)}
    others = {lane: (_prompt(lane + 5, n, vocab), SamplingParams()) for lane, n in ((0, 35), (1, 9), (3, 23))}
    alone = run_wave(engine, target, steps=12)
    _same(alone, {2: run_wave(engine, {**target, **others}, steps=12)[2]})
    prompt = target[2][0]
    run_wave(engine, {1: (prompt[:24], SEEDED)}, steps=2)  # lane 1 caches the first 24 tokens
    assert engine.reuse_floor(1) == 0
    engine.begin(1, prompt, SEEDED, frozenset())
    reused = [engine.prefill(1, prompt, start, SEEDED, return_logits=True) for start in (24, 32)][-1]
    assert reused[0].token == alone[2][0][0]
    np.testing.assert_array_equal(np.asarray(reused[1])[0], alone[2][1][0])
    float32 = run_wave(_small_engine("tiny-gemma3", "auto", attention), target, steps=12)
    assert not np.array_equal(float32[2][1][0], alone[2][1][0])
