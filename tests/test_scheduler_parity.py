"""The parity gate: continuous batching on the real default model gives every job exactly its serial tokens.

16 jobs go into a 4-lane Scheduler at once (lanes are reused), on the engine a station builds (packed admission
steps, the decode attention kernel; conftest's `engine`). They mix prompt lengths from 1 to over 300 tokens
(real text and random ids), max_new_tokens 1..24, greedy and seeded temperature sampling (some with top_k / top_p),
penalties, logit biases, allowed_token_ids and min_tokens (greedy and sampled), the model's EOS plus an explicit
stop id found by a serial greedy run, and a sentence end. Each job's tokens and
finish_reason must equal its run through a serialize-all (continuous=False) Scheduler on the same engine (flag on ==
flag off), and greedy jobs must also equal `jaxstation.engine.engine.generate`, token for token.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import numpy as np
import pytest

from jaxstation.engine.engine import Engine, generate
from jaxstation.engine.jobs import Job
from jaxstation.engine.rows import SamplingParams
from jaxstation.engine.scheduler import Scheduler

LANES = 4
STORY = ("The old lighthouse keeper climbed the spiral stairs every evening to light the lamp. Ships passed far out at "
         "sea, and their sailors never knew his name, but they trusted the beam that swept across the dark water. "
         "One winter night a storm broke the glass, and he held a lantern in the window until dawn. ")


@dataclasses.dataclass(frozen=True)
class Spec:
    prompt: tuple[int, ...]
    max_new: int
    sampling: SamplingParams
    stop: frozenset[int]
    terminal: bool = False

    def job(self) -> Job:
        return Job(tokens=list(self.prompt), max_new_tokens=self.max_new, sampling=self.sampling,
                   stop_ids=self.stop, stop_at_sentence_end=self.terminal)


class RecordingEngine:
    """Forwards to an Engine, logging which lane each prompt was prefilled in and how many lanes each step decoded.

    A prompt piece that is not the next piece of the lane's previous one starts a prompt (at 0, or on a reused
    prefix)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.admissions: list[tuple[int, tuple[int, ...]]] = []
        self.wave_sizes: list[int] = []
        self._next: dict[int, tuple[tuple[int, ...], int]] = {}  # lane -> (prompt, start of its next chunk)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def pack(self, pieces, rows, sampled=None):
        for p in pieces:
            if self._next.get(p.lane) != (tuple(p.prompt), p.start):
                self.admissions.append((p.lane, tuple(p.prompt)))
            self._next[p.lane] = (tuple(p.prompt), p.start + p.length)
        self.wave_sizes.append(sum(r is not None for r in rows))
        return self.engine.pack(pieces, rows, sampled)

    def decode(self, rows, return_logits=False):
        self.wave_sizes.append(sum(r is not None for r in rows))
        return self.engine.decode(rows, return_logits)


def run_scheduler(engine: Engine, specs: list[Spec], continuous: bool, terminal_ids: frozenset[int]):
    rec = RecordingEngine(engine)
    sched = Scheduler(rec, continuous=continuous, max_queue=64, terminal_ids=terminal_ids)
    futures = [sched.submit(s.job()) for s in specs]  # all 16 queued before the decode thread starts
    sched.start()
    try:
        results = [f.result(timeout=120) for f in futures]
    finally:
        assert sched.drain(10)
    return results, rec


