"""Many requests on one in-process station, with no HTTP: each a `RunRequest` as the OpenAI routes build it, started
as the routes start theirs (`chat.stream.start_run`) and run to its end as a whole reply is (`Run.next`), as many at
once as keep the lanes busy and the queue within its bound (continuous batching does the rest), each outcome handed
back as it ends. A progress bar counts requests, and prompt and generated tokens, a second.

Everything here runs on one asyncio event loop (`run_all`'s), as a route's request does on the server's."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

from tqdm.auto import tqdm

from jaxstation.chat.request import RunRequest
from jaxstation.chat.run import Run
from jaxstation.chat.stream import start_run
from jaxstation.server.outcomes import OUTCOMES
from jaxstation.server.station import Station


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one request ended: its run (None if it never started), and the error that ended it (None: it finished)."""

    key: Any
    run: Run | None
    error: Exception | None


Item = tuple[Any, RunRequest | Exception]  # a request to run under the caller's key, or the error that refused it


class Progress:
    """A progress bar of requests (`enabled`), with the prompt and generated tokens a second; the counts are kept
    either way."""

    def __init__(self, total: int | None, enabled: bool, desc: str) -> None:
        self.bar = tqdm(total=total, desc=desc, unit="req", disable=not enabled, dynamic_ncols=True)
        self.start = time.perf_counter()
        self.prompt_tokens = self.generated_tokens = 0

    def count(self, run: Run | None) -> None:
        if run is not None:
            counts = run.counts()
            self.prompt_tokens += counts.prompt
            self.generated_tokens += counts.generated
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"in {self.prompt_tokens / elapsed:.0f} tok/s, out "
                                 f"{self.generated_tokens / elapsed:.0f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


async def run_all(station: Station, items: Iterable[Item], on_outcome: Callable[[Outcome], None], progress: Progress,
                  stop: asyncio.Event | None = None) -> bool:
    """Run `items` on `station`, calling `on_outcome` with each as it ends (a refused item's at once, in order). At
    most `max_queue` jobs are in flight, so the queue never refuses one. With `stop` set, no further item starts and
    the runs in flight are cancelled, their outcomes dropped. Returns False if stopped."""
    limit = station.config.max_queue
    running: dict[asyncio.Task, int] = {}  # each run's task -> its jobs
    items = iter(items)
    waiting: Item | None = None
    stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        while True:
            while not (stopped and stopped.done()):
                waiting = waiting or next(items, None)
                if waiting is None:
                    break
                key, req = waiting
                if isinstance(req, Exception):
                    waiting = None
                    on_outcome(Outcome(key, None, req))
                    progress.count(None)
                    continue
                jobs = len(req.prompts) * req.n
                if running and sum(running.values()) + jobs > limit:
                    break
                waiting = None
                running[asyncio.ensure_future(_one(station, key, req))] = jobs
            if not running or (stopped and stopped.done()):
                return not (stopped and stopped.done())
            done, _ = await asyncio.wait([*running, *([stopped] if stopped else [])],
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopped}:
                del running[task]
                outcome = task.result()
                on_outcome(outcome)
                progress.count(outcome.run)
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if stopped is not None:
            stopped.cancel()


async def _one(station: Station, key: Any, req: RunRequest) -> Outcome:
    """Start `req` and wait for its whole reply, then for its jobs to leave their lanes (a choice a stop string ended
    leaves within one wave)."""
    run = None
    try:
        run = await start_run(station, req)
        while not run.done:
            await run.next()
    except OUTCOMES as e:
        if run is not None:
            run.cancel_all()
        return Outcome(key, run, e)
    except asyncio.CancelledError:
        if run is not None:
            run.cancel_all()
        raise
    await asyncio.gather(*(asyncio.wrap_future(c.job.future) for c in run.choices), return_exceptions=True)
    return Outcome(key, run, None)
