"""A host-memory tier of the exact prefix cache: prefill-written KV kept after its lane is taken by another request.

A lane's cached prefix (engine/prefix_cache.py) lives only until a request with another prompt takes the lane. Just
before that request writes the lane, `PrefixTier.admit` copies the lane's prefill-written KV at positions [0, n) (n the
cached tokens rounded down to a chunk: a restart never lands past the last boundary) into host memory (numpy), every
global layer's k and v and, with an int8 arena, their scales, as stored: the bits are the arena's own. A request
whose prompt matches an entry further than any free lane's cached prefix takes its lane as usual, the entry's chunks are
written into the lane (one compiled program per chunk copy, donated), and prefill restarts at the chunk boundary at or
below the match, as on a lane hit: every position from there on is written by the same chunks at the same starts as a
fresh run's, so its tokens are bit-identical.

Rings. Where windowed layers keep a ring of their window (engine/arena.py), a restart at n reads the window before n
in those layers, which later writes of the lane overwrite. So as a prompt's prefill passes a restart point n, while
the rings still hold the window before n, `fed` copies those ring slots (`Engine.save_window`, the arena's bits): at
every multiple of `restart_spacing` tokens inside the prompt, and at its last chunk boundary as the prefill ends,
before the lane's first decode row. The lane's spill keeps them beside the global layers' [0, n) as the entry's
restart points, n the furthest. A restore writes the global part and the window back into the slots the ring keeps
those positions at for a restart at n; a window is of no use at another boundary, so an entry restarts only at its
restart points (`TierEntry.restart`), and an entry that extends another takes over the other's: one entry per
conversation holds its prompts' inner restart points and one at each turn's prompt end, and the lookup takes the
furthest at or below the match. A prefix with no window copied is not kept. A lane's window copies wait in
`PrefixTier` until the lane is taken, outside the tier's capacity; the inner ones stop once those waiting copies
reach the capacity. A request that keeps a lane's prefix keeps the lane's copies at or below its restart. A prompt
that a free lane's copies restart further than the tier and the lanes' rings do has that lane's prefix kept in the
tier first (`_lend`), and restored from there.

An entry is keyed as a lane's: its token ids and the LoRA adapter load that computed the KV. Everything else that
changes a KV bit (the model and its weights' dtype, the KV dtype, the arena's layout, the chunk) is fixed for the
engine the tier belongs to: one tier per scheduler and engine. Whole-prompt entries, evicted least recently used
while their bytes exceed the tier's capacity. A mesh engine's KV lives on its stations, and a split arena's copies are
not checked: there the tier is off (`tier_refusal`).

A disk tier (engine/prefix_disk.py, `--prefix-cache-dir`) may lie under it: each base-model entry the tier keeps is
also queued for a file, a clean stop writes the lanes' cached prefixes too (`persist`), and a prompt that a file
matches further than memory and the free lanes do has the file loaded into the tier and restored from there. With
rings a file holds the entry's restart points and their windows too, and a lookup there takes the furthest restart
point as here. It is off wherever the host tier is.

Failures. The copies run inside the scheduler's step (`Scheduler._loop`), after the request holds its lane, so
whatever they raise is at worst a failed step. A failed save logs a line and keeps nothing: the request goes on. A
failed restore drops its entry and the request prefills afresh from position 0 (the lane holds nothing it may reuse);
were the arena lost in a donated write, the next step fails as a failed step does and the arena is rebuilt.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import jax

from jaxstation.engine.arena import KVBuffers
from jaxstation.engine.jobs import Job
from jaxstation.engine.metrics import StationMetrics
from jaxstation.engine.prefix_cache import Pick, PrefixCache, common_prefix
from jaxstation.engine.prefix_disk import DiskTier
from jaxstation.engine.runner import Runner

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Admission:
    """A request taking a lane (`Scheduler._fill`): the pick, the lane's cached prefix just before
    (`PrefixCache.cached`), the request's prompt and LoRA adapter load, and whether it may reuse a prefix."""

    pick: Pick
    cached: tuple[tuple[int, ...], int] | None
    prompt: Sequence[int]
    adapter: int
    reuse: bool


