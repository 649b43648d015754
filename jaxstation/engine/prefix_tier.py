"""The prefix cache's host-memory tier: prefill-written KV kept after its lane is taken by another request.

Just before a request overwrites a free lane's cached prefix, `PrefixTier.admit` copies the lane's KV at [0, n) (n its
tokens rounded down to a chunk) into host memory, the arena's own bits. A request whose prompt an entry matches
further than any free lane has the entry written into its lane and restarts its prefill at the entry's restart point
at or below the match, so its tokens are a fresh run's (docs/prefix-reuse.md). With rings an entry's restart points
are the window copies of engine/prefix_windows.py. A disk tier (engine/prefix_disk.py) may lie under it; whether each
tier is on is decided here, once (`tier_refusal`).

The decode thread owns the tier and calls it inside its step, once the request holds its lane: a failed save keeps
nothing, a failed restore drops its entry and the request prefills afresh, anything else fails the step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from jaxstation.engine.arena import KVBuffers
from jaxstation.engine.jobs import Job
from jaxstation.engine.metrics import StationMetrics
from jaxstation.engine.prefix_cache import LanePrefix, Pick, PrefixCache, chunk_floor
from jaxstation.engine.prefix_disk import DiskTier
from jaxstation.engine.prefix_entries import Found, PrefixIndex, TierEntry, Windows, merge_windows, restart_points
from jaxstation.engine.prefix_windows import WindowCopies
from jaxstation.engine.rules import tier_refusal
from jaxstation.engine.runner import Runner

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Admission:
    """A request taking a lane (`Scheduler._fill`): the pick, the lane's cached prefix just before
    (`PrefixCache.cached`), the request's prompt and LoRA adapter load, and whether it may reuse a prefix."""

    pick: Pick
    cached: LanePrefix | None
    prompt: Sequence[int]
    adapter: int
    reuse: bool


