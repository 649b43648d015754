"""Packed admission (`Engine.pack`): prompt pieces of many lanes and the decode rows of running lanes in one step.

A request's samples (token, log-probability and top alternatives, bit for bit) must not depend on which pieces or
decode rows share its steps, how many, where in the pack its piece sits, or how its prompt is cut into pieces: each
check runs every request alone first, then packed beside 1, 3 and 7 others of mixed lengths at every pack position,
with some lanes already decoding, greedy and seeded, on float32 and int8 weights, and through the scheduler with
continuous batching on and off and after a prefix-cache hit.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_model
from fake_engine import FakeEngine, expected

from jaxstation.config.plan import resolve_plan
from jaxstation.config.settings import ConfigError, StationConfig
from jaxstation.engine.engine import Engine, generate
from jaxstation.engine.jobs import Job
from jaxstation.engine.rows import DecodeRow, PromptPiece, Sample, SamplingParams
from jaxstation.engine.rules import pack_slots, pack_widths
from jaxstation.engine.scheduler import Scheduler
from jaxstation.engine.turns import Lane, prompt_pieces
from jaxstation.engine.warmup import DECODE_WAIT
from jaxstation.model.loader import LoadedModel

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
LENGTHS = (20, 5, 40, 70, 3, 17, 33, 9)  # the target first, then its neighbours
NEW = 3


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(1, vocab, n).tolist() for n in LENGTHS]


def _sampling(i: int) -> SamplingParams:
    return SEEDED if i % 2 else GREEDY


def run_packed(engine: Engine, requests: list[tuple[int, list[int], SamplingParams, int]], share: int
               ) -> dict[int, list[Sample]]:
    """Drive packed steps by hand: requests (lane, prompt, sampling, the step it arrives at) in pack order; each step
    every arrived lane past its prompt decodes and the others take pieces of at most `share` tokens, in order, while
    the budget lasts. Returns each lane's first NEW samples."""
    fed = {lane: 0 for lane, *_ in requests}
    out: dict[int, list[Sample]] = {lane: [] for lane, *_ in requests}
    step = 0
    while any(len(s) < NEW for s in out.values()):
        rows: list[DecodeRow | None] = [None] * engine.lanes
        for lane, prompt, sp, at in requests:
            if step >= at and fed[lane] == len(prompt) and len(out[lane]) < NEW:
                n = len(out[lane])
                rows[lane] = DecodeRow(out[lane][-1].token, len(prompt) + n - 1, sp, n)
        budget = engine.prefill_budget - sum(r is not None for r in rows)
        pieces = []
        for lane, prompt, sp, at in requests:
            if step == at:
                engine.begin(lane, prompt, sp, frozenset())
            if step >= at and fed[lane] < len(prompt) and budget > 0:
                n = min(share, budget, len(prompt) - fed[lane])
                pieces.append(PromptPiece(lane, prompt, fed[lane], n, sp))
                fed[lane] += n
                budget -= n
        samples = engine.pack(pieces, rows) if pieces else engine.decode(rows)[0]
        for lane in out:
            if samples[lane] is not None:
                out[lane].append(samples[lane])
        step += 1
    return out


def alone(engine: Engine, prompts: list[list[int]]) -> list[list[Sample]]:
    """Each request by itself on lane 0, its prompt in pieces as wide as the budget."""
    return [run_packed(engine, [(0, p, _sampling(i), 0)], engine.prefill_budget)[0] for i, p in enumerate(prompts)]


def check_packed(engine: Engine, prompts: list[list[int]], reference: list[list[Sample]], n_others: int) -> None:
    """The target (request 0) at every pack position beside n_others neighbours, every lane permuted, half of the
    neighbours arriving two steps early (decoding while the rest are packed); every request equals its run alone."""
    others = list(range(1, n_others + 1))
    for position in range(n_others + 1):
        order = others[:position] + [0] + others[position:]
        lanes = [(position + k) % engine.lanes for k in range(len(order))]
        requests = [(lane, prompts[i], _sampling(i), 0 if i % 2 else 2) for lane, i in zip(lanes, order, strict=True)]
        got = run_packed(engine, requests, share=13)
        for lane, i in zip(lanes, order, strict=True):
            assert got[lane] == reference[i], (n_others, position, i)


