"""What the station is doing, as its decode thread last saw it: each lane's state, the queue, tokens per second over
the last minutes and the prefix cache's hits, for a live view (`GET /station/status`, the chat page's panel).

The decode thread owns the engine, the lanes and the prefix cache, so only it can say what they hold. After a turn it
builds an immutable `Snapshot` and publishes it by replacing one attribute (`Activity.snapshot`), at most every
`PUBLISH_S` while it works and always before it idles; a request thread reads that attribute and nothing else. A
reader never takes the scheduler's lock or calls into the engine, however often it polls.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Literal

from jaxstation.engine.metrics import StationMetrics
from jaxstation.engine.prefix_cache import LanePrefix, PrefixCache
from jaxstation.engine.turns import Lane

BUCKET_S = 5  # seconds per throughput bucket
BUCKETS = 60  # buckets kept: the last five minutes
PUBLISH_S = 0.25  # while busy, a new snapshot at most this often

LaneKind = Literal["free", "cached", "prefilling", "decoding"]


@dataclasses.dataclass(frozen=True)
class LaneView:
    """One lane: free, free and holding a cached prefix of `prompt_tokens`, or running a request of `prompt_tokens`
    that has `fed` of them in the arena and has generated `generated` tokens."""

    state: LaneKind
    prompt_tokens: int = 0
    fed: int = 0
    generated: int = 0


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The station at `at` (Unix time); the counts run from the scheduler's start. `buckets`: (bucket number on the
    monotonic clock, tokens generated, tokens prefilled) of the buckets of `BUCKET_S` seconds that saw any, the last
    `BUCKETS` of them."""

    at: float
    lanes: tuple[LaneView, ...]
    queued: int
    generated_tokens: int
    prefilled_tokens: int
    prefix_lookups: int
    prefix_hits: int
    prefix_reused_tokens: int
    buckets: tuple[tuple[int, int, int], ...]

    def rates(self, now: float) -> tuple[list[float], list[float]]:
        """Tokens generated and prefilled per second in each of the last `BUCKETS` complete buckets before `now` (the
        monotonic clock), oldest first: a station idle since this snapshot reads as zeros."""
        current = int(now // BUCKET_S)
        kept = {number: (g, p) for number, g, p in self.buckets}
        window = [kept.get(n, (0, 0)) for n in range(current - BUCKETS, current)]
        return [g / BUCKET_S for g, _ in window], [p / BUCKET_S for _, p in window]


class Activity:
    """The decode thread's counts for the live view, and the last `Snapshot` it published (read by any thread).

    `generated` and `prefilled` count on the station's Prometheus metrics too, so the scheduler counts each token once.
    """

    def __init__(self, lanes: int, metrics: StationMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics, self.clock = metrics, clock
        self._buckets: collections.deque[tuple[int, int, int]] = collections.deque()
        self.generated_tokens = self.prefilled_tokens = 0
        self.lookups = self.hits = self.reused_tokens = 0
        self._new_generated = self._new_prefilled = 0  # counted since the last turn, not yet in a bucket
        self._published = -PUBLISH_S
        self.snapshot = self._build([None] * lanes, 0, None)

    def generated(self) -> None:
        """A request generated one token."""
        self.metrics.generated_tokens.inc()
        self.generated_tokens += 1
        self._new_generated += 1

    def prefilled(self, tokens: int) -> None:
        """A request's prompt is in its lane: `tokens` of it prefilled (the rest was reused)."""
        self.metrics.prompt_tokens.inc(tokens)
        self.prefilled_tokens += tokens
        self._new_prefilled += tokens

    def looked_up(self, reuse: bool, reused: int) -> None:
        """A request took a lane; if it may `reuse` a cached prefix, it looked for one and starts on `reused` tokens of
        it (0: a miss)."""
        if not reuse:
            return
        self.lookups += 1
        self.hits += reused > 0
        self.reused_tokens += reused

    def publish(self, lanes: Sequence[Lane | None], queued: int, cache: PrefixCache) -> None:
        """Publish a snapshot of `lanes` (the scheduler's), `queued` jobs and `cache`'s entries, if `PUBLISH_S` has
        passed since the last or the station goes idle (no job queued or in a lane). Called by the decode thread
        after each turn."""
        now = self.clock()
        self._bucket(now)
        if now - self._published >= PUBLISH_S or not (queued or any(lanes)):
            self._published = now
            self.snapshot = self._build(lanes, queued, cache)

    def _bucket(self, now: float) -> None:
        """Add the tokens counted since the last call to the bucket of `now`; drop the buckets out of the window."""
        number, generated, prefilled = int(now // BUCKET_S), self._new_generated, self._new_prefilled
        self._new_generated = self._new_prefilled = 0
        if not generated and not prefilled:
            return
        if self._buckets and self._buckets[-1][0] == number:
            _, g, p = self._buckets.pop()
            generated, prefilled = generated + g, prefilled + p
        self._buckets.append((number, generated, prefilled))
        while self._buckets[0][0] < number - BUCKETS:
            self._buckets.popleft()

    def _build(self, lanes: Sequence[Lane | None], queued: int, cache: PrefixCache | None) -> Snapshot:
        views = tuple(_view(lane, cache.cached(i) if cache is not None and lane is None else None)
                      for i, lane in enumerate(lanes))
        return Snapshot(time.time(), views, queued, self.generated_tokens, self.prefilled_tokens, self.lookups,
                        self.hits, self.reused_tokens, tuple(self._buckets))


def _view(lane: Lane | None, cached: LanePrefix | None) -> LaneView:
    if lane is None:
        return LaneView("cached", len(cached.tokens)) if cached else LaneView("free")
    kind: LaneKind = "prefilling" if lane.prefilling else "decoding"
    return LaneView(kind, len(lane.job.tokens), lane.fed, len(lane.samples))
