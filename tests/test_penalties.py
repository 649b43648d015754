"""Penalties, logit_bias, allowed_token_ids and min_tokens on the default model, on the shared engine (4 lanes,
chunk 32, block 128).

Reference: every token of a run (the first one, sampled at the end of prefill, then each decode wave's) is the
argmax of a numpy reference computed from the model logits the engine returned for that step and the run's history
(its prompt, its tokens so far), and its logprob is the model's, before any control. Invariance: a request with
controls gets bit-identical tokens alone in any lane, beside neighbours with and without controls (and a plain row
beside controlled ones keeps its tokens),
and after a prefix-cache hit through the scheduler (tests/test_scheduler_parity.py runs jobs with controls among
15 others, with continuous batching on and off).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import prefill_all, run_wave
from sampling_reference import reference_draw

from jaxstation.engine.engine import Engine
from jaxstation.engine.jobs import Job
from jaxstation.engine.rows import DecodeRow, SamplingParams
from jaxstation.engine.scheduler import Scheduler
from jaxstation.mesh.host_engine import MeshEngine
from jaxstation.server.errors import StationError
from jaxstation.server.protocol import parse_generate

TARGET = [17872, 42, 1812, 314, 216, 34, 1232, 216, 34, 47, 198, 21350, 42]  # "Question: What is 2 + 2?\nAnswer:"
STEPS = 8
EOS = 2  # SmolLM2's
VOCAB = 49152
TIMEOUT = 120


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def reference_logits(logits: np.ndarray, prompt: list[int], generated: list[int], sp: SamplingParams,
                     held: frozenset[int]) -> np.ndarray:
    """What the token is chosen from, in numpy float32: allowed tokens, bias, min_tokens, repetition, frequency and
    presence."""
    x = logits.astype(np.float32).copy()
    if sp.allowed_token_ids:
        masked = np.ones(len(x), bool)
        masked[list(sp.allowed_token_ids)] = False
        x[masked] = -np.inf
    for token, bias in sp.logit_bias:
        x[token] += np.float32(bias)
    if len(generated) < sp.min_tokens:
        x[sorted(held)] = -np.inf
    counts = np.bincount(np.asarray(generated, np.int64), minlength=len(x)).astype(np.int32)
    seen = counts > 0
    seen[prompt] = True
    rep = np.where(seen, np.float32(sp.repetition_penalty), np.float32(1.0))
    x = np.where(x > 0, x / rep, x * rep)
    return x - (np.float32(sp.frequency_penalty) * counts.astype(np.float32)
                + np.float32(sp.presence_penalty) * (counts > 0).astype(np.float32))


def reference_token(logits: np.ndarray, prompt: list[int], generated: list[int], sp: SamplingParams,
                    held: frozenset[int]) -> int:
    return reference_draw(reference_logits(logits, prompt, generated, sp, held).astype(np.float32), sp, len(generated))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def check_run(prompt: list[int], tokens: list[int], logits: list[np.ndarray], sp: SamplingParams,
              held: frozenset[int] = frozenset()) -> None:
    assert len(tokens) == len(logits)
    for step, (token, lg) in enumerate(zip(tokens, logits, strict=True)):
        assert token == reference_token(lg, prompt, tokens[:step], sp, held), f"step {step}"


@pytest.fixture(scope="module")
def plain(engine):
    """The target alone, greedy, no controls: its tokens (what each control must change)."""
    return run_wave(engine, {2: (TARGET, SamplingParams())}, STEPS)[2][0]


@pytest.mark.parametrize("sp", [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=1.2),
    SamplingParams(presence_penalty=-2.0, frequency_penalty=0.7),
    SamplingParams(repetition_penalty=1.6),
    SamplingParams(repetition_penalty=0.5),
    SamplingParams(logit_bias=((260, 9.0), (7042, -100.0), (30, -3.5))),
    SamplingParams(temperature=0.9, seed=11, repetition_penalty=1.3, presence_penalty=0.6, logit_bias=((260, 4.0),)),
    SamplingParams(allowed_token_ids=(13, 30, 260, 1780, 2988)),
    SamplingParams(temperature=1.2, seed=5, allowed_token_ids=(13, 30, 260, 1780), logit_bias=((13, -2.0),)),
], ids=["presence", "frequency", "negative presence", "repetition", "repetition below 1", "logit_bias", "sampled",
        "allowed", "allowed sampled"])
def test_each_control_equals_the_numpy_reference(engine, plain, sp):
    tokens, logits = run_wave(engine, {2: (TARGET, sp)}, STEPS)[2]
    check_run(TARGET, tokens, logits, sp)
    if sp.temperature == 0:
        assert tokens != plain  # the control changed what greedy picks
    if sp.allowed_token_ids:
        assert set(tokens) <= set(sp.allowed_token_ids)


def test_min_tokens_holds_the_stop_ids_back(engine):
    """EOS biased to win every step: masked for the first min_tokens tokens, then chosen."""
    sp = SamplingParams(logit_bias=((EOS, 100.0),), min_tokens=3)
    tokens, logits = run_wave(engine, {1: (TARGET, sp)}, 5, stop_ids=frozenset({EOS, 13}))[1]
    check_run(TARGET, tokens, logits, sp, frozenset({EOS, 13}))
    assert EOS not in tokens[:3] and 13 not in tokens[:3] and tokens[3:] == [EOS] * 3


def test_logprobs_stay_the_models(engine):
    sp = SamplingParams(logit_bias=((9805, 100.0),), repetition_penalty=1.4)
    sample, logits = prefill_all(engine, 3, TARGET, sp, return_logits=True)
    lsm = log_softmax(np.asarray(logits)[0])
    assert sample.token == 9805 and lsm[9805] < lsm.max() - 5  # the bias chose a token the model does not prefer
    assert abs(sample.logprob - lsm[9805]) <= 1e-5
    assert [t for t, _ in sample.top] == np.argsort(-lsm, kind="stable")[:5].tolist()


def test_a_prefix_cache_hit_marks_the_skipped_prompt(engine):
    """A lane that starts on reused KV (prefill from chunk 64 on) still penalizes the prompt tokens it skipped: a
    token of the first chunk, biased to win, loses to the repetition penalty."""
    prompt = ids(5, 70)
    boosted = prompt[3]
    assert boosted not in prompt[32:]
    sp = SamplingParams(repetition_penalty=50.0, logit_bias=((boosted, 30.0),))
    fresh = run_wave(engine, {0: (prompt, sp)}, 4)[0]
    prefill_all(engine, 1, prompt[:64] + ids(6, 10), SamplingParams())  # the lane's KV now holds prompt[:64]
    engine.begin(1, prompt, sp, frozenset())
    sample, lg = engine.prefill(1, prompt, 64, sp, return_logits=True)  # the last chunk only
    tokens, logits = [sample.token], [np.asarray(lg)[0]]
    for _ in range(4):
        rows: list[DecodeRow | None] = [None] * engine.lanes
        rows[1] = DecodeRow(tokens[-1], len(prompt) + len(tokens) - 1, sp, len(tokens))
        samples, lg = engine.decode(rows, return_logits=True)
        tokens.append(samples[1].token)
        logits.append(np.asarray(lg)[1])
    check_run(prompt, tokens, logits, sp)
    assert reference_token(logits[0], prompt[64:], [], sp, frozenset()) == boosted  # had it been left unmarked
    assert tokens[0] != boosted
    assert tokens == fresh[0]
    for a, b in zip(logits, fresh[1], strict=True):
        assert np.array_equal(a, b)


# ---- invariance -------------------------------------------------------------------------------------------------
CONTROLLED = SamplingParams(temperature=0.8, top_k=40, seed=1234, presence_penalty=0.8, frequency_penalty=0.4,
                            repetition_penalty=1.2, logit_bias=((260, 3.0), (7042, -5.0)), min_tokens=4,
                            allowed_token_ids=tuple(range(2, 9000)))
HELD = frozenset({EOS})


@pytest.fixture(scope="module")
def alone_controlled(engine):
    tokens, logits = run_wave(engine, {0: (TARGET, CONTROLLED)}, STEPS, stop_ids=HELD)[0]
    check_run(TARGET, tokens, logits, CONTROLLED, HELD)
    return tokens


@pytest.mark.parametrize("lane", [1, 3])
def test_controls_bit_equal_in_any_lane(engine, alone_controlled, lane):
    assert run_wave(engine, {lane: (TARGET, CONTROLLED)}, STEPS, False, HELD)[lane][0] == alone_controlled


def test_controls_bit_equal_among_neighbours(engine, alone_controlled):
    """Neighbours with and without controls of their own; the longest runs past one KV block."""
    lanes = {2: (TARGET, CONTROLLED), 0: (ids(1, 130), SamplingParams()),
             1: (ids(2, 20), SamplingParams(temperature=1.0, seed=9, repetition_penalty=1.5)),
             3: (ids(3, 45), SamplingParams(frequency_penalty=2.0, logit_bias=((13, 50.0),), min_tokens=2))}
    assert run_wave(engine, lanes, STEPS, False, HELD)[2][0] == alone_controlled


def test_a_plain_row_is_unchanged_beside_controlled_ones(engine, plain):
    lanes = {2: (TARGET, SamplingParams()), 0: (TARGET, CONTROLLED), 3: (ids(4, 40), SamplingParams(min_tokens=9))}
    assert run_wave(engine, lanes, STEPS, False, HELD)[2][0] == plain


def test_controls_after_a_prefix_cache_hit(engine):
    sched = Scheduler(engine, continuous=True, max_queue=64, terminal_ids=frozenset())
    sched.start()
    try:
        def run(tokens: list[int], reuse: bool):
            return sched.submit(Job(tokens=tokens, max_new_tokens=10, sampling=CONTROLLED, stop_ids=HELD,
                                    reuse_prefix=reuse)).result(TIMEOUT)

        turn1 = ids(40, 70)
        turn2 = turn1 + run(turn1, True).generated + ids(41, 9)
        hit, fresh = run(turn2, True), run(turn2, False)
        assert hit.timing["cached_tokens"] == 64 and fresh.timing["cached_tokens"] == 0
        assert hit.generated == fresh.generated
        assert [(s.logprob, s.top) for s in hit.samples] == [(s.logprob, s.top) for s in fresh.samples]
    finally:
        assert sched.drain(10)


# ---- where they are refused -------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("presence_penalty", 0.5), ("frequency_penalty", -1),
                                          ("repetition_penalty", 1.1), ("logit_bias", {"5": 1}), ("min_tokens", 1),
                                          ("allowed_token_ids", [5, 6])])
def test_a_mesh_host_refuses_them_by_name(field, value):
    assert MeshEngine.token_controls is False and Engine.token_controls is True
    body = {"tokens": [1, 2], "max_new_tokens": 2, field: value}
    with pytest.raises(StationError) as e:
        parse_generate(body, VOCAB, 512, frozenset({EOS}), lambda resume: True, on_device=False)
    assert e.value.field == field and field in e.value.message
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": {},
               "min_tokens": 0, "ignore_eos": True}
    if field == "allowed_token_ids":  # no neutral value to send: absent is the neutral one
        del body[field]
    job, _ = parse_generate({**body, **neutral}, VOCAB, 512, frozenset({EOS}), lambda resume: True, on_device=False)
    assert not job.sampling.controls and job.stop_ids == frozenset()


@pytest.mark.parametrize("extra", [{"allowed_token_ids": [5, VOCAB]}, {"allowed_token_ids": []},
                                   {"allowed_token_ids": [EOS], "min_tokens": 1}],
                         ids=["past the vocabulary", "empty", "only stop ids under min_tokens"])
def test_bad_allowed_token_ids_are_refused_by_name(extra):
    body = {"tokens": [1, 2], "max_new_tokens": 2, **extra}
    with pytest.raises(StationError) as e:
        parse_generate(body, VOCAB, 512, frozenset({EOS}), lambda resume: True, on_device=True)
    assert e.value.status == 422 and e.value.field == "allowed_token_ids"
    job, _ = parse_generate({**body, "allowed_token_ids": [EOS, 7]}, VOCAB, 512, frozenset({EOS}), lambda resume: True,
                         on_device=True)
    assert job.sampling.allowed_token_ids == (EOS, 7) and job.sampling.controls
