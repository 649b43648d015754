"""Speculative decoding in the scheduler, against FakeEngine (tests/fake_engine.py) with scripted drafts: every
request's tokens equal plain decoding's, whatever the drafts, and the verify steps carry the drafts asked for."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from fake_engine import FakeEngine, expected

from jaxstation.engine.jobs import Job
from jaxstation.engine.rows import SamplingParams
from jaxstation.engine.scheduler import Scheduler
from jaxstation.engine.speculative import LookupProposer, Speculation

TIMEOUT = 5.0


class Oracle(LookupProposer):
    """Drafts the fake's true continuation of `prompt`, with the draft at `wrong` positions of the output made wrong."""

    def __init__(self, prompt: list[int], wrong: Sequence[int] = ()) -> None:
        self.prompt, self.wrong = prompt, set(wrong)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        n = len(tokens) - len(self.prompt)  # tokens generated so far
        truth = expected(self.prompt, n + k)[n:]
        return [t + 1 if n + j in self.wrong else t for j, t in enumerate(truth)]


def run(prompt: list[int], n: int, proposer, lanes: int = 4, verify_rows: int = 4, others: int = 0,
        **job_kw) -> tuple[FakeEngine, Scheduler, list[list[int]]]:
    fake = FakeEngine(lanes=lanes, chunk=4)
    fake.verify_rows = verify_rows
    sched = Scheduler(fake, continuous=True, max_queue=8, terminal_ids=frozenset(),
                      speculation=Speculation(proposer, k=3, patience=2))
    jobs = [Job(tokens=prompt, max_new_tokens=n, **job_kw)]
    jobs += [Job(tokens=[50 + j], max_new_tokens=n, speculate=False) for j in range(others)]
    for job in jobs:
        sched.submit(job)
    sched.start()
    try:
        results = [job.future.result(TIMEOUT).generated for job in jobs]
    finally:
        sched.drain(TIMEOUT)
    assert fake.errors == []
    return fake, sched, results


def verifies(fake: FakeEngine) -> list[tuple]:
    return [c[1] for c in fake.calls if c[0] == "verify"]


def counted(sched: Scheduler, name: str) -> float:
    return sched.metrics.registry.get_sample_value(f"jaxstation_spec_decode_num_{name}_total") or 0.0


PROMPT = [3, 1, 4, 1, 5]


def test_right_drafts_are_accepted_k_at_a_time() -> None:
    fake, sched, [tokens] = run(PROMPT, 9, Oracle(PROMPT))
    assert tokens == expected(PROMPT, 9)
    truth = expected(PROMPT, 9)
    # after the first token (prefill), 3 drafts a step, and each step yields 4 tokens
    assert verifies(fake) == [((0, tuple(truth[1:4])),), ((0, tuple(truth[5:8])),)]
    assert (counted(sched, "drafts"), counted(sched, "draft_tokens"), counted(sched, "accepted_tokens")) == (2, 6, 6)


def test_a_wrong_draft_ends_the_run_with_the_sample_plain_decoding_takes() -> None:
    fake, sched, [tokens] = run(PROMPT, 9, Oracle(PROMPT, wrong=[2]))
    assert tokens == expected(PROMPT, 9)
    assert counted(sched, "accepted_tokens") < counted(sched, "draft_tokens")


def test_drafts_that_always_fail_stop_after_patience_and_change_nothing() -> None:
    fake, sched, [tokens] = run(PROMPT, 12, Oracle(PROMPT, wrong=range(100)))
    assert tokens == expected(PROMPT, 12)
    assert counted(sched, "drafts") == 2 and counted(sched, "accepted_tokens") == 0  # patience 2, then plain waves
    assert [c[0] for c in fake.calls].count("decode") == 12 - 1 - 2


@pytest.mark.parametrize("stop_at", [2, 5])
def test_a_stop_id_inside_an_accepted_run_ends_the_request_there(stop_at: int) -> None:
    truth = expected(PROMPT, 12)
    stop = truth[stop_at]
    fake, sched, [tokens] = run(PROMPT, 12, Oracle(PROMPT), stop_ids=frozenset({stop}))
    assert tokens == truth[:truth.index(stop)]


def test_never_more_tokens_than_asked_and_rows_within_the_verify_width() -> None:
    fake, sched, [tokens] = run(PROMPT, 6, Oracle(PROMPT), verify_rows=3)
    assert tokens == expected(PROMPT, 6)
    assert all(len(drafts) <= 2 for call in verifies(fake) for _, drafts in call)  # 3 rows: the token and 2 drafts
    assert sum(len(d) for call in verifies(fake) for _, d in call) + len(verifies(fake)) + 1 <= 6 + 2


def test_beside_others_that_do_not_speculate_every_request_decodes_as_alone() -> None:
    fake, sched, results = run(PROMPT, 16, Oracle(PROMPT), others=2)
    assert results == [expected(PROMPT, 16), expected([50], 16), expected([51], 16)]
    calls = verifies(fake)
    assert any(len(call) == 3 for call in calls)  # the others ride in the verify steps as plain rows
    assert all(not drafts for call in calls for lane, drafts in call if lane != 0)
    assert all(sum(1 + len(drafts) for _, drafts in call) <= 4 for call in calls)  # within verify_rows


def test_requests_with_token_controls_or_that_opt_out_do_not_draft() -> None:
    for kw in ({"speculate": False}, {"sampling": SamplingParams(presence_penalty=0.5)}):
        fake, sched, [tokens] = run(PROMPT, 6, Oracle(PROMPT), **kw)
        assert verifies(fake) == [] and counted(sched, "drafts") == 0


def test_an_engine_that_cannot_verify_never_speculates() -> None:
    fake, sched, [tokens] = run(PROMPT, 6, Oracle(PROMPT), verify_rows=0)
    assert tokens == expected(PROMPT, 6) and verifies(fake) == [] and sched.speculation is None