@pytest.fixture(scope="module")
def wide_reference(wide_engine: Engine) -> list[list[Sample]]:
    return alone(wide_engine, _prompts(wide_engine.cfg.vocab_size))


@pytest.mark.parametrize("n_others", [1, 3, 7])
def test_float32_request_equals_its_run_alone_at_every_pack_position(wide_engine, wide_reference, n_others) -> None:
    check_packed(wide_engine, _prompts(wide_engine.cfg.vocab_size), wide_reference, n_others)


def test_pieces_of_any_size_write_the_same_bits(wide_engine, wide_reference) -> None:
    """One prompt cut into pieces of 1, 7 and 64 tokens: the same samples."""
    prompts = _prompts(wide_engine.cfg.vocab_size)
    for share in (1, 7, 64):
        got = run_packed(wide_engine, [(3, prompts[3], _sampling(3), 0)], share)
        assert got[3] == wide_reference[3], share


def test_int8_request_equals_its_run_alone_at_every_pack_position(int8_engine: Engine) -> None:
    prompts = _prompts(int8_engine.cfg.vocab_size)[:4]
    reference = alone(int8_engine, prompts)
    for n_others in (1, 3):
        check_packed(int8_engine, prompts, reference, n_others)


def test_pack_widths_and_refusals(default_model: LoadedModel, xla_model: LoadedModel) -> None:
    assert pack_widths(64) == (16, 32, 64)
    assert pack_widths(48) == (12, 24, 48)
    assert pack_widths(96) == (12, 24, 48, 96)
    with pytest.raises(ValueError, match="packed admission needs every matmul on the CPU kernel"):
        Engine(default_model, lanes=4, max_seq=256, chunk=32, block=128, attention="kernel", prefill_budget=2)
    xla = xla_model
    assert Engine(xla, lanes=4, max_seq=256, chunk=32, block=128, prefill_budget=None).prefill_budget == 0
    with pytest.raises(ValueError, match="packed admission needs every matmul on the CPU kernel"):
        Engine(xla, lanes=4, max_seq=256, chunk=32, block=128, prefill_budget=64)
    cfg = default_model.cfg  # the plan applies the engine's rules to the settings, naming them
    assert resolve_plan(StationConfig(lanes=4), cfg).prefill_budget == 128
    assert resolve_plan(StationConfig(lanes=200), cfg).prefill_budget == 200
    assert resolve_plan(StationConfig(lanes=4, prefill_budget="off"), cfg).prefill_budget == 0
    assert resolve_plan(StationConfig(lanes=4, matmul="xla"), cfg).prefill_budget == 0
    with pytest.raises(ConfigError, match=r"MOONSHINE_PREFILL_BUDGET asks for packed steps of 64 rows: packed "
                                          r"admission needs every matmul on the CPU kernel, the blocked or kernel "
                                          r"attention and a budget of at least the lanes \(4\), got 64 rows \(matmul "
                                          r"kernel: False, attention kernel\)"):
        resolve_plan(StationConfig(lanes=4, matmul="xla", prefill_budget="64"), cfg)
    with pytest.raises(ConfigError, match="MOONSHINE_PREFILL_BUDGET='2' must be auto, off or a number of rows of at "
                                          "least MOONSHINE_BATCH_LANES=4"):
        StationConfig(lanes=4, prefill_budget="2")


def test_a_budget_wider_than_the_context_warms_up_and_serves() -> None:
    """A 64-row budget over a 32-token context: warm-up fills the wide steps from several lanes (timing each, from
    the narrowest, until one takes more than DECODE_WAIT widest waves; compiling the rest), and a prompt that fills
    the context gets the tokens it gets in 16-row pieces."""
    model = tiny_model("tiny-llama3", layer_loop="unroll", matmul="kernel")
    wide = Engine(model, lanes=4, max_seq=32, chunk=16, block=16, attention="kernel", prefill_budget=64)
    narrow = Engine(model, lanes=4, max_seq=32, chunk=16, block=16, attention="kernel", prefill_budget=16)
    wide.warmup()
    timed = [w for w in wide.pack_widths if ("pack", w, 4) in wide.step_s]
    assert {("decode", w) for w in wide.wave_widths} | {("pack", w, 4) for w in timed} == set(wide.step_s)
    assert timed == list(wide.pack_widths[:len(timed)]) and timed  # the narrowest up
    limit = DECODE_WAIT * wide.step_s["decode", 4]
    assert all(wide.step_s["pack", w, 4] <= limit for w in timed[:-1])
    assert timed == list(wide.pack_widths) or wide.step_s["pack", timed[-1], 4] > limit
    assert all(t > 0 for t in wide.step_s.values())
    prompt = list(range(3, 30))
    assert generate(wide, prompt, 4, SEEDED, lane=2) == generate(narrow, prompt, 4, SEEDED, lane=2)


