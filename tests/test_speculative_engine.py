"""Speculative decoding on the real engine: a request's tokens, logprobs and finish reason with prompt-lookup drafts
verified in one step equal those without speculation, bit for bit (greedy and seeded, k = 1, 3 and 7, alone and
beside requests that speculate and that do not, both scheduler modes, the default model's GGUF blocks and int8)."""

from __future__ import annotations

import pytest

from jaxstation.engine.engine import Engine
from jaxstation.engine.jobs import Job, Result
from jaxstation.engine.rows import SamplingParams
from jaxstation.engine.scheduler import Scheduler
from jaxstation.engine.speculative import NgramProposer, Speculation
from jaxstation.model.loader import LoadedModel

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
# input-grounded: the prompt lists the same items twice, so the output's n-grams are in the prompt
TEXT = ("Copy the list exactly.\nList: apples, pears, plums, cherries, grapes, lemons, limes, figs, dates.\n"
        "Copy: apples, pears, plums, cherries, grapes, lemons, limes, figs, dates.\nCopy: apples, pears,")


def signature(r: Result) -> tuple:
    return r.generated, [(s.token, s.logprob, s.top) for s in r.samples], r.finish_reason


def run(engine: Engine, jobs: list[Job], speculation: Speculation | None, continuous: bool = True
        ) -> tuple[list[tuple], Scheduler]:
    sched = Scheduler(engine, continuous=continuous, max_queue=16, terminal_ids=frozenset(), speculation=speculation)
    sched.start()
    try:
        for job in jobs:
            sched.submit(job)
        return [signature(job.future.result(300)) for job in jobs], sched
    finally:
        assert sched.drain(30)


def accepted(sched: Scheduler) -> float:
    return sched.metrics.registry.get_sample_value("jaxstation_spec_decode_num_accepted_tokens_total") or 0.0


def jobs_for(prompts: list[list[int]], sampling: SamplingParams, n: int = 16, opt_out: int = -1) -> list[Job]:
    return [Job(tokens=p, max_new_tokens=n, sampling=sampling, speculate=i != opt_out) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def prompt(default_model: LoadedModel) -> list[int]:
    return default_model.tokenizer.encode(TEXT)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 3])
def test_alone_speculation_changes_no_bit(engine: Engine, prompt: list[int], sampling: SamplingParams, k: int
                                          ) -> None:
    plain, _ = run(engine, jobs_for([prompt], sampling), None)
    spec, sched = run(engine, jobs_for([prompt], sampling), Speculation(NgramProposer(1, 4), k=k))
    assert spec == plain
    assert accepted(sched) > 0  # the verify steps ran and accepted drafts


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "serialized"])
def test_beside_one_other_speculation_changes_no_bit(engine: Engine, prompt: list[int], continuous: bool) -> None:
    prompts = [prompt, prompt[5:]]  # 4 lanes: two decode rows leave two rows for drafts
    alone = [run(engine, jobs_for([p], SEEDED), None)[0][0] for p in prompts]
    spec, sched = run(engine, jobs_for(prompts, SEEDED), Speculation(k=3), continuous)
    assert spec == alone
    assert accepted(sched) > 0


@pytest.mark.parametrize("others", [3, 7])
def test_seven_drafts_a_step_beside_others_on_a_wide_engine(wide_engine: Engine, prompt: list[int], others: int
                                                            ) -> None:
    """16 lanes: up to 7 drafts of the oldest request beside 3 or 7 others, one of which does not speculate (drafts
    may widen the wave to all 16 rows)."""
    prompts = [prompt] + [prompt[3 * i:] for i in range(1, others + 1)]
    plain, _ = run(wide_engine, jobs_for(prompts, GREEDY), None)
    spec, sched = run(wide_engine, jobs_for(prompts, GREEDY, opt_out=2), Speculation(k=7, rows=16))
    assert spec == plain
    assert accepted(sched) > 0


def test_int8_weights(int8_engine: Engine, prompt: list[int]) -> None:
    plain, _ = run(int8_engine, jobs_for([prompt], GREEDY, n=16), None)
    spec, sched = run(int8_engine, jobs_for([prompt], GREEDY, n=16), Speculation(k=3))
    assert spec == plain
    assert accepted(sched) > 0


def test_max_new_tokens_inside_an_accepted_run(engine: Engine, prompt: list[int]) -> None:
    for n in (2, 3, 5):
        plain, _ = run(engine, jobs_for([prompt], GREEDY, n=n), None)
        spec, _ = run(engine, jobs_for([prompt], GREEDY, n=n), Speculation(k=3))
        assert spec == plain and len(spec[0][0]) == n