def truncate_at_terminal(tokens: list[int], terminal_ids: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in terminal_ids:
            return tokens[:i + 1]
    return tokens


@pytest.fixture(scope="module")
def gate(engine: Engine):
    model = engine.model
    tok = model.tokenizer
    assert (engine.lanes, engine.prefill_budget > 0) == (LANES, True)
    eos = frozenset(tok.eos_ids)
    rng = np.random.default_rng(1234)
    vocab = model.cfg.vocab_size

    def rand(n: int) -> tuple[int, ...]:
        return tuple(int(i) for i in rng.integers(0, vocab, n))

    def chat(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])))

    story = tok.encode(STORY * 8)
    assert len(story) > 330
    greedy = SamplingParams()
    eos_id = min(eos)
    france = tuple(tok.encode("The capital of France is"))

    # An explicit stop id that a greedy serial run is known to produce: the first new token at index >= 4.
    ask = chat("Name three colours of the rainbow.")
    serial = generate(engine, ask, 24, greedy, eos)
    k = next(i for i in range(4, len(serial)) if serial[i] not in serial[:i])
    stop_id = serial[k]

    specs = [
        Spec(france, 12, greedy, eos, terminal=True),
        Spec(rand(1), 24, SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), eos),
        Spec(chat("What is 2+2? Answer in one sentence."), 24, greedy, eos),
        Spec(tuple(story[:330]), 8, greedy, eos),
        Spec(rand(33), 16, SamplingParams(temperature=0.8, seed=1, repetition_penalty=1.3,
                                          logit_bias=((260, 4.0), (13, -20.0)),
                                          allowed_token_ids=tuple(range(0, 49152, 2))), eos),
        Spec(rand(64), 20, SamplingParams(temperature=1.0, top_k=40, seed=2), eos | {stop_id}),
        Spec(tuple(story[:120]), 12, SamplingParams(temperature=0.7, top_p=0.9, seed=3), eos, terminal=True),
        Spec(rand(305), 6, greedy, eos),
        Spec(tuple(story[:32]), 1, greedy, eos),
        Spec(rand(2), 24, SamplingParams(temperature=1.2, top_k=5, top_p=0.8, seed=4), eos | {stop_id}),
        Spec(ask, 24, greedy, eos | {stop_id}),
        Spec(rand(200), 10, SamplingParams(temperature=0.9, seed=5, logit_bias=((eos_id, 100.0),), min_tokens=5), eos),
        Spec(tuple(story[:257]), 16, greedy, eos, terminal=True),
        Spec(rand(31), 24, SamplingParams(temperature=1.0, top_p=0.95, seed=6), eos, terminal=True),
        Spec(tuple(story[5:22]), 20, SamplingParams(repetition_penalty=1.2, presence_penalty=-0.5,
                                                    logit_bias=((11, 2.5),), min_tokens=3), eos | {stop_id}),
        Spec(rand(150), 3, SamplingParams(temperature=0.6, top_k=3, seed=7), eos),
    ]
    assert len({s.prompt for s in specs}) == len(specs) == 16

    on, rec_on = run_scheduler(engine, specs, True, tok.terminal_ids)
    off, rec_off = run_scheduler(engine, specs, False, tok.terminal_ids)
    reference = {
        i: truncate_at_terminal(generate(engine, s.prompt, s.max_new, s.sampling, s.stop, lane=i % LANES),
                                tok.terminal_ids) if s.terminal else
        generate(engine, s.prompt, s.max_new, s.sampling, s.stop, lane=i % LANES)
        for i, s in enumerate(specs) if s.sampling.temperature == 0
    }
    return {"specs": specs, "on": on, "off": off, "rec_on": rec_on, "rec_off": rec_off, "reference": reference,
            "stop_id": stop_id, "stop_at": k, "terminal_ids": tok.terminal_ids}


def test_flag_on_equals_flag_off_token_for_token(gate):
    for i, (on, off) in enumerate(zip(gate["on"], gate["off"], strict=True)):
        assert on.generated == off.generated, f"job {i}"
        assert on.finish_reason == off.finish_reason, f"job {i}"
        assert [s.token for s in on.samples] == on.generated
        assert on.prompt_tokens == len(gate["specs"][i].prompt)
        np.testing.assert_array_equal([s.logprob for s in on.samples], [s.logprob for s in off.samples])