def test_a_turn_with_decode_rows_keeps_within_twice_their_wave(default_model: LoadedModel) -> None:
    """`turn_rows`: the widest packed step timed at most DECODE_WAIT x the decode rows' plain wave, never less than
    room for one prompt row; a turn without decode rows has the whole budget."""
    engine = Engine(default_model, lanes=8, max_seq=256, chunk=32, block=128, attention="kernel", prefill_budget=64)
    assert engine.wave_widths == (1, 2, 4, 8) and engine.pack_widths == (16, 32, 64)
    assert [engine.turn_rows(d) for d in (0, 1, 8)] == [64, 64, 64]  # not timed yet: the budget
    engine.step_s = {("decode", 1): 0.010, ("decode", 2): 0.012, ("decode", 4): 0.015, ("decode", 8): 0.025,
                     ("pack", 16, 8): 0.030, ("pack", 32, 8): 0.050, ("pack", 64, 8): 0.090}
    assert engine.turn_rows(0) == 64
    assert [engine.turn_rows(d) for d in (1, 2, 3, 4, 5, 7)] == [16, 16, 16, 16, 32, 32]
    engine.step_s[("pack", 64, 8)] = 0.049
    assert engine.turn_rows(7) == 64
    assert engine.turn_rows(8) == 16  # every lane decodes: no slot for a prompt's end in any step, the narrowest


def test_a_packed_step_samples_few_rows_where_few_need_it() -> None:
    """`pack_slots`: the head and the sampling run over SLOT_FLOOR rows where a step could sample more than twice
    as many; the same request's samples either way (a fixture's shapes: slots do not depend on the model's)."""
    assert pack_slots(16, 8) == (8,) and pack_slots(64, 16) == (16,) and pack_slots(32, 32) == (8, 32)
    assert pack_slots(64, 32) == (8, 32) and pack_slots(16, 32) == (16,)
    model = tiny_model("tiny-llama3", layer_loop="unroll", matmul="kernel")
    engine = Engine(model, lanes=24, max_seq=128, chunk=32, block=128, attention="kernel", prefill_budget=32)
    prompt = list(range(40, 60))
    piece = [PromptPiece(3, prompt, 0, len(prompt), SEEDED)]
    few = engine.pack(piece, [None] * 24, sampled=8)[3]
    assert engine.pack(piece, [None] * 24)[3] == few == engine.pack(piece, [None] * 24, sampled=24)[3]
    with pytest.raises(ValueError, match="cannot run as 4 of a 32-row step"):
        engine.pack(piece, [None] * 24, sampled=4)


def _packs(turn_rows: int | None) -> list[tuple]:
    """The packed steps the scheduler runs over the fake engine for a 2-token prompt that decodes 3 tokens, beside
    two 30-token prompts, with the engine's rows for a turn that carries decode rows."""
    fake = FakeEngine(lanes=4, chunk=4)
    fake.prefill_budget, fake.decode_turn_rows = 16, turn_rows
    sched = Scheduler(fake, continuous=True, max_queue=8, terminal_ids=frozenset())
    jobs = [Job(tokens=p, max_new_tokens=4) for p in ([5, 5], [1] * 30, [2] * 30)]
    for job in jobs:
        sched.submit(job)
    sched.start()
    try:
        assert [job.future.result(5).generated for job in jobs] == [expected(job.tokens, 4) for job in jobs]
    finally:
        sched.drain(5)
    assert fake.errors == []
    return [c for c in fake.calls if c[0] == "pack"][:3]