@dataclasses.dataclass(frozen=True)
class TierEntry:
    tokens: tuple[int, ...]  # the ids whose prefill-written KV `kv` holds, a whole number of chunks
    adapter: int  # the LoRA adapter load that computed it (0: the base model)
    kv: KVBuffers  # numpy [global layers, len(tokens), kv_heads(, head_dim)] per leaf
    # with rings, the restart points: (n, the windowed layers' ring content of the window before n, as
    # `Engine.save_window` copies it), n ascending; None without rings (every chunk boundary is a restart point)
    windows: tuple[tuple[int, KVBuffers], ...] | None = None

    @property
    def nbytes(self) -> int:
        return _nbytes((self.kv, [w for _, w in self.windows or ()]))

    def restart(self, matched: int, chunk: int) -> int:
        """The furthest restart point at or below `matched` tokens (0: none)."""
        if self.windows is None:
            return matched // chunk * chunk
        return max((n for n, _ in self.windows if n <= matched), default=0)

    def window(self, n: int) -> KVBuffers | None:
        """The ring content for a restart at n (None without rings)."""
        return None if self.windows is None else dict(self.windows)[n]

    def restarts(self) -> tuple[int, ...] | None:
        """The restart points with rings (None without: every chunk boundary)."""
        return None if self.windows is None else tuple(n for n, _ in self.windows)


