"""The scheduler: one decode thread owns the engine and runs continuous batching over its lanes.

Threads. Request handlers (any thread, e.g. the server's event loop) call `submit`, which appends a Job to a bounded
pending queue under a condition variable and returns a Future. The one decode thread is the only caller of the
engine. Each turn of its loop it `schedule()`s: retires cancelled or early-finished lanes, fills free lanes from the
queue, picks the prompt work (below) and the decode rows of every lane past its prompt. It runs them, then
`postprocess()`es the samples: a lane's token joins its request, which retires on a
stop id, `terminal_prosody`, `max_new_tokens`, `finish_early` (a host matched a stop string) or cancellation; its
Future is answered and the lane is free for the next fill. Before a job's first prefill chunk the engine `begin`s
its lane (the token state its penalties, logit bias and min_tokens read). A job generates at least
`sampling.min_tokens` tokens before a stop id (held back on the device) or `terminal_prosody` ends it.
A constrained job (engine/constraints.py) gets its mask computed here before each step that samples for it, and its
grammar takes each token after: a complete grammar retires it ("stop"); one that leaves no token fails it alone.
With no live lane and nothing pending the thread waits on the condition variable: no polling.

Backpressure. The queue holds at most `max_queue` jobs; `submit` past that raises QueueFull (the server answers 503
with Retry-After) instead of letting latency grow without bound. Once `drain` starts, `submit` raises ShuttingDown.

Prefix reuse. A freed lane keeps its KV; `PrefixCache` (jaxstation/engine/prefix_cache.py) remembers the token ids its
prefill wrote. `_fill` gives a job the free lane with the longest reusable prefix (ties and victims least recently
used) and starts its prefill at the last chunk boundary at or below the match, so its tokens equal a fresh run's.

Admission. On an engine that packs (`prefill_budget` > 0), a turn's prompt work is pieces of every prefilling lane's
prompt under the turn's rows, less the decode rows: up to a chunk for each lane, oldest first, then the rest to the
oldest, so neither a long prompt nor a stream of short ones holds the other back. A turn without decode rows may fill
the whole budget; one with decode rows takes `Engine.turn_rows` (a packed step at most about twice their plain wave,
as timed at warm-up, and always room for a prompt row), so running lanes keep their pace while prompts enter. The
pieces and the decode rows run as one packed step (`Engine.pack`); a turn without pieces runs a decode wave.
Otherwise a turn prefills at most one chunk (the oldest prefilling lane's next one), then runs the decode wave. A job
that scores its prompt is always prefilled one chunk per turn.

Serialize-all (continuous=False). The same loop admits a job only when no lane is busy: one request holds the engine
for its whole prefill and decode, through the same compiled shapes.

Invariance. The engine's steps come from a fixed set of shapes and never mix rows (a narrow wave is one only where a
row computes alike at every width: the CPU kernels), and each request samples with its own seed and counter, so a
job's tokens are the same whichever lane it gets, whatever runs beside it, and in either mode.

Failure. An exception inside a step fails every job in a lane with StepFailed, rebuilds the arena, drops every
cached prefix and goes on; queued jobs are served next.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError

import numpy as np

from jaxstation.engine.constraints import ConstraintFailed
from jaxstation.engine.jobs import Cancelled, Job, QueueFull, Result, ShuttingDown, StepFailed
from jaxstation.engine.metrics import StationMetrics
from jaxstation.engine.prefix_cache import PrefixCache
from jaxstation.engine.rows import DecodeRow, PromptPiece, Sample
from jaxstation.engine.runner import Runner

log = logging.getLogger(__name__)


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

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.job.tokens)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One turn: at most one prefill chunk, prompt pieces for a packed step, and the decoding lanes' rows
    (constrained ones masked). With pieces, the decode rows ride in the packed step; without, they are a wave."""

    prefill_lane: int | None
    decode_rows: list[DecodeRow | None]
    prefill_mask: np.ndarray | None = None  # the prefill lane's constraint mask, when its chunk samples
    pieces: list[PromptPiece] = dataclasses.field(default_factory=list)