class HostTier(PrefixIndex[TierEntry]):
    """The host tier's entries, least recently used first, holding at most `capacity` bytes."""

    def __init__(self, capacity: int, chunk: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.chunk = chunk
        self.nbytes = 0
        self.evictions = 0

    def drop(self, entry: TierEntry) -> None:
        """Forget the entry of `entry`'s tokens and adapter (if still held)."""
        if (gone := self.remove(entry)) is not None:
            self.nbytes -= gone.nbytes

    def restarts_under(self, tokens: tuple[int, ...], adapter: int) -> Windows:
        """With rings, the restart points and windows of the entries of `adapter` that `tokens` extends."""
        return merge_windows(*(e.windows for e in self.under(tokens, adapter)))

    def put(self, entry: TierEntry) -> int:
        """Keep `entry` as the most recent, dropping the entries it covers (with rings, it takes over their restart
        points), then the least recently used while the bytes exceed the capacity; an entry larger than the capacity
        is not kept. Returns the evictions."""
        if entry.windows is not None:
            entry = dataclasses.replace(entry, windows=merge_windows(self.restarts_under(entry.tokens, entry.adapter),
                                                                     entry.windows))
        if entry.nbytes > self.capacity:
            return 0
        for covered in self.covered_by(entry):
            self.drop(covered)
        self.add(entry)
        self.nbytes += entry.nbytes
        evicted = 0
        while self.nbytes > self.capacity:
            self.nbytes -= self.oldest().nbytes
            evicted += 1
        self.evictions += evicted
        return evicted

    def clear(self) -> int:
        """Drop every entry; returns how many there were."""
        self.nbytes = 0
        return super().clear()


def _reach(found: Found | None) -> int:
    """The prompt tokens `found` restarts past (0: nothing found)."""
    return 0 if found is None else found.reused


class PrefixTier:
    """The scheduler's host tier over `engine`'s lanes and their `cache`, `capacity` bytes (0: off), over the disk tier
    `open_disk` opens (None: none). The decode thread owns it; `close` stops the disk tier's writer."""

    def __init__(self, engine: Runner, cache: PrefixCache, capacity: int, metrics: StationMetrics,
                 open_disk: Callable[[], DiskTier] | None = None) -> None:
        refusal = tier_refusal(engine) if capacity or open_disk is not None else None
        if capacity and refusal:
            log.info("prefix cache in host memory: off, since %s", refusal)
            capacity = 0
        self.engine = engine
        self.cache = cache
        self.metrics = metrics
        self.host = HostTier(capacity, engine.chunk)
        self.disk = self._open_disk(open_disk, refusal)
        rings = bool(capacity) and engine.arena.rings is not None
        self.windows = WindowCopies(engine, capacity) if rings else None

    def _open_disk(self, open_disk: Callable[[], DiskTier] | None, refusal: str | None) -> DiskTier | None:
        """The disk tier, where one is asked for, the host tier is on (else logged off, and never opened) and its
        directory is usable (else `DiskTier` logs why not)."""
        if open_disk is None:
            return None
        if not self.host.capacity:
            log.info("prefix cache on disk: off, since %s", refusal or "the host memory tier is off")
            return None
        disk = open_disk()
        if not disk.on:
            return None
        disk.attach(self.metrics)
        return disk

    def prefill_passed(self, lane: int, job: Job, position: int) -> None:
        """`lane`'s prefill of `job`'s prompt reached `position`: with rings, copy the windows it passed
        (`WindowCopies.prefill_passed`)."""
        if self.windows is not None:
            self.windows.prefill_passed(lane, job, position)

    def admit(self, a: Admission) -> int:
        """A request of `a.prompt` takes `a.pick.lane`: keep the lane's cached prefix in the tier if the request will
        overwrite it, and restore the tier's furthest restart point into the lane where it reaches past `pick.reused`
        (with rings, a free lane's window copies count: `_keep_free_lane`). Returns the prompt tokens the request
        reuses (prefill restarts there), counted on the metrics when `a.reuse`."""
        pick = a.pick
        if not self.host.capacity:
            if a.reuse:
                self.metrics.count_prefix_lookup(pick.matched, pick.reused, "lane")
            return pick.reused
        found, tier = self._lookup(a) if a.reuse else (None, "memory")
        restore = found is not None and found.reused > pick.reused
        if restore:
            self.host.used(found.entry)  # before the spill, which may evict the least recently used
        kept = self._spill(pick.lane, a.cached, 0 if restore else pick.reused)
        if restore and not self._restore(pick.lane, found.entry, found.reused):
            pick = Pick(pick.lane, 0, 0)  # a fresh prefill: the lane may hold part of the entry
            restore = False
        start = found.reused if restore else pick.reused
        if self.windows is not None:
            self.windows.begin(pick.lane, a.prompt, a.adapter, start, kept)
        if a.reuse and restore:
            self.metrics.count_prefix_lookup(found.matched, found.reused, tier)
        elif a.reuse:
            self.metrics.count_prefix_lookup(pick.matched, pick.reused, "lane")
        return start

    def _lookup(self, a: Admission) -> tuple[Found[TierEntry] | None, str]:
        """(the entry that restarts `a.prompt` furthest, in memory or loaded from disk, and the tier it came from)."""
        found = self.host.find(a.prompt, a.adapter, self.host.chunk)
        if self.windows is not None and self._keep_free_lane(a, max(_reach(found), a.pick.reused)):
            found = self.host.find(a.prompt, a.adapter, self.host.chunk)
        if self.disk is not None and (loaded := self._from_disk(a, max(_reach(found), a.pick.reused))):
            return loaded, "disk"
        return found, "memory"

    def _from_disk(self, a: Admission, must_exceed: int) -> Found[TierEntry] | None:
        """The disk tier's entry for `a.prompt`, now in memory too, where it restarts past `must_exceed` tokens; None
        otherwise, or where its file failed to load (logged)."""
        found = self.disk.find(a.prompt, a.adapter, self.host.chunk)
        if found is None or found.reused <= must_exceed:
            return None
        t0 = time.perf_counter()
        entry = self.disk.load(found.entry)
        if entry is None:
            return None
        self.metrics.prefix_disk_load.observe(time.perf_counter() - t0)
        self.metrics.prefix_tier_evictions.inc(self.host.put(entry))
        self._gauges()
        return Found(entry, found.matched, found.reused)

    def persist(self) -> None:
        """Queue the free lanes' cached prefixes (of the base model) for the disk tier, as at a clean stop. With
        rings, only a prefix whose windows its prompt's prefill copied, with the restart points of the entries in
        memory it extends."""
        if self.disk is None:
            return
        for prefix in self.cache.held(self.engine.lane_versions):
            n = chunk_floor(len(prefix.tokens), self.host.chunk)
            try:  # a failed save costs that lane's file, never the stop
                self._persist_lane(prefix.lane, prefix.tokens[:n], prefix.adapter)
            except Exception as e:
                log.warning("prefix cache on disk: saving lane %d's %d tokens failed (%s: %s)", prefix.lane, n,
                            type(e).__name__, e)

    def _persist_lane(self, lane: int, tokens: tuple[int, ...], adapter: int) -> None:
        """Queue `lane`'s prefix of `tokens` for the disk tier, unless it is a LoRA load's or a file holds it."""
        if adapter or not tokens:
            return
        windows = None
        if self.windows is not None:
            if not (points := self.windows.points(lane, tokens, adapter)):
                return
            tokens = tokens[:max(points)]
            windows = merge_windows(self.host.restarts_under(tokens, adapter), points)
        if not self.disk.covers(tokens, adapter, restart_points(windows)):
            self.disk.put(TierEntry(tokens, adapter, self.engine.save_prefix(lane, len(tokens)), windows))

    def close(self) -> None:
        """Write what the disk tier has queued and stop its writer."""
        if self.disk is not None:
            self.disk.close()

    def _spill(self, lane: int, cached: LanePrefix | None, kept: int) -> dict[int, KVBuffers]:
        """Copy `lane`'s `cached` prefix into the tier (`_keep`), unless the request taking it keeps all of it (`kept`
        tokens). Returns the lane's window copies at or below `kept`, which the request taking the lane keeps."""
        tokens = cached.tokens[:chunk_floor(len(cached.tokens), self.host.chunk)] if cached else ()
        adapter = cached.adapter if cached else 0
        points = self.windows.take(lane, tokens, adapter) if self.windows is not None else {}
        if len(tokens) > kept:
            self._keep(lane, tokens, adapter, points)
        return {n: w for n, w in points.items() if n <= kept}

    def _keep(self, lane: int, tokens: tuple[int, ...], adapter: int, points: dict[int, KVBuffers]) -> bool:
        """Copy `lane`'s prefix of `tokens` (a whole number of chunks) of `adapter` into the tier, unless it holds it
        already. With rings, only with the window copies `points` of the lane's prompt, as the entry's restart points,
        cut at the furthest; an entry that holds the tokens but not all those restart points gains them. A failed copy
        keeps nothing. Whether the tier gained anything."""
        if self.windows is not None:
            if not points:
                return False  # no window before any of its chunk boundaries was copied: no restart point
            tokens = tokens[:max(points)]
            if (cover := self.host.covering(tokens, adapter)) is not None:
                if new := {n: w for n, w in points.items() if n not in cover.restarts}:
                    self._put(dataclasses.replace(cover, windows=merge_windows(cover.windows, new)))
                return bool(new)
        elif self.host.covering(tokens, adapter) is not None:
            return False
        try:
            kv = self.engine.save_prefix(lane, len(tokens))
        except Exception as e:
            log.warning("prefix cache in host memory: saving lane %d's %d tokens failed (%s: %s); not kept", lane,
                        len(tokens), type(e).__name__, e)
            return False
        self._put(TierEntry(tokens, adapter, kv, merge_windows(points) if self.windows is not None else None))
        return True

    def _keep_free_lane(self, a: Admission, must_exceed: int) -> bool:
        """With rings, keep in the tier (`_keep`) the free lane's prefix, the taken lane's included, whose window
        copies restart `a.prompt` furthest past `must_exceed` tokens: its rings may no longer hold that window, and
        the tier's restore writes it back. Whether the tier gained anything."""
        prefixes = self.cache.held(self.engine.lane_versions) + ([a.cached] if a.cached else [])
        best = self.windows.furthest(prefixes, tuple(a.prompt), a.adapter, must_exceed)
        return best is not None and self._keep(best.prefix.lane, best.prefix.tokens, best.prefix.adapter, best.points)

    def _put(self, entry: TierEntry) -> None:
        """Keep `entry` in memory and, of the base model, queue it for the disk tier (as kept: with rings, with the
        restart points it took over). A LoRA load's number means nothing to another process."""
        self.metrics.prefix_tier_evictions.inc(self.host.put(entry))
        if self.disk is not None and not entry.adapter:
            self.disk.put(self.host.get(entry.tokens, entry.adapter) or entry)
        self._gauges()

    def _restore(self, lane: int, entry: TierEntry, n: int) -> bool:
        """Write `entry`'s first n tokens (and with rings its window before n) into `lane`. False where the copy
        failed: the entry is dropped (it may be what failed), and the lane, taken by its request, is no lane the
        prefix cache reuses."""
        try:
            if (window := entry.window(n)) is None:
                self.engine.restore_prefix(lane, entry.kv, n)
            else:
                self.engine.restore_prefix(lane, entry.kv, n, window)
            return True
        except Exception as e:
            log.warning("prefix cache in host memory: restoring %d tokens into lane %d failed (%s: %s); the request "
                        "prefills afresh", n, lane, type(e).__name__, e)
            self.host.drop(entry)
            self._gauges()
            return False

    def clear(self) -> int:
        """Drop every entry, in memory and on disk; returns how many there were."""
        dropped = self.host.clear() + (self.disk.clear() if self.disk is not None else 0)
        self._gauges()
        return dropped

    def _gauges(self) -> None:
        self.metrics.prefix_tier_bytes.set(self.host.nbytes)
        self.metrics.prefix_tier_entries.set(len(self.host))
