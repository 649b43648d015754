"""Structured outputs on the engine and the scheduler: the device's mask against numpy, constrained runs on the
default model against a numpy reference and their schemas, the end of output, refusals, and bitwise invariance
(alone, among neighbours with and without constraints, in any lane, with continuous batching on and off, after a
prefix-cache hit)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from sampling_reference import reference_draw

from jaxstation.engine.constraints import (
    ConstraintError,
    ConstraintFailed,
    ConstraintSpec,
    Grammars,
    mask_words,
    token_bits,
)
from jaxstation.engine.jobs import Job
from jaxstation.engine.penalties import PenaltyArrays, allocate_token_state, penalize, unpack_mask
from jaxstation.engine.rows import DecodeRow, SamplingParams
from jaxstation.engine.scheduler import Scheduler

EOS = 2
TIMEOUT = 180
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
                                         "sunny": {"type": "boolean"}}, "required": ["city", "sunny"],
        "additionalProperties": False}


def encode(default_model, text: str) -> list[int]:
    return default_model.tokenizer.encode(text, add_special_tokens=False)


def numpy_unpack(mask: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=-1, bitorder="little")[..., :vocab] == 1


@pytest.mark.parametrize("vocab", [49152, 100, 33])
def test_the_device_unpacks_a_mask_as_numpy_does(vocab):
    rng = np.random.default_rng(vocab)
    mask = rng.integers(-(1 << 31), 1 << 31, size=(3, mask_words(vocab)), dtype=np.int64).astype(np.int32)
    assert np.array_equal(np.asarray(unpack_mask(jnp.asarray(mask), vocab)), numpy_unpack(mask, vocab))
    tokens = sorted(rng.choice(vocab, size=min(vocab, 17), replace=False).tolist())
    assert np.flatnonzero(numpy_unpack(token_bits(tokens, vocab), vocab)).tolist() == tokens


def test_a_mask_acts_on_its_row_only():
    """Row 1 constrained, row 2 penalized, rows 0 and 3 plain: the plain rows keep their bits, row 1 is its logits
    with -inf outside the mask, row 2 is unmasked."""
    vocab, rows = 300, 4
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    allowed = [3, 17, 64, 200, 299]
    mask = np.zeros((rows, mask_words(vocab)), np.int32)
    mask[1] = token_bits(allowed, vocab)
    p = PenaltyArrays(active=np.array([False, False, True, False]), presence=np.zeros(rows, np.float32),
                      frequency=np.zeros(rows, np.float32), repetition=np.array([1, 1, 1.5, 1], np.float32),
                      min_tokens=np.zeros(rows, np.int32), constrained=np.array([False, True, False, False]),
                      mask=mask)
    out = np.asarray(penalize(jnp.asarray(logits), allocate_token_state(rows, vocab), jnp.arange(rows), p,
                              jnp.zeros(rows, jnp.int32)))
    assert np.array_equal(out[[0, 3]], logits[[0, 3]])
    expect = np.full(vocab, -np.inf, np.float32)
    expect[allowed] = logits[1, allowed]
    assert np.array_equal(out[1], expect)
    assert np.isfinite(out[2]).all()


def constrained_run(engine, grammars, lane: int, prompt: list[int], sp: SamplingParams, spec: ConstraintSpec,
                    steps: int) -> tuple[list[int], bool]:
    """Greedy or seeded run of `spec` on `lane`, each token checked against the numpy reference: the argmax of the
    model's logits with -inf outside the grammar's mask, or its seeded draw from them when sampled.
    Returns the tokens and whether the grammar ended."""
    constraint = grammars.compile(spec)
    vocab = engine.cfg.vocab_size
    mask = np.zeros(mask_words(vocab), np.int32)
    constraint.fill(mask)
    engine.begin(lane, prompt, sp, frozenset({EOS}))
    for start in range(0, len(prompt), engine.chunk):
        sample, lg = engine.prefill(lane, prompt, start, sp, return_logits=True, mask=mask)
    tokens, logits = [sample.token], [np.asarray(lg)[0]]
    masks = [mask.copy()]
    while len(tokens) <= steps and tokens[-1] != EOS:
        constraint.advance(tokens[-1])
        if constraint.finished:
            break
        constraint.fill(mask)
        masks.append(mask.copy())
        rows: list[DecodeRow | None] = [None] * engine.lanes
        rows[lane] = DecodeRow(tokens[-1], len(prompt) + len(tokens) - 1, sp, len(tokens), mask.copy())
        samples, lg = engine.decode(rows, return_logits=True)
        tokens.append(samples[lane].token)
        logits.append(np.asarray(lg)[lane])
    for step, (token, lg, m) in enumerate(zip(tokens, logits, masks, strict=True)):
        x = np.where(numpy_unpack(m, vocab), lg, -np.inf).astype(np.float32)
        assert token == reference_draw(x, sp, step), f"step {step}"
    return tokens, constraint.finished


def test_a_json_schema_run_equals_the_numpy_reference_and_validates(engine, grammars, default_model):
    prompt = encode(default_model, "Describe a person as JSON with a name and an age:\n")
    spec = ConstraintSpec("json", PERSON, "response_format")
    tokens, finished = constrained_run(engine, grammars, 1, prompt, SamplingParams(), spec, 60)
    assert finished
    doc = json.loads(default_model.tokenizer.decode(tokens))
    jsonschema.validate(doc, PERSON)


def test_a_regex_and_a_choice(engine, grammars, default_model):
    prompt = encode(default_model, "Is Paris the capital of France? Answer:")
    tokens, finished = constrained_run(engine, grammars, 0, prompt, SamplingParams(),
                                       ConstraintSpec("choice", ["yes", "no", "maybe"], "structured_outputs.choice"),
                                       10)
    assert finished and default_model.tokenizer.decode(tokens) in ("yes", "no", "maybe")
    tokens, finished = constrained_run(engine, grammars, 2, prompt, SamplingParams(temperature=1.0, seed=3),
                                       ConstraintSpec("regex", r"[0-9]{3}-[A-Z]{2}", "structured_outputs.regex"), 12)
    assert finished
    text = default_model.tokenizer.decode(tokens)
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isupper()


@pytest.mark.parametrize("spec", [
    ConstraintSpec("json", {"type": "object", "properties": {"a": {"type": "strnig"}}}, "response_format"),
    ConstraintSpec("regex", "(unclosed", "structured_outputs.regex"),
    ConstraintSpec("grammar", "start: missing_rule", "structured_outputs.grammar"),
    ConstraintSpec("json", "{not json", "structured_outputs.json"),
], ids=["bad type", "bad regex", "bad grammar", "not json"])
def test_a_bad_constraint_is_refused_with_its_reason(grammars, spec):
    with pytest.raises(ConstraintError) as e:
        grammars.compile(spec)
    assert e.value.field == spec.field and e.value.message.startswith(spec.field + ": ") and len(e.value.message) > 30


def test_a_compile_past_the_limit_is_refused(default_model):
    """400 string fields, each with its own pattern: tens of milliseconds to compile, against a limit of 0.1 ms."""
    tok = default_model.tokenizer
    strict = Grammars(tok, default_model.cfg.vocab_size, tok.eos_ids, timeout_s=1e-4)
    strict.tokenizer()
    fields = {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 7 + 9}}}[0-9]+x{i}$"}
              for i in range(400)}
    big = {"type": "object", "properties": fields, "required": list(fields)}
    with pytest.raises(ConstraintError, match=r"response_format: compiling the constraint took longer than 0.0001 s"):
        strict.compile(ConstraintSpec("json", big, "response_format"))



def slow_schema(salt: int, n: int = 8000) -> dict:
    """n string fields, each with its own pattern: seconds to compile (8000 took 0.8 s on a quiet 2-core Intel Xeon,
    4 s on a busy one)."""
    fields = {f"f{salt}_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 7 + 9}}}[0-9]+y{salt}x{i}$"}
              for i in range(n)}
    return {"type": "object", "properties": fields, "required": list(fields)}


def test_compiles_past_the_limit_do_not_hold_up_the_next_request(default_model):
    """Two schemas that outlive the limit are refused, and their compiles, still running, take no worker from the
    simple schema that follows: it answers."""
    tok = default_model.tokenizer
    grammars = Grammars(tok, default_model.cfg.vocab_size, tok.eos_ids, timeout_s=0.25)
    grammars.tokenizer()
    for salt in (1, 2):
        with pytest.raises(ConstraintError, match="took longer than 0.25 s"):
            grammars.compile(ConstraintSpec("json", slow_schema(salt), "response_format"))
    simple = grammars.compile(ConstraintSpec("json", {"type": "object", "properties": {"a": {"type": "integer"}}},
                                             "response_format"))
    assert not simple.finished

# ---- through the scheduler ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jobs(default_model, grammars):
    """Job factories: the target (a seeded JSON-schema request), and neighbours with and without constraints."""
    target_prompt = encode(default_model, "A JSON object for a person:\n")

    def target(**kw) -> Job:
        sp = SamplingParams(temperature=0.8, seed=77, repetition_penalty=1.1)
        return Job(tokens=kw.pop("tokens", target_prompt), max_new_tokens=40, sampling=sp, stop_ids=frozenset({EOS}),
                   constraint=grammars.compile(ConstraintSpec("json", PERSON, "response_format")), **kw)

    def neighbours() -> list[Job]:
        return [
            Job(tokens=encode(default_model, "The weather in France today:"), max_new_tokens=12,
                sampling=SamplingParams(temperature=1.0, seed=5), stop_ids=frozenset({EOS}),
                constraint=grammars.compile(ConstraintSpec("json", CITY, "response_format"))),
            Job(tokens=list(range(100, 170)), max_new_tokens=9, sampling=SamplingParams(), stop_ids=frozenset()),
            Job(tokens=encode(default_model, "Say yes or no:"), max_new_tokens=5,
                sampling=SamplingParams(presence_penalty=1.0), stop_ids=frozenset({EOS}),
                constraint=grammars.compile(ConstraintSpec("regex", "(yes|no)!", "structured_outputs.regex"))),
        ]
    return target, neighbours


def run_jobs(engine, job_list: list[Job], continuous: bool) -> list:
    sched = Scheduler(engine, continuous=continuous, max_queue=64, terminal_ids=frozenset())
    sched.start()
    try:
        futures = [sched.submit(j) for j in job_list]
        return [f.result(TIMEOUT) for f in futures]
    finally:
        assert sched.drain(10)


def signature(result) -> tuple:
    return result.generated, result.finish_reason, [(s.logprob, s.top) for s in result.samples]


@pytest.fixture(scope="module")
def alone(engine, jobs, default_model):
    target, _ = jobs
    result = run_jobs(engine, [target()], continuous=True)[0]
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(default_model.tokenizer.decode(result.generated)), PERSON)
    return signature(result)


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "serialized"])
@pytest.mark.parametrize("position", [0, 3], ids=["first", "last"])
def test_a_constrained_request_is_bit_equal_among_others(engine, jobs, alone, default_model, continuous, position):
    """In the first or the last lane, beside a constrained, a plain and a penalized-and-constrained neighbour."""
    target, neighbours = jobs
    batch = neighbours()
    batch.insert(position, target())
    results = run_jobs(engine, batch, continuous)
    assert signature(results[position]) == alone
    city = results[1 if position == 0 else 0]
    assert city.finish_reason in ("stop", "length")
    if city.finish_reason == "stop":
        jsonschema.validate(json.loads(default_model.tokenizer.decode(city.generated)), CITY)
    yes_no = default_model.tokenizer.decode(results[-1 if position == 0 else 2].generated)
    assert yes_no in ("yes!", "no!")


def test_a_constrained_request_after_a_prefix_cache_hit(engine, jobs, default_model):
    target, _ = jobs
    turn1 = encode(default_model, "Here is a long preamble about people and their records. " * 6)
    assert len(turn1) > 64
    sched = Scheduler(engine, continuous=True, max_queue=64, terminal_ids=frozenset())
    sched.start()
    try:
        sched.submit(Job(tokens=turn1, max_new_tokens=3)).result(TIMEOUT)
        prompt = turn1 + encode(default_model, " A JSON object for a person:\n")
        hit = sched.submit(target(tokens=prompt)).result(TIMEOUT)
        fresh = sched.submit(target(tokens=prompt, reuse_prefix=False)).result(TIMEOUT)
    finally:
        assert sched.drain(10)
    assert (hit.timing["cached_tokens"], fresh.timing["cached_tokens"]) == (64, 0)
    assert signature(hit) == signature(fresh)


def test_eos_waits_for_the_grammar(engine, grammars, default_model):
    """EOS biased to win every step, under a grammar that accepts after each "ab" and could go on: EOS is masked
    until the grammar accepts, then taken."""
    sp = SamplingParams(logit_bias=((EOS, 100.0),))
    job = Job(tokens=encode(default_model, "Letters:"), max_new_tokens=20, sampling=sp, stop_ids=frozenset({EOS}),
              constraint=grammars.compile(ConstraintSpec("regex", "(ab)+", "structured_outputs.regex")))
    result = run_jobs(engine, [job], continuous=True)[0]
    assert result.finish_reason == "stop" and result.stop_sample.token == EOS
    assert default_model.tokenizer.decode(result.generated) == "ab"


def test_a_request_left_with_no_token_fails_alone(engine, grammars, default_model):
    """allowed_token_ids outside the grammar: the request fails before its first token, with a clear error, and
    the request beside it is served."""
    none_left = Job(tokens=encode(default_model, "Answer:"), max_new_tokens=5,
                    sampling=SamplingParams(allowed_token_ids=(13, 30)), stop_ids=frozenset({EOS}),
                    constraint=grammars.compile(ConstraintSpec("choice", ["yes", "no"], "structured_outputs.choice")))
    plain = Job(tokens=encode(default_model, "Answer:"), max_new_tokens=5)
    sched = Scheduler(engine, continuous=True, max_queue=64, terminal_ids=frozenset())
    sched.start()
    try:
        failed, served = sched.submit(none_left), sched.submit(plain)
        with pytest.raises(ConstraintFailed, match="structured_outputs.choice constraint allows no token"):
            failed.result(TIMEOUT)
        assert len(served.result(TIMEOUT).generated) == 5
    finally:
        assert sched.drain(10)


def test_min_tokens_cannot_hold_a_finished_grammar_open(engine, grammars, default_model):
    """A grammar that completes ends the request ("stop") even below min_tokens: its output cannot go on."""
    job = Job(tokens=encode(default_model, "Answer:"), max_new_tokens=8, sampling=SamplingParams(min_tokens=6),
              stop_ids=frozenset({EOS}),
              constraint=grammars.compile(ConstraintSpec("choice", ["yes", "no"], "structured_outputs.choice")))
    result = run_jobs(engine, [job], continuous=True)[0]
    assert result.finish_reason == "stop" and default_model.tokenizer.decode(result.generated) in ("yes", "no")