class Scheduler:
    def __init__(self, engine: Runner, *, continuous: bool, max_queue: int, terminal_ids: frozenset[int],
                 metrics: StationMetrics | None = None) -> None:
        self.engine = engine
        self.continuous = continuous
        self.max_queue = max_queue
        self.terminal_ids = terminal_ids
        self.metrics = metrics or StationMetrics()
        self.lanes: list[Lane | None] = [None] * engine.lanes
        self.pending: deque[Job] = deque()
        self.cond = threading.Condition()
        self.waves = 0  # loop turns that ran a step; flat while idle
        self.prefill_order: deque[int] = deque()  # lanes waiting for prefill, oldest first
        self.prefix_cache = PrefixCache(engine.lanes, engine.chunk)
        self._accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- called from request threads -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="jaxstation-decode", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def busy_lanes(self) -> int:
        return sum(lane is not None for lane in self.lanes)

    def submit(self, job: Job) -> Future:
        with self.cond:
            if not self._accepting:
                raise ShuttingDown("the station is shutting down")
            if len(self.pending) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} jobs waiting)")
            job.submitted_at = time.perf_counter()
            self.pending.append(job)
            self.metrics.queue_depth.set(len(self.pending))
            self.cond.notify()
        return job.future

    def cancel(self, job: Job) -> None:
        job.cancel()
        with self.cond:
            self.cond.notify()

    def finish_early(self, job: Job) -> None:
        """End a running job with finish_reason "stop" and what it has generated (e.g. a host matched a stop
        string); its lane is freed within one wave."""
        job.stop_requested = True
        with self.cond:
            self.cond.notify()

    def reset_prefix_cache(self) -> int:
        """Forget every free lane's cached prefix (vLLM's /reset_prefix_cache): the next requests prefill in full,
        as a cold station's do. Lanes in flight are untouched. Returns how many entries were dropped."""
        with self.cond:
            return self.prefix_cache.clear()

    def drain(self, timeout_s: float) -> bool:
        """Stop taking work, let queued and running jobs finish for up to timeout_s, fail the rest, stop the thread.

        Returns True if everything finished in time.
        """
        with self.cond:
            self._accepting = False
            self.cond.notify()
        deadline = time.monotonic() + timeout_s
        with self.cond:
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
                while not self._stop and not self.pending and not self.busy_lanes:
                    self.cond.wait()
                if self._stop:
                    self._fail_lanes(ShuttingDown("the station shut down before this request finished"))
                    return
                self._fill()
            plan = self.schedule()
            try:
                self._execute(plan)
            except Exception as e:  # a failed step: fail the lanes in flight, rebuild, keep serving
                log.exception("step failed")
                self._fail_lanes(StepFailed(f"step failed: {type(e).__name__}: {e}", getattr(e, "http_status", 500)))
                self.engine.reset()
                self.prefix_cache.clear()
            with self.cond:
                self.cond.notify_all()  # wake a drain waiting for the last job

    def _fill(self) -> None:
        """Move pending jobs into free lanes (in serialize-all mode only when every lane is free), each into the
        lane with the longest reusable prefix. Holds cond."""
        now = time.perf_counter()
        while True:
            while self.pending and self.pending[0].cancelled:  # a cancelled job never takes (or skips) a lane
                self._finish_cancelled(self.pending.popleft())
            free = [i for i, lane in enumerate(self.lanes) if lane is None]
            if not self.pending or not free or (not self.continuous and self.busy_lanes):
                break
            job = self.pending.popleft()
            reuse = job.reuse_prefix and not job.prompt_logprobs
            pick = self.prefix_cache.pick(job.tokens, free, self.engine.lane_versions, reuse=reuse)
            self.prefix_cache.take(pick.lane)
            if reuse:
                m = self.metrics
                m.prefix_lookups.inc()
                if pick.hit:
                    m.prefix_hits.inc()
                    m.prefix_reused_tokens.inc(pick.matched)
                    m.prefix_saved_tokens.inc(pick.reused)
            job.cached_tokens = pick.reused
            self.lanes[pick.lane] = Lane(job=job, admitted_at=now, fed=pick.reused)
            self.prefill_order.append(pick.lane)
        self.metrics.queue_depth.set(len(self.pending))
        self.metrics.busy_lanes.set(self.busy_lanes)

    def schedule(self) -> Plan:
        """Retire cancelled and early-finished lanes, then pick this turn's prefill chunk and decode rows."""
        for i, lane in enumerate(self.lanes):
            if lane is None:
                continue
            if lane.job.cancelled or lane.job.future.cancelled():
                self._free(i)
                self._finish_cancelled(lane.job)
            elif lane.job.stop_requested:
                self._retire(i, "stop")
        packs = self.engine.prefill_budget > 0
        prefill_lane, prefill_mask = None, None
        while prefill_lane is None and (chunked := [i for i in self.prefill_order if not packs or self._scores(i)]):
            prefill_lane, lane = chunked[0], self.lanes[chunked[0]]
            if lane.fed + self.engine.chunk >= len(lane.job.tokens):  # its last chunk samples the first token
                ok, prefill_mask = self._mask(prefill_lane)
                prefill_lane = prefill_lane if ok else None
        rows: list[DecodeRow | None] = [None] * len(self.lanes)
        for i, lane in enumerate(self.lanes):
            if lane is not None and not lane.prefilling and (masked := self._mask(i))[0]:
                job, n = lane.job, len(lane.samples)
                rows[i] = DecodeRow(lane.samples[-1].token, len(job.tokens) + n - 1, job.sampling, n, masked[1])
        decoding = sum(r is not None for r in rows)
        pieces = self._pieces(self.engine.turn_rows(decoding) - decoding) if packs else []
        return Plan(prefill_lane, rows, prefill_mask, pieces)

    def _pieces(self, budget: int) -> list[PromptPiece]:
        """This turn's prompt pieces for a packed step, `budget` tokens in all: first up to a chunk for each
        prefilling lane, oldest first, so that no long prompt holds short ones back; then what is left of the budget
        to the oldest. A piece that ends its prompt carries the lane's constraint mask."""
        waiting = [i for i in self.prefill_order if not self._scores(i)]
        take = dict.fromkeys(waiting, 0)
        for share in (self.engine.chunk, None):
            for i in waiting:
                lane = self.lanes[i]
                n = min(len(lane.job.tokens) - lane.fed - take[i], budget, share or budget)
                take[i] += n
                budget -= n
        pieces = []
        for i, n in take.items():
            lane = self.lanes[i]
            if n == 0:
                continue
            ok, mask = self._mask(i) if lane.fed + n == len(lane.job.tokens) else (True, None)
            if ok:
                pieces.append(PromptPiece(i, lane.job.tokens, lane.fed, n, lane.job.sampling, mask))
        return pieces

    def _scores(self, i: int) -> bool:
        """Whether lane i's next prefill scores its prompt (one chunk per turn, never packed)."""
        return self.lanes[i].job.prompt_logprobs and not self.lanes[i].repacked

    def _mask(self, i: int) -> tuple[bool, np.ndarray | None]:
        """(whether lane i goes on, the constraint mask of its next token: `Constraint.next_mask`, None without a
        constraint). A job its constraint leaves without a token fails here."""
        lane = self.lanes[i]
        job = lane.job
        if job.constraint is None:
            return True, None
        try:
            return True, job.constraint.next_mask(len(lane.samples), job.sampling.min_tokens, job.stop_ids,
                                                  job.sampling.allowed_token_ids)
        except ConstraintFailed as e:
            self._fail(i, e)
            return False, None

    def _execute(self, plan: Plan) -> None:
        if plan.prefill_lane is not None:
            i = plan.prefill_lane
            lane = self.lanes[i]
            t0 = time.perf_counter()
            if lane.fed == lane.job.cached_tokens:  # the job's first chunk
                self.engine.begin(i, lane.job.tokens, lane.job.sampling, lane.job.stop_ids)
            if lane.job.prompt_logprobs:
                sample, scored = self.engine.prefill_scored(i, lane.job.tokens, lane.fed, lane.job.sampling,
                                                            plan.prefill_mask)
                lane.scored.extend(scored)
            else:
                sample, _ = self.engine.prefill(i, lane.job.tokens, lane.fed, lane.job.sampling,
                                                mask=plan.prefill_mask)
            self.metrics.step.labels("prefill").observe(time.perf_counter() - t0)
            self.waves += 1
            lane.fed = min(lane.fed + self.engine.chunk, len(lane.job.tokens))
            if sample is not None:
                self.metrics.prompt_tokens.inc(len(lane.job.tokens) - lane.job.cached_tokens)
                if lane.job.max_new_tokens == 0:  # scoring only
                    self._retire(i, "length")
                elif self.engine.prefill_budget:  # generate from a packed prefill, as the same request unscored does
                    lane.fed, lane.repacked = 0, True
                else:
                    self.prefill_order.remove(i)
                    self.postprocess(i, sample)
        if plan.pieces:
            t0 = time.perf_counter()
            for p in plan.pieces:
                lane = self.lanes[p.lane]
                if lane.fed == lane.job.cached_tokens:  # the job's first piece
                    self.engine.begin(p.lane, lane.job.tokens, lane.job.sampling, lane.job.stop_ids)
            samples = self.engine.pack(plan.pieces, plan.decode_rows)
            self.metrics.step.labels("pack").observe(time.perf_counter() - t0)
            self.waves += 1
            for p in plan.pieces:
                lane = self.lanes[p.lane]
                lane.fed += p.length
                if p.last:
                    self.prefill_order.remove(p.lane)
                    if not lane.repacked:  # a scored prompt was counted when it was scored
                        self.metrics.prompt_tokens.inc(len(lane.job.tokens) - lane.job.cached_tokens)
        elif any(row is not None for row in plan.decode_rows):
            t0 = time.perf_counter()
            samples, _ = self.engine.decode(plan.decode_rows)
            self.metrics.step.labels("decode").observe(time.perf_counter() - t0)
            self.waves += 1
        else:
            return
        for i, sample in enumerate(samples):
            if sample is not None:
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
        self.metrics.generated_tokens.inc()
        if job.on_token is not None:
            try:
                job.on_token(sample)
            except Exception:  # a broken consumer cancels its own job, never the wave
                log.exception("on_token callback failed; cancelling the job")
                job.cancel()
        if job.constraint is not None:
            try:
                job.constraint.advance(sample.token)
            except ConstraintFailed as e:
                return self._fail(i, e)
            if job.constraint.finished:  # the grammar is complete: the output ends here
                return self._retire(i, "stop")
        if job.terminal_prosody and sample.token in self.terminal_ids and len(lane.samples) >= job.sampling.min_tokens:
            self._retire(i, "terminal_prosody")
        elif len(lane.samples) >= job.max_new_tokens:
            self._retire(i, "length")

    def _retire(self, i: int, reason: str) -> None:
        lane = self._free(i)
        job, now = lane.job, time.perf_counter()
        timing = {
            "queue_s": lane.admitted_at - job.submitted_at,
            "ttft_s": (lane.first_token_at or now) - job.submitted_at,
            "total_s": now - job.submitted_at,
            "cached_tokens": job.cached_tokens,
        }
        self.metrics.requests.labels("ok").inc()
        try:
            job.future.set_result(Result([s.token for s in lane.samples], reason, len(job.tokens), lane.samples,
                                         timing, lane.scored, lane.stop_sample))
        except InvalidStateError:  # its caller cancelled the Future; that must not fail the wave
            pass

    def _free(self, i: int) -> Lane:
        """Free lane i; its prefill-written KV stays behind for reuse (not a scored prefill's: another program)."""
        lane = self.lanes[i]
        self.lanes[i] = None
        kept = [] if lane.job.prompt_logprobs else lane.job.tokens[:lane.fed]
        self.prefix_cache.store(i, kept, self.engine.lane_versions[i])
        if i in self.prefill_order:
            self.prefill_order.remove(i)
        self.metrics.busy_lanes.set(self.busy_lanes)
        return lane

    def _finish_cancelled(self, job: Job) -> None:
        self.metrics.requests.labels("cancelled").inc()
        if not job.future.done():
            job.future.set_exception(Cancelled("the request was cancelled"))

    def _fail(self, i: int, error: Exception) -> None:
        """Free lane i and fail its job with `error`."""
        lane = self._free(i)
        self.metrics.requests.labels("error").inc()
        if not lane.job.future.done():
            lane.job.future.set_exception(error)

    def _fail_lanes(self, error: Exception) -> None:
        for i, lane in enumerate(self.lanes):
            if lane is not None:
                self._fail(i, error)

    def _fail_pending(self, error: Exception) -> None:
        """Fail every queued job. Holds cond."""
        while self.pending:
            job = self.pending.popleft()
            self.metrics.requests.labels("error").inc()
            if not job.future.done():
                job.future.set_exception(error)
        self.metrics.queue_depth.set(0)

    def _fail_all(self, error: Exception) -> None:
        with self.cond:
            self._fail_lanes(error)
            self._fail_pending(error)
