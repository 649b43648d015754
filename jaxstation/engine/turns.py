"""What the scheduler's turns are made of: a lane's request state (`Lane`), one turn's plan (`Plan`), and how a
packing engine's turn shares its rows among the prompts waiting to enter (`prompt_pieces`). Host-only bookkeeping; the
decode thread owns every object here (engine/scheduler.py).

Admission. On an engine that packs (`prefill_budget` > 0), a turn's prompt work is pieces of every prefilling lane's
prompt under the turn's rows, less the decode rows: up to a chunk for each lane, oldest first, then the rest to the
oldest, so neither a long prompt nor a stream of short ones holds the other back. A turn without decode rows may fill
the whole budget; one with decode rows takes `Engine.turn_rows` (a packed step at most about twice their plain wave,
as timed at warm-up, and always room for a prompt row), so running lanes keep their pace while prompts enter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxstation.engine.jobs import Job, Result
from jaxstation.engine.rows import DecodeRow, PromptPiece, Sample
from jaxstation.engine.speculative import DraftLength, Proposer


@dataclasses.dataclass
class Lane:
    """A lane's request state: how much of the prompt is in the arena, and what it has generated."""

    job: Job
    admitted_at: float
    fed: int = 0  # prompt tokens in the arena (prefilled or reused)
    samples: list[Sample] = dataclasses.field(default_factory=list)
    scored: list[Sample] = dataclasses.field(default_factory=list)  # prompt tokens 1.. scored so far
    stop_sample: Sample | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    repacked: bool = False  # a scored prompt, prefilled again in packed steps before it generates
    draft: DraftLength | None = None  # how many tokens it drafts next, where the station speculates

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.job.tokens)

    def decode_row(self, mask: np.ndarray | None) -> DecodeRow:
        """The row that feeds the lane's last token back at its position (`mask`: its constraint's)."""
        n = len(self.samples)
        return DecodeRow(self.samples[-1].token, len(self.job.tokens) + n - 1, self.job.sampling, n, mask)

    def next_mask(self) -> np.ndarray | None:
        """The constraint mask of its next token (`Constraint.next_mask`; None without a constraint). Raises
        ConstraintFailed when the constraint leaves no token."""
        job = self.job
        if job.constraint is None:
            return None
        return job.constraint.next_mask(len(self.samples), job.sampling.min_tokens, job.stop_ids,
                                        job.sampling.allowed_token_ids)

    @property
    def speculates(self) -> bool:
        """Whether its next decode row may carry drafts: a request that allows it, with no constraint and no token
        controls (which read per-token state a verify step does not advance), still drafting."""
        job = self.job
        return (self.draft is not None and self.draft.drafting and job.speculate and job.constraint is None
                and not job.sampling.controls)

    @property
    def scores(self) -> bool:
        """Whether its next prefill scores its prompt (one chunk per turn, never packed)."""
        return self.job.prompt_logprobs and not self.repacked

    def history(self) -> list[int]:
        """The request's tokens so far: its prompt and what it has generated."""
        return [*self.job.tokens, *(s.token for s in self.samples)]

    def result(self, reason: str, now: float) -> Result:
        """The job's Result, ending now for `reason`."""
        job = self.job
        timing = {"queue_s": self.admitted_at - job.submitted_at, "ttft_s": (self.first_token_at or now) -
                  job.submitted_at, "total_s": now - job.submitted_at, "cached_tokens": job.cached_tokens}
        return Result([s.token for s in self.samples], reason, len(job.tokens), self.samples, timing, self.scored,
                      self.stop_sample)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One turn: at most one prefill chunk, prompt pieces for a packed step, and the decoding lanes' rows
    (constrained ones masked). With pieces, the decode rows ride in the packed step; without, they are a wave."""

    prefill_lane: int | None
    decode_rows: list[DecodeRow | None]
    prefill_mask: np.ndarray | None = None  # the prefill lane's constraint mask, when its chunk samples
    pieces: list[PromptPiece] = dataclasses.field(default_factory=list)


def ending_lanes(lanes: Sequence[Lane | None]) -> dict[int, str]:
    """The lanes whose job was cancelled ("cancel") or asked to finish early ("stop"). The caller holds the
    scheduler's cond."""
    return {i: "cancel" if lane.job.cancelled or lane.job.future.cancelled() else "stop"
            for i, lane in enumerate(lanes)
            if lane is not None and (lane.job.cancelled or lane.job.future.cancelled() or lane.job.stop_requested)}


def draft_rows(lanes: Sequence[Lane | None], rows: list[DecodeRow | None], verify_rows: int,
               proposer: Proposer) -> None:
    """Give the decode rows of lanes that speculate their drafts, the oldest request first, while the verify step's
    rows fit `verify_rows`; never more than a request may still generate after the row's own token."""
    room = verify_rows - sum(r is not None for r in rows)
    if room <= 0:
        return
    asks = []
    for i in sorted((i for i, r in enumerate(rows) if r is not None), key=lambda i: lanes[i].admitted_at):
        lane = lanes[i]
        k = min(lane.draft.k if lane.draft else 0, lane.job.max_new_tokens - len(lane.samples) - 1)
        if k > 0 and lane.speculates:
            asks.append((i, lane.history(), k))
    for i, drafts in proposer.propose_batch(asks, room).items():
        rows[i] = dataclasses.replace(rows[i], drafts=tuple(drafts))


def prompt_pieces(lanes: Sequence[Lane | None], waiting: Sequence[int], chunk: int, budget: int
                  ) -> list[PromptPiece]:
    """Pieces of the `waiting` lanes' prompts (oldest first), `budget` tokens in all: first up to a chunk for each,
    so that no long prompt holds short ones back; then what is left of the budget to the oldest."""
    take = dict.fromkeys(waiting, 0)
    for share in (chunk, None):
        for i in waiting:
            lane = lanes[i]
            n = min(len(lane.job.tokens) - lane.fed - take[i], budget, share or budget)
            take[i] += n
            budget -= n
    return [PromptPiece(i, lanes[i].job.tokens, lanes[i].fed, n, lanes[i].job.sampling) for i, n in take.items() if n]
