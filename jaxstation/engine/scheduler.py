"""The scheduler: one decode thread owns the engine and runs continuous batching over its lanes.

Request threads `submit` jobs into a bounded queue (engine/job_queue.py) and get Futures. Each turn the decode thread
fills free lanes from the queue, each job into the lane with the longest reusable prefix or one the prefix cache's
tiers copy a longer prefix into (engine/prefix_tier.py), plans the turn's prompt work and decode rows (`schedule`,
engine/turns.py), runs them as engine steps and folds each sample into its request (`postprocess`), which retires on
a stop id, a sentence end, `max_new_tokens`, `finish_early` or cancellation. The steps come from a fixed set of shapes
and never mix rows, and each request samples with its own seed and counter: a job's tokens never depend on its lane,
on what runs beside it, or on the mode. A step that raises fails the jobs in its lanes, rebuilds the arena, drops
every cached prefix and serving goes on. The decode thread alone owns the engine, the prefix cache and its tiers,
`prefill_order` and each `Lane`'s progress; `cond` guards the rest (docs/design.md, "Threads and who owns what").
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import numpy as np

from jaxstation.engine import host_memory
from jaxstation.engine.activity import Activity
from jaxstation.engine.constraints import ConstraintFailed
from jaxstation.engine.job_queue import JobQueue
from jaxstation.engine.jobs import Cancelled, ShuttingDown, StepFailed, answer
from jaxstation.engine.metrics import StationMetrics
from jaxstation.engine.prefix_cache import PrefixCache
from jaxstation.engine.prefix_disk import DiskTier
from jaxstation.engine.prefix_tier import Admission, PrefixTier
from jaxstation.engine.rows import DecodeRow, PromptPiece, Sample
from jaxstation.engine.runner import Runner
from jaxstation.engine.speculative import Speculation, accept
from jaxstation.engine.turns import Lane, Plan, draft_rows, ending_lanes, prompt_pieces

log = logging.getLogger(__name__)
T = TypeVar("T")


class Scheduler(JobQueue):
    """Continuous batching of the queued jobs over `engine`'s lanes (`continuous`=False: one job at a time), ending a
    job at a sentence end on `terminal_ids`, with the prefix cache's tiers of `prefix_cache_ram` bytes over the disk
    tier `prefix_cache_disk` opens, and with `speculation` where the engine verifies drafts."""

    def __init__(self, engine: Runner, *, continuous: bool, max_queue: int, terminal_ids: frozenset[int],
                 metrics: StationMetrics | None = None, speculation: Speculation | None = None,
                 prefix_cache_ram: int = 0, prefix_cache_disk: Callable[[], DiskTier] | None = None) -> None:
        super().__init__(engine.lanes, max_queue, metrics or StationMetrics())
        self.engine = engine
        self.speculation = speculation if engine.verify_rows > 1 else None
        self.continuous = continuous
        self.terminal_ids = terminal_ids
        # the decode thread's: its turns that ran a step, its idle waits, the lanes waiting for prefill (oldest first),
        # the prefix cache and its tiers, and what it publishes (`activity.snapshot`, which anyone reads)
        self.waves = 0
        self._idle = host_memory.IdleRelease()
        self.prefill_order: deque[int] = deque()
        self.prefix_cache = PrefixCache(engine.lanes, engine.chunk)
        self.prefix_tier = PrefixTier(engine, self.prefix_cache, prefix_cache_ram, self.metrics, prefix_cache_disk)
        self.activity = Activity(engine.lanes, self.metrics)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the decode thread."""
        self._thread = threading.Thread(target=self._run, name="jaxstation-decode", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def reset_prefix_cache(self) -> Future:
        """Forget every free lane's cached prefix (vLLM's /reset_prefix_cache): the next requests prefill in full,
        as a cold station's do. The decode thread does it between two turns, so every lane freed before the returned
        Future answers loses its prefix, and lanes in flight are untouched; the host tier is emptied and the disk tier's
        files deleted. The Future answers how many entries were dropped."""
        done: Future = Future()
        with self.cond:
            if self.alive and not self._stop:
                self._prefix_resets.append(done)
                self.cond.notify()
            else:  # no decode thread owns the cache
                done.set_result(self.prefix_cache.clear() + self.prefix_tier.clear())
        return done

    def drain(self, timeout_s: float) -> bool:
        """Stop taking work, let queued and running jobs finish for up to timeout_s, fail the rest, stop the thread;
        True if everything finished in time."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            self._accepting = False
            while (self.pending or self.busy_lanes) and self.alive:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            clean = not self.pending and not self.busy_lanes
            self._fail_pending(ShuttingDown("the station shut down before this request started"))
            self._stop = True  # the decode thread fails its lanes on its way out, so every Future is answered first
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, timeout_s))
        self._fail_all(ShuttingDown("the station shut down before this request finished"))  # a thread stuck in a step
        self.prefix_tier.close()  # the disk tier's queued writes land before the process exits
        return clean

    # ---- the decode thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the loop itself broke: nobody may wait forever on a dead thread
            log.exception("decode thread died")
            self._fail_all(StepFailed(f"decode thread died: {type(e).__name__}: {e}"))
            raise

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not (self._stop or self.pending or self.busy_lanes or self._prefix_resets):
                    self._idle.wait(self.cond, self.waves)
                if self._stop:
                    self._reset_prefixes()
                    self._fail_lanes(ShuttingDown("the station shut down before this request finished"))
                    self.prefix_tier.persist()  # the lanes' prefixes, to the disk tier
                    return
                self._reset_prefixes()
                ending = ending_lanes(self.lanes)
                admissions = self._fill()
            try:  # the new jobs hold their lanes: the tier's copies fail as a step does
                self._admit(admissions)
                self._execute(self.schedule(ending))
            except Exception as e:  # a failed step: fail the lanes in flight, rebuild, keep serving
                log.exception("step failed")
                self._fail_lanes(StepFailed(f"step failed: {type(e).__name__}: {e}", cause=e))
                self.engine.reset()
                self.prefix_cache.clear()
            with self.cond:
                self.activity.publish(self.lanes, len(self.pending), self.prefix_cache)
                self.cond.notify_all()  # wake a drain waiting for the last job

    def _reset_prefixes(self) -> None:
        """Answer the queued reset_prefix_cache requests. Holds cond."""
        for done in self._prefix_resets:
            answer(done, self.prefix_cache.clear() + self.prefix_tier.clear())
        self._prefix_resets.clear()

    def _fill(self) -> list[Admission]:
        """Move pending jobs into free lanes (in serialize-all mode only when every lane is free), each into the
        lane with the longest reusable prefix; `_admit` sets what each reuses. Holds cond."""
        now = time.perf_counter()
        admissions = []
        while True:
            free = [i for i, lane in enumerate(self.lanes) if lane is None]
            if not self.pending or not free or (not self.continuous and self.busy_lanes):
                break
            job = self.pending.popleft()
            reuse = job.reuse_prefix and not job.prompt_logprobs
            pick = self.prefix_cache.pick(job.tokens, free, self.engine.lane_versions, reuse=reuse,
                                          adapter=job.lora_load)
            admissions.append(Admission(pick, self.prefix_cache.cached(pick.lane), job.tokens, job.lora_load, reuse))
            self.prefix_cache.take(pick.lane)
            draft = self.speculation.draft_length() if self.speculation else None
            self.lanes[pick.lane] = Lane(job=job, admitted_at=now, draft=draft)
            self.prefill_order.append(pick.lane)
        self.metrics.queue_depth.set(len(self.pending))
        self.metrics.busy_lanes.set(self.busy_lanes)
        return admissions

    def _admit(self, admissions: list[Admission]) -> None:
        """Start each admitted lane at the prompt tokens it reuses (`PrefixTier.admit`: a failed copy costs reuse)."""
        for a in admissions:
            lane = self.lanes[a.pick.lane]
            lane.fed = self.prefix_tier.admit(a)
            lane.job.cached_tokens = lane.fed
            self.activity.looked_up(a.reuse, lane.fed)

    def schedule(self, ending: dict[int, str] | None = None) -> Plan:
        """Retire the `ending` lanes (lane -> "cancel" or "stop"); pick this turn's prefill chunk and decode rows."""
        for i, how in (ending or {}).items():
            if how == "cancel":
                self._fail_job(self._free(i).job, Cancelled("the request was cancelled"), "cancelled")
            else:
                self._retire(i, "stop")
        prefill_lane, prefill_mask = self._chunked_prefill()
        rows = self._decode_rows()
        decoding = sum(r is not None for r in rows)
        pieces = self._pieces(self.engine.turn_rows(decoding) - decoding) if self.engine.prefill_budget else []
        if not pieces and self.speculation is not None:
            cap = self.speculation.verify_cap(decoding, self.engine.wave_widths, self.engine.verify_rows)
            draft_rows(self.lanes, rows, cap, self.speculation.proposer)
        return Plan(prefill_lane, rows, prefill_mask, pieces)

    def _chunked_prefill(self) -> tuple[int | None, np.ndarray | None]:
        """(the lane whose next prompt chunk this turn prefills, its constraint's mask where that chunk is its last
        and samples the first token): the oldest prefilling lane that takes chunks (any, on an engine that does not
        pack; one that scores its prompt, on one that does), past any that its constraint fails."""
        packs = self.engine.prefill_budget > 0
        while chunked := [i for i in self.prefill_order if not packs or self.lanes[i].scores]:
            lane = self.lanes[chunked[0]]
            if lane.fed + self.engine.chunk < len(lane.job.tokens):
                return chunked[0], None
            ok, mask = self._mask(chunked[0])  # a failed lane leaves `prefill_order`
            if ok:
                return chunked[0], mask
        return None, None

    def _decode_rows(self) -> list[DecodeRow | None]:
        """This turn's decode row of every lane past its prompt (None elsewhere), with its constraint's mask."""
        rows: list[DecodeRow | None] = [None] * len(self.lanes)
        for i, lane in enumerate(self.lanes):
            if lane is None or lane.prefilling:
                continue
            ok, mask = self._mask(i)
            if ok:
                rows[i] = lane.decode_row(mask)
        return rows

    def _pieces(self, budget: int) -> list[PromptPiece]:
        """This turn's packed-step prompt pieces (`prompt_pieces`); one that ends its prompt carries its mask."""
        pieces = []
        for piece in prompt_pieces(self.lanes, [i for i in self.prefill_order if not self.lanes[i].scores],
                                   self.engine.chunk, budget):
            ok, mask = self._mask(piece.lane) if piece.last else (True, None)
            if ok:
                pieces.append(dataclasses.replace(piece, mask=mask))
        return pieces

    def _mask(self, i: int) -> tuple[bool, np.ndarray | None]:
        """(whether lane i goes on, `Lane.next_mask`). A job its constraint leaves without a token fails here."""
        try:
            return True, self.lanes[i].next_mask()
        except ConstraintFailed as e:
            self._fail(i, e)
            return False, None

    def _execute(self, plan: Plan) -> None:
        """Run the plan's steps and fold their samples into the lanes' requests."""
        if plan.prefill_lane is not None:
            self._prefill_chunk(plan.prefill_lane, plan.prefill_mask)
        if plan.pieces:
            samples = self._pack(plan)
        elif any(row is not None and row.drafts for row in plan.decode_rows):
            return self._verified(plan.decode_rows, self._step("verify", lambda: self.engine.verify(plan.decode_rows)))
        elif any(row is not None for row in plan.decode_rows):
            samples, _ = self._step("decode", lambda: self.engine.decode(plan.decode_rows))
        else:
            return
        for i, sample in enumerate(samples):
            if sample is not None:
                self.postprocess(i, sample)

    def _step(self, kind: str, run: Callable[[], T]) -> T:
        """Run one engine step, timed on the step metric and counted as a wave."""
        t0 = time.perf_counter()
        out = run()
        self.metrics.step.labels(kind).observe(time.perf_counter() - t0)
        self.waves += 1
        return out

    def _begin(self, i: int) -> None:
        """Before a job's first prefill chunk or piece: the engine sets up its lane's token state."""
        lane = self.lanes[i]
        if lane.fed == lane.job.cached_tokens:
            self.engine.begin(i, lane.job.tokens, lane.job.sampling, lane.job.stop_ids, lane.job.lora)

    def _prefill_chunk(self, i: int, mask: np.ndarray | None) -> None:
        """Prefill lane i's next chunk; the last one samples the first token (or, for a scored prompt on a packing
        engine, sends the prompt back to be prefilled again in packed steps)."""
        lane = self.lanes[i]
        job = lane.job
        self._begin(i)
        if job.prompt_logprobs:
            sample, scored = self._step("prefill", lambda: self.engine.prefill_scored(i, job.tokens, lane.fed,
                                                                                      job.sampling, mask))
            lane.scored.extend(scored)
        else:
            sample, _ = self._step("prefill", lambda: self.engine.prefill(i, job.tokens, lane.fed, job.sampling,
                                                                          mask=mask))
        lane.fed = min(lane.fed + self.engine.chunk, len(job.tokens))
        self.prefix_tier.prefill_passed(i, job, lane.fed)
        if sample is None:
            return
        self.activity.prefilled(len(job.tokens) - job.cached_tokens)
        if job.max_new_tokens == 0:  # scoring only
            self._retire(i, "length")
        elif self.engine.prefill_budget:  # generate from a packed prefill, as the same request unscored does
            lane.fed = 0
            lane.repacked = True
        else:
            self.prefill_order.remove(i)
            self.postprocess(i, sample)

    def _pack(self, plan: Plan) -> list[Sample | None]:
        """Run the plan's prompt pieces and decode rows as one packed step; advance each piece's lane."""
        for p in plan.pieces:
            self._begin(p.lane)
        samples = self._step("pack", lambda: self.engine.pack(plan.pieces, plan.decode_rows))
        for p in plan.pieces:
            lane = self.lanes[p.lane]
            lane.fed += p.length
            self.prefix_tier.prefill_passed(p.lane, lane.job, lane.fed)
            if p.last:
                self.prefill_order.remove(p.lane)
                if not lane.repacked:  # a scored prompt was counted when it was scored
                    self.activity.prefilled(len(lane.job.tokens) - lane.job.cached_tokens)
        return samples

    def _verified(self, rows: list[DecodeRow | None], runs: list[list[Sample] | None]) -> None:
        """Fold a verify step into its lanes: each row's drafts stand while they equal the samples (`accept`), and
        the tokens go through `postprocess` one by one until the request ends."""
        for i, (row, samples) in enumerate(zip(rows, runs, strict=True)):
            if row is None:
                continue
            lane = self.lanes[i]
            tokens = accept(row.drafts, [s.token for s in samples])
            if row.drafts:
                lane.draft.update(len(row.drafts), len(tokens) - 1)
                self.metrics.count_drafts(len(row.drafts), len(tokens) - 1)
            for sample in samples[:len(tokens)]:
                if self.lanes[i] is not lane:  # it ended (a stop id, max_new_tokens, its constraint)
                    break
                self.postprocess(i, sample)

    def postprocess(self, i: int, sample: Sample) -> None:
        """Fold a lane's new token into its request; retire the request when it is done."""
        lane = self.lanes[i]
        job = lane.job
        now = time.perf_counter()
        if sample.token in job.stop_ids:
            lane.stop_sample = sample
            return self._retire(i, "stop")
        lane.samples.append(sample)
        if lane.first_token_at is None:
            lane.first_token_at = now
            self.metrics.ttft.observe(now - job.submitted_at)
        else:
            self.metrics.itl.observe(now - lane.last_token_at)
        lane.last_token_at = now
        self.activity.generated()
        if job.on_token is not None:
            try:
                job.on_token(sample)
            except Exception:  # a broken consumer cancels its own job, never the wave
                log.exception("on_token callback failed; cancelling the job")
                self.cancel(job)
        if job.constraint is not None:
            try:
                job.constraint.advance(sample.token)
            except ConstraintFailed as e:
                return self._fail(i, e)
            if job.constraint.finished:  # the grammar is complete: the output ends here
                return self._retire(i, "stop")
        ends_sentence = sample.token in self.terminal_ids and len(lane.samples) >= job.sampling.min_tokens
        if job.stop_at_sentence_end and ends_sentence:
            self._retire(i, "sentence_end")
        elif len(lane.samples) >= job.max_new_tokens:
            self._retire(i, "length")

    def _retire(self, i: int, reason: str) -> None:
        lane = self._free(i)
        self.metrics.requests.labels("ok").inc()
        answer(lane.job.future, lane.result(reason, time.perf_counter()))

    def _free(self, i: int) -> Lane:
        """Free lane i; its prefill-written KV stays behind for reuse (not a scored prefill's: another program)."""
        with self.cond:
            lane = self.lanes[i]
            self.lanes[i] = None
            self.metrics.busy_lanes.set(self.busy_lanes)
        if i in self.prefill_order:
            self.prefill_order.remove(i)
        kept = [] if lane.job.prompt_logprobs else lane.job.tokens[:lane.fed]
        self.prefix_cache.store(i, kept, self.engine.lane_versions[i], self.engine.reuse_floor(i), lane.job.lora_load)
        return lane

    def _fail(self, i: int, error: Exception) -> None:
        """Free lane i and fail its job with `error`."""
        self._fail_job(self._free(i).job, error)

    def _fail_lanes(self, error: Exception) -> None:
        for i in [i for i, lane in enumerate(self.lanes) if lane is not None]:
            self._fail(i, error)

    def _fail_all(self, error: Exception) -> None:
        """Fail every job and answer every reset request: the decode thread has ended (or is stuck past a drain's
        deadline), so this thread takes over its state."""
        with self.cond:
            self._fail_lanes(error)
            self._fail_pending(error)
            self._reset_prefixes()