def test_greedy_jobs_equal_engine_generate(gate):
    assert len(gate["reference"]) >= 8
    assert sum(gate["specs"][i].sampling.controls for i in gate["reference"]) == 2  # greedy jobs with penalties
    for i, ref in gate["reference"].items():
        assert gate["on"][i].generated == ref, f"job {i}"


def test_finish_reasons_follow_the_stop_rules(gate):
    terminal_ids = gate["terminal_ids"]
    for i, (s, r) in enumerate(zip(gate["specs"], gate["on"], strict=True)):
        assert 1 <= len(r.generated) + (r.finish_reason == "stop") <= s.max_new, f"job {i}"
        assert not set(r.generated) & s.stop, f"job {i}: a stop id was included"
        if r.finish_reason == "length":
            assert len(r.generated) == s.max_new
        if r.finish_reason == "sentence_end":
            assert s.terminal and r.generated[-1] in terminal_ids
        if s.terminal:
            assert not set(r.generated[:-1]) & terminal_ids
    # the explicit stop id cut the job it was found in at the same place as the plain serial run
    ask = gate["on"][10]
    assert (ask.finish_reason, len(ask.generated)) == ("stop", gate["stop_at"])
    min_tokens = gate["on"][11]  # EOS biased to win: held back for exactly min_tokens tokens
    assert (min_tokens.finish_reason, len(min_tokens.generated)) == ("stop", 5)
    allowed = gate["on"][4].generated  # allowed_token_ids: the even ids only
    assert allowed and all(t % 2 == 0 for t in allowed)
    reasons = Counter(r.finish_reason for r in gate["on"])
    assert reasons["stop"] >= 1 and reasons["length"] >= 1 and reasons["sentence_end"] >= 1, reasons


def test_job_mix_and_lane_reuse(gate):
    lengths = [len(s.prompt) for s in gate["specs"]]
    assert min(lengths) == 1 and max(lengths) > 300
    assert {s.max_new for s in gate["specs"]} >= {1, 24}
    rec_on, rec_off = gate["rec_on"], gate["rec_off"]
    # every job was admitted once; every lane served at least two jobs
    assert sorted(p for _, p in rec_on.admissions) == sorted(s.prompt for s in gate["specs"])
    per_lane = Counter(lane for lane, _ in rec_on.admissions)
    assert set(per_lane) == set(range(LANES)) and min(per_lane.values()) >= 2, per_lane
    # continuous waves were shared by all four lanes; serialize-all never decoded two lanes at once
    assert max(rec_on.wave_sizes) == LANES
    assert max(rec_off.wave_sizes) == 1
    assert len(rec_on.wave_sizes) < len(rec_off.wave_sizes)


def test_an_idle_release_changes_no_bits(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs before and after the decode thread's idle release (malloc_trim and the execution threads' arenas, with
    the trim threshold lowered meanwhile) give the same tokens, greedy and seeded."""
    from jaxstation.engine import host_memory

    released: list[int] = []
    real = host_memory.release_freed_memory

    def release(execution_threads: bool = False) -> int:
        assert execution_threads  # the engine runs on the CPU backend
        released.append(real(execution_threads=execution_threads))
        return released[-1]

    monkeypatch.setattr(host_memory, "IDLE_RELEASE_S", 0.05)
    monkeypatch.setattr(host_memory, "release_freed_memory", release)
    specs = [Spec(tuple(range(5, 5 + n)), 12, SamplingParams(temperature=0.9, top_p=0.9, seed=n) if n % 2 else
                  SamplingParams(), frozenset()) for n in (3, 40, 7, 90)]
    sched = Scheduler(engine, continuous=True, max_queue=64, terminal_ids=frozenset())
    sched.start()
    try:
        runs = []
        for _ in range(2):
            before = len(released)
            runs.append([sched.submit(spec.job()).result(timeout=120).generated for spec in specs])
            deadline = time.monotonic() + 30
            while len(released) == before and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(released) > before  # the idle decode thread handed its steps' memory back
    finally:
        assert sched.drain(10)
    assert runs[0] == runs[1]