def test_the_scheduler_gives_a_turn_with_decode_rows_the_engines_turn_rows() -> None:
    # the first turn fills the budget (a chunk each, then the rest to the oldest); the next ones carry lane 0's decode
    # row and take the engine's 8 rows less that row
    assert _packs(8) == [("pack", ((0, 0, 2), (1, 0, 10), (2, 0, 4)), ()),
                         ("pack", ((1, 10, 4), (2, 4, 3)), (0,)),
                         ("pack", ((1, 14, 4), (2, 7, 3)), (0,))]
    assert _packs(None)[1] == ("pack", ((1, 10, 11), (2, 4, 4)), (0,))  # without the engine's bound: 16 rows less one


def test_pack_rejects_what_does_not_fit(wide_engine: Engine) -> None:
    idle: list[DecodeRow | None] = [None] * wide_engine.lanes
    with pytest.raises(ValueError, match="exceed the prefill budget"):
        wide_engine.pack([PromptPiece(0, [1] * 65, 0, 65, GREEDY)], idle)
    with pytest.raises(ValueError, match="does not fit its prompt"):
        wide_engine.pack([PromptPiece(0, [1] * 5, 3, 4, GREEDY)], idle)
    rows = [DecodeRow(1, 5, GREEDY, 1)] + idle[1:]
    with pytest.raises(ValueError, match="also decodes"):
        wide_engine.pack([PromptPiece(0, [1] * 5, 0, 5, GREEDY)], rows)


# ---- through the scheduler, on the shared (packed) station engine ----------------------------------------------

JOBS = [([5, 9, 14], GREEDY), (list(range(40, 47)), SamplingParams(repetition_penalty=1.3, presence_penalty=0.5)),
        (list(range(300, 370)), GREEDY), ([77], SEEDED), (list(range(500, 531)), SamplingParams(temperature=0.7,
                                                                                             top_k=20, seed=5)),
        (list(range(200, 290)), SEEDED)]  # last: its lane is the most recently used when the prefix comes again


@pytest.mark.parametrize("continuous", [True, False])
def test_scheduler_jobs_equal_generate_alone(engine: Engine, continuous: bool) -> None:
    assert engine.prefill_budget > 0
    expected = [generate(engine, p, 6, sp) for p, sp in JOBS]
    sched = Scheduler(engine, continuous=continuous, max_queue=16, terminal_ids=frozenset())
    sched.start()
    try:
        jobs = [Job(tokens=p, max_new_tokens=6, sampling=sp) for p, sp in JOBS]
        for job in jobs:
            sched.submit(job)
        assert [job.future.result(timeout=300).generated for job in jobs] == expected
        # a prefix-cache hit: the 90-token prompt again with a new tail starts on its cached KV
        again = list(range(200, 290)) + [7, 8, 9]
        job = Job(tokens=again, max_new_tokens=6, sampling=SEEDED)
        sched.submit(job)
        result = job.future.result(timeout=300)
        assert result.timing["cached_tokens"] == 64
        sched.submit(cold := Job(tokens=again, max_new_tokens=6, sampling=SEEDED, reuse_prefix=False))
        assert result.generated == cold.future.result(timeout=300).generated == generate(engine, again, 6, SEEDED)
    finally:
        sched.drain(30)


def _planned(budget: int, prompts: list[list[int]]) -> list[tuple[int, int, int]]:
    """`prompt_pieces` for fresh lanes holding `prompts`, oldest first, with a chunk of 4."""
    lanes = [Lane(Job(tokens=p, max_new_tokens=1), admitted_at=0.0) for p in prompts]
    return [(p.prompt[0], p.start, p.length) for p in prompt_pieces(lanes, range(len(lanes)), 4, budget)]


def test_the_budget_goes_a_chunk_each_oldest_first_then_to_the_oldest() -> None:
    long, short, mid = [1] * 30, [2] * 3, [3] * 5
    # a chunk (4) each, oldest first: 4 + 3 + 4; the one token left goes to the oldest
    assert _planned(12, [long, short, mid]) == [(1, 0, 5), (2, 0, 3), (3, 0, 4)]
    # a budget too small for a chunk each: the oldest first
    assert _planned(6, [long, short, mid]) == [(1, 0, 4), (2, 0, 2)]
    assert _planned(64, [short, long, mid]) == [(2, 0, 3), (1, 0, 30), (3, 0, 5)]
