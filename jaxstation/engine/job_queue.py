"""The scheduler's queue and what request threads call of it: `submit`, `cancel`, `finish_early` and the lanes' count.

Request handlers run on any thread (the server's event loop, worker threads); the decode thread (engine/scheduler.py)
takes jobs from the queue into its lanes. What both touch is guarded by `cond`, a re-entrant lock and its condition:
the pending queue, whether it accepts work, the stop flag, the queued prefix-cache resets, each job's `cancelled` and
`stop_requested`, and which lanes are busy (`lanes` is written by the decode thread under the lock). Past `max_queue`
queued jobs `submit` raises QueueFull (a 503 with Retry-After); once a drain starts, ShuttingDown.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future

from jaxstation.engine.jobs import Cancelled, Job, QueueFull, ShuttingDown, answer
from jaxstation.engine.metrics import StationMetrics
from jaxstation.engine.turns import Lane


class JobQueue:
    """Jobs waiting for one of `lanes` lanes, at most `max_queue` of them, counted on `metrics`."""

    def __init__(self, lanes: int, max_queue: int, metrics: StationMetrics) -> None:
        self.max_queue = max_queue
        self.metrics = metrics
        self.cond = threading.Condition()  # re-entrant; it guards what the module's docstring lists
        self.lanes: list[Lane | None] = [None] * lanes  # written under cond
        self.pending: deque[Job] = deque()
        self._prefix_resets: list[Future] = []  # reset_prefix_cache requests for the next turn
        self._accepting = True
        self._stop = False

    @property
    def busy_lanes(self) -> int:
        with self.cond:
            return sum(lane is not None for lane in self.lanes)

    def lora_slots(self) -> set[int]:
        """The LoRA slots that queued and running jobs read."""
        with self.cond:
            return {job.lora for job in self.pending} | {lane.job.lora for lane in self.lanes if lane is not None}

    @property
    def accepting(self) -> bool:
        """Whether `submit` takes new jobs (False once a drain starts)."""
        with self.cond:
            return self._accepting

    def submit(self, job: Job) -> Future:
        """Queue `job`; its Future answers its Result (or the error that ended it)."""
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
        """Drop `job`: a queued job leaves the queue at once, failed with Cancelled; a running one frees its lane."""
        with self.cond:
            job.cancelled = True
            if any(waiting is job for waiting in self.pending):
                self.pending = deque(waiting for waiting in self.pending if waiting is not job)
                self._fail_job(job, Cancelled("the request was cancelled"), "cancelled")
            self.metrics.queue_depth.set(len(self.pending))
            self.cond.notify()

    def finish_early(self, job: Job) -> None:
        """End a running job with finish_reason "stop" and what it has generated (e.g. a host matched a stop
        string); its lane is freed within one wave."""
        with self.cond:
            job.stop_requested = True
            self.cond.notify()

    def _fail_job(self, job: Job, error: Exception, outcome: str = "error") -> None:
        """Answer `job` with `error`, counted under `outcome`."""
        self.metrics.requests.labels(outcome).inc()
        answer(job.future, error=error)

    def _fail_pending(self, error: Exception) -> None:
        """Fail every queued job. Holds cond."""
        while self.pending:
            self._fail_job(self.pending.popleft(), error)
        self.metrics.queue_depth.set(0)