def restart_spacing(window: int, chunk: int) -> int:
    """Tokens between a prompt's inner restart points with rings: two windows, rounded up to the chunk."""
    return -(-2 * window // chunk) * chunk


@dataclasses.dataclass
class LaneWindows:
    """The window copies of a lane's prompt (`PrefixTier.fed`): its tokens and adapter, the position its prefill
    restarted at, the furthest it reached, and the copies by restart point."""

    tokens: tuple[int, ...]
    adapter: int
    start: int
    passed: int
    windows: dict[int, KVBuffers]

    def under(self, tokens: tuple[int, ...], adapter: int) -> dict[int, KVBuffers]:
        """The copies that are restart points of `tokens` (a prefix of this prompt, of `adapter`) at or below their
        last chunk boundary (`tokens` is cut there)."""
        if adapter != self.adapter or self.tokens[:len(tokens)] != tokens:
            return {}
        return {n: w for n, w in self.windows.items() if n <= len(tokens)}


def _nbytes(tree: object) -> int:
    return sum(a.nbytes for a in jax.tree_util.tree_leaves(tree))


class HostTier:
    """Entries by (adapter, tokens), least recently used first, holding at most `capacity` bytes."""

    def __init__(self, capacity: int, chunk: int) -> None:
        self.capacity, self.chunk = capacity, chunk
        self.nbytes = 0
        self.evictions = 0
        self._entries: OrderedDict[tuple[int, tuple[int, ...]], TierEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[tuple[int, tuple[int, ...]]]:
        """The entries' (adapter, tokens), least recently used first."""
        return list(self._entries)

    def find(self, prompt: Sequence[int], adapter: int) -> tuple[TierEntry | None, int, int]:
        """(the entry with the furthest restart point for `prompt` of `adapter`, the prompt tokens it matches (at
        most len(prompt) - 1), that restart point: `TierEntry.restart`); (None, 0, 0) where no entry has one."""
        prompt = tuple(prompt)
        best, matched, reused = None, 0, 0
        for (load, tokens), entry in self._entries.items():
            if load == adapter:
                n = min(common_prefix(tokens, prompt), len(prompt) - 1)
                if (restart := entry.restart(n, self.chunk)) > reused:
                    best, matched, reused = entry, n, restart
        return best, matched, reused

    def used(self, entry: TierEntry) -> None:
        """`entry` was reused: it becomes the most recent (if held)."""
        if (entry.adapter, entry.tokens) in self._entries:
            self._entries.move_to_end((entry.adapter, entry.tokens))

    def drop(self, entry: TierEntry) -> None:
        """Forget `entry` (if still held)."""
        if self._entries.pop((entry.adapter, entry.tokens), None) is not None:
            self.nbytes -= entry.nbytes

    def get(self, tokens: tuple[int, ...], adapter: int) -> TierEntry | None:
        """The entry of exactly `tokens` and `adapter`, if held."""
        return self._entries.get((adapter, tokens))

    def restarts_under(self, tokens: tuple[int, ...], adapter: int) -> dict[int, KVBuffers]:
        """With rings, the restart points (n: window) of the entries of `adapter` that `tokens` extends."""
        return {n: w for (load, have), e in self._entries.items() if load == adapter and tokens[:len(have)] == have
                for n, w in e.windows or ()}

    def covering(self, tokens: tuple[int, ...], adapter: int) -> TierEntry | None:
        """An entry of `adapter` that starts with `tokens` (so holds their KV), if any."""
        return next((e for (load, have), e in self._entries.items()
                     if load == adapter and have[:len(tokens)] == tokens), None)

    def covers(self, tokens: tuple[int, ...], adapter: int) -> bool:
        """Whether an entry of `adapter` starts with `tokens` (so holds their KV)."""
        return self.covering(tokens, adapter) is not None

    def put(self, entry: TierEntry) -> int:
        """Keep `entry` as the most recent, dropping the entries it covers (with rings, it takes over their restart
        points), then the least recently used while the bytes exceed the capacity; an entry larger than the capacity
        is not kept. Returns the evictions."""
        covered = [k for k in self._entries if k[0] == entry.adapter and entry.tokens[:len(k[1])] == k[1]]
        if entry.windows is not None:
            windows = {**self.restarts_under(entry.tokens, entry.adapter), **dict(entry.windows)}
            entry = dataclasses.replace(entry, windows=tuple(sorted(windows.items(), key=lambda w: w[0])))
        if entry.nbytes > self.capacity:
            return 0
        for key in covered:
            self.nbytes -= self._entries.pop(key).nbytes
        self._entries[(entry.adapter, entry.tokens)] = entry
        self.nbytes += entry.nbytes
        evicted = 0
        while self.nbytes > self.capacity:
            self.nbytes -= self._entries.popitem(last=False)[1].nbytes
            evicted += 1
        self.evictions += evicted
        return evicted

    def clear(self) -> int:
        """Drop every entry; returns how many there were."""
        dropped = len(self._entries)
        self._entries.clear()
        self.nbytes = 0
        return dropped


def tier_refusal(engine: Runner) -> str | None:
    """Why `engine`'s arena cannot feed a host tier (None: it can)."""
    if engine.arena is None:
        return "the KV lives on mesh stations"
    if len(engine.arena.k.devices()) > 1:
        return "the arena is split over devices (--tensor-parallel), and the copies are checked on one device only"
    return None


class PrefixTier:
    """The scheduler's host tier over `engine`'s lanes and their `cache`, `capacity` bytes (0: off), over `disk`
    (None: none). The decode thread owns it; `close` stops the disk tier's writer."""

    def __init__(self, engine: Runner, cache: PrefixCache, capacity: int, metrics: StationMetrics,
                 disk: DiskTier | None = None) -> None:
        refusal = tier_refusal(engine) if capacity or disk is not None else None
        if capacity and refusal:
            log.info("prefix cache in host memory: off, since %s", refusal)
            capacity = 0
        if disk is not None and not capacity:
            log.info("prefix cache on disk: off, since %s", refusal or "the host memory tier is off")
            disk.close()
        self.engine, self.cache, self.metrics = engine, cache, metrics
        self.host = HostTier(capacity, engine.chunk)
        self.disk = disk if disk is not None and capacity and disk.on else None
        if self.disk is not None:
            self.disk.attach(metrics)
        self.rings = engine.arena.rings is not None if capacity else False
        self.every = restart_spacing(engine.cfg.sliding_window, engine.chunk) if self.rings else 0
        self._windows: dict[int, LaneWindows] = {}  # lane -> its prompt's window copies

    def fed(self, lane: int, job: Job, fed: int) -> None:
        """`lane`'s prefill of `job`'s prompt reached position `fed`. With rings and unless the prompt is scored (its
        KV is not reused), copy the window before each restart point it passed while the rings still hold it, every
        `every` tokens and, as the prefill ends, at the prompt's last chunk boundary: the lane's spill (`admit`)
        keeps them as the entry's restart points. A failed copy keeps none at that point."""
        if job.prompt_logprobs or (lane_windows := self._windows.get(lane)) is None:
            return
        tokens = job.tokens
        end = len(tokens) // self.host.chunk * self.host.chunk
        points = list(range((lane_windows.passed // self.every + 1) * self.every, min(fed, end) + 1, self.every))
        if fed == len(tokens) and end not in points and (end % self.every or end > lane_windows.passed):
            points.append(end)  # unless tried as an inner point already
        lane_windows.passed = fed
        for n in points:
            if n <= lane_windows.start or n < self.engine.reuse_floor(lane):
                continue  # the lane has it already (or the tier: restored there), or the rings hold it no longer
            if n < end and sum(_nbytes(w) for lw in self._windows.values() for w in lw.windows.values()) \
                    >= self.host.capacity:
                continue  # the waiting copies are bound by the capacity; a prompt's end is always copied
            try:
                lane_windows.windows[n] = self.engine.save_window(lane, n)
            except Exception as e:
                log.warning("prefix cache in host memory: saving lane %d's window before %d failed (%s: %s); not "
                            "kept", lane, n, type(e).__name__, e)

    def admit(self, a: Admission) -> int:
        """A request of `a.prompt` takes `a.pick.lane`: keep the lane's cached prefix in the tier if the request will
        overwrite it, and restore the tier's furthest restart point into the lane where it reaches past `pick.reused`
        (with rings, a free lane's window copies count: `_lend`).
        Returns the prompt tokens the request reuses (prefill restarts there), counted on the metrics when
        `a.reuse`."""
        pick = a.pick
        if not self.host.capacity:
            if a.reuse:
                self.metrics.count_prefix_lookup(pick.matched, pick.reused, "lane")
            return pick.reused
        entry, matched, reused = self.host.find(a.prompt, a.adapter) if a.reuse else (None, 0, 0)
        if a.reuse and self.rings and self._lend(a, max(reused, pick.reused)):
            entry, matched, reused = self.host.find(a.prompt, a.adapter)
        tier = "memory"
        if a.reuse and self.disk is not None and (loaded := self._from_disk(a, max(reused, pick.reused))):
            entry, matched, reused, tier = loaded
        restore = entry is not None and reused > pick.reused
        if restore:
            self.host.used(entry)  # before the spill, which may evict the least recently used
        kept = self._spill(pick.lane, a.cached, pick.reused if not restore else 0)
        if restore and not self._restore(pick.lane, entry, reused):
            pick, restore = Pick(pick.lane, 0, 0), False  # a fresh prefill: the lane may hold part of the entry
        if self.rings:
            start = reused if restore else pick.reused
            self._windows[pick.lane] = LaneWindows(tuple(a.prompt), a.adapter, start, start, kept)
        if a.reuse:
            self.metrics.count_prefix_lookup(*((matched, reused, tier) if restore else
                                               (pick.matched, pick.reused, "lane")))
        return reused if restore else pick.reused

    def _from_disk(self, a: Admission, beat: int) -> tuple[TierEntry, int, int, str] | None:
        """(the disk tier's entry for `a.prompt`, now in memory too, the tokens it matches, its restart point for
        them, "disk") where it restarts past `beat` tokens; None otherwise, or where its file failed to load
        (logged)."""
        found, matched, reused = self.disk.find(a.prompt, a.adapter, self.host.chunk)
        if found is None or reused <= beat:
            return None
        t0 = time.perf_counter()
        loaded = self.disk.load(found)
        if loaded is None:
            return None
        self.metrics.prefix_disk_load.observe(time.perf_counter() - t0)
        entry = TierEntry(loaded.tokens, loaded.adapter, loaded.kv, loaded.windows)
        self.metrics.prefix_tier_evictions.inc(self.host.put(entry))
        self._gauges()
        return entry, matched, reused, "disk"

    def persist(self) -> None:
        """Queue the free lanes' cached prefixes (of the base model) for the disk tier, as at a clean stop. With
        rings, only a prefix whose windows its prompt's prefill copied (`fed`), with the restart points of the
        entries in memory it extends."""
        if self.disk is None:
            return
        for lane, tokens, adapter in self.cache.held(self.engine.lane_versions):
            n = len(tokens) // self.host.chunk * self.host.chunk
            try:  # a failed save costs that lane's file, never the stop
                self._persist_lane(lane, tuple(tokens[:n]), adapter)
            except Exception as e:
                log.warning("prefix cache on disk: saving lane %d's %d tokens failed (%s: %s)", lane, n,
                            type(e).__name__, e)

    def _persist_lane(self, lane: int, tokens: tuple[int, ...], adapter: int) -> None:
        windows = None
        if adapter or not tokens:
            return
        if self.rings:
            if not (points := self._points(lane, tokens, adapter)):
                return
            tokens = tokens[:max(points)]
            windows = tuple(sorted({**self.host.restarts_under(tokens, adapter), **points}.items()))
        if not self.disk.covers(tokens, adapter, None if windows is None else tuple(w for w, _ in windows)):
            self.disk.put(tokens, adapter, self.engine.save_prefix(lane, len(tokens)), windows)

    def _points(self, lane: int, tokens: tuple[int, ...], adapter: int) -> dict[int, KVBuffers]:
        """With rings, the window copies of `lane` that are restart points of `tokens` of `adapter`."""
        lane_windows = self._windows.get(lane)
        return {} if lane_windows is None else lane_windows.under(tokens, adapter)

    def close(self) -> None:
        """Write what the disk tier has queued and stop its writer."""
        if self.disk is not None:
            self.disk.close()

    def _spill(self, lane: int, cached: tuple[tuple[int, ...], int] | None, kept: int) -> dict[int, KVBuffers]:
        """Copy `lane`'s `cached` prefix into the tier (`_keep`), unless the request taking it keeps all of it (`kept`
        tokens). Returns the lane's window copies at or below `kept`, which the request taking the lane keeps."""
        n = len(cached[0]) // self.host.chunk * self.host.chunk if cached else 0
        points = self._points(lane, cached[0][:n], cached[1]) if cached and self.rings else {}
        self._windows.pop(lane, None)
        if n > kept:
            self._keep(lane, cached[0][:n], cached[1], points)
        return {m: w for m, w in points.items() if m <= kept}

    def _keep(self, lane: int, tokens: tuple[int, ...], adapter: int, points: dict[int, KVBuffers]) -> bool:
        """Copy `lane`'s prefix of `tokens` (a whole number of chunks) of `adapter` into the tier, unless it holds it
        already. With rings, only with the window copies `points` of the lane's prompt (`fed`), as the entry's restart
        points, cut at the furthest; an entry that holds the tokens but not all those restart points gains them. A
        failed copy keeps nothing. Whether the tier gained anything."""
        if self.rings:
            if not points:
                return False  # no window before any of its chunk boundaries was copied: no restart point
            tokens = tokens[:max(points)]
            if (cover := self.host.covering(tokens, adapter)) is not None:
                if new := {m: w for m, w in points.items() if m not in cover.restarts()}:
                    self._put(dataclasses.replace(cover, windows=tuple(sorted({**dict(cover.windows), **new}.items()))))
                return bool(new)
        elif self.host.covers(tokens, adapter):
            return False
        try:
            kv = self.engine.save_prefix(lane, len(tokens))
        except Exception as e:
            log.warning("prefix cache in host memory: saving lane %d's %d tokens failed (%s: %s); not kept", lane,
                        len(tokens), type(e).__name__, e)
            return False
        self._put(TierEntry(tokens, adapter, kv, tuple(sorted(points.items())) if self.rings else None))
        return True

    def _lend(self, a: Admission, beat: int) -> bool:
        """With rings, keep in the tier (`_keep`) the free lane's prefix, the taken lane's included, whose window
        copies restart `a.prompt` furthest past `beat` tokens: its rings may no longer hold that window, and the
        tier's restore writes it back. Whether the tier gained anything."""
        prompt, chunk = tuple(a.prompt), self.host.chunk
        held = self.cache.held(self.engine.lane_versions) + ([(a.pick.lane, *a.cached)] if a.cached else [])
        best, furthest = None, beat
        for lane, tokens, adapter in held:
            if adapter != a.adapter or lane not in self._windows:
                continue
            if (matched := min(common_prefix(tuple(tokens), prompt), len(prompt) - 1)) <= furthest:
                continue
            points = self._points(lane, tuple(tokens[:len(tokens) // chunk * chunk]), adapter)
            if (restart := max((n for n in points if n <= matched), default=0)) > furthest:
                best, furthest = (lane, tuple(tokens[:max(points)]), adapter, points), restart
        return best is not None and self._keep(*best)

    def _put(self, entry: TierEntry) -> None:
        """Keep `entry` in memory and, of the base model, queue it for the disk tier (as kept: with rings, with the
        restart points it took over). A LoRA load's number means nothing to another process."""
        self.metrics.prefix_tier_evictions.inc(self.host.put(entry))
        if self.disk is not None and not entry.adapter:
            kept = self.host.get(entry.tokens, entry.adapter) or entry
            self.disk.put(kept.tokens, kept.adapter, kept.kv, kept.windows)
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
