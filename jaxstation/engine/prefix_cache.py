"""Exact prefix reuse over the arena's lanes, decided on the host.

A lane keeps its KV after its request retires. The part another request may reuse, bit for bit, is what prefill
wrote: every prefill chunk has the same shape (`[chunk]` rows at a chunk-aligned start) and a row never reads later
rows, so the KV a prefill wrote at positions [0, n) is what a fresh prefill of any sequence starting with those n
tokens writes there. Decode writes with another shape, so generated tokens are never reused. A reusing request
restarts prefill at the last chunk boundary at or below the match, so every later position is written as in a fresh
run. The cache is host bookkeeping only, the decode thread's: per lane, the token ids prefill wrote, the LoRA adapter
load that wrote them, and the engine's `lane_versions` stamp when the lane was freed; a stamp that changed since
(another caller wrote the lane, or `Engine.reset` rebuilt the arena) voids the entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence


@dataclasses.dataclass(frozen=True)
class Pick:
    """The lane a new request takes and what of its cached KV it reuses."""

    lane: int
    matched: int  # prompt tokens equal to the lane's prefill-written prefix (at most len(prompt) - 1)
    reused: int  # matched, rounded down to a chunk boundary: prefill restarts here

    @property
    def hit(self) -> bool:
        return self.reused > 0


@dataclasses.dataclass(frozen=True)
class _Entry:
    tokens: tuple[int, ...]  # the ids prefill wrote at positions [0, len(tokens))
    version: int  # the lane's Engine.lane_versions stamp when it was freed
    last_used: int  # a logical clock: larger is more recent
    floor: int = 0  # the lowest restart above 0 whose window the lane's rings hold (`RingHold.floor`)
    adapter: int = 0  # the LoRA adapter load whose weights wrote the KV (`Job.lora_load`; 0: the base model)


class LaneVersions:
    """Per-lane write stamps, kept by a runner (`Engine`, `MeshEngine`) for the prefix cache.

    `touch(lanes)` gives each lane a new stamp whenever its KV may change (a prefill into it, a decode wave it is live
    in, a reset). An entry stored with a lane's stamp describes the lane's KV while the stamp is unchanged.
    """

    def __init__(self, lanes: int) -> None:
        self._writes = 0
        self._stamps = [0] * lanes

    def touch(self, lanes: Iterable[int]) -> None:
        self._writes += 1
        for lane in lanes:
            self._stamps[lane] = self._writes

    def __getitem__(self, lane: int) -> int:
        return self._stamps[lane]


class RingHold:
    """Which positions each lane's rings still hold, kept by the `Engine` beside its lane stamps (so owned by the
    thread that calls the engine: the decode thread).

    A windowed layer's ring keeps `ring` positions per lane (engine/arena.py). Per lane: `high`, the last position
    written, and `low`, the first from which every position up to `high` is still in the ring. A prefill restarting
    at s reads the window before s, positions (s - window, s), so it may restart there only if those are held:
    s >= low + window - 1 (`floor`), or low is 0. Without a ring every position is held.
    """

    def __init__(self, lanes: int, ring: int, window: int) -> None:
        self.ring, self.window = ring, window
        self._low, self._high = [0] * lanes, [-1] * lanes

    def clear(self) -> None:
        """The arena was rebuilt: every lane is empty."""
        self._low, self._high = [0] * len(self._low), [-1] * len(self._high)

    def wrote(self, lane: int, first: int, last: int) -> None:
        """A step writes positions [first, last] of `lane`; what lay past them is no longer the lane's content."""
        if not self.ring:
            return
        low = self._low[lane]
        if not low <= first <= self._high[lane] + 1:
            low = first  # what lay before `first` is not known to continue into the new positions
        self._low[lane], self._high[lane] = max(low, last - self.ring + 1), last

    def restored(self, lane: int, n: int) -> None:
        """The window before n was copied into `lane`'s rings (a host tier's restore): they hold positions
        [n - window + 1, n), and nothing else of the lane's content."""
        if self.ring:
            self._low[lane], self._high[lane] = max(0, n - self.window + 1), n - 1

    def floor(self, lane: int) -> int:
        """The lowest position above 0 a prefill may restart `lane` at (0: any)."""
        low = self._low[lane]
        return 0 if low == 0 else low + self.window - 1


def common_prefix(a: tuple[int, ...], b: tuple[int, ...], step: int = 64) -> int:
    """Length of the common prefix of a and b; compares `step`-long slices at C speed, then single tokens."""
    n = min(len(a), len(b))
    i = 0
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reusable(cached: tuple[int, ...], prompt: tuple[int, ...]) -> int:
    """The prompt tokens a request may take from KV cached for `cached`: their common prefix, but never the prompt's
    last token, whose logits give the first generated token."""
    return min(common_prefix(cached, prompt), len(prompt) - 1)


def chunk_floor(n: int, chunk: int) -> int:
    """`n` rounded down to a multiple of `chunk`: the last chunk boundary at or below it."""
    return n // chunk * chunk


@dataclasses.dataclass(frozen=True)
class LanePrefix:
    """A free lane's cached prefix: the token ids its prefill wrote and the LoRA adapter load that wrote them."""

    lane: int
    tokens: tuple[int, ...]
    adapter: int


class PrefixCache:
    """Which free lane a request takes, by the longest reusable prefix; ties and victims least recently used."""

    def __init__(self, lanes: int, chunk: int) -> None:
        self.chunk = chunk
        self._entries: list[_Entry | None] = [None] * lanes
        self._clock = 0

    def pick(self, prompt: Sequence[int], free: Sequence[int], versions: Sequence[int] | LaneVersions,
             reuse: bool = True, adapter: int = 0) -> Pick:
        """Choose a lane among `free` for `prompt`. `versions` are the engine's current lane stamps.

        The last prompt token is always prefilled (its logits give the first token), so at most len(prompt) - 1
        tokens match, and only on a lane whose KV was written with the request's LoRA `adapter` load. With reuse off,
        the choice is the least recently used lane and nothing is reused.
        """
        if not free:
            raise ValueError("no free lane to pick")
        prompt = tuple(prompt)
        best: tuple[tuple[int, int, int], Pick] | None = None
        for lane in free:
            entry = self._entries[lane]
            if entry is not None and entry.version != versions[lane]:
                entry = self._entries[lane] = None  # the lane's KV changed under us
            same = reuse and entry is not None and entry.adapter == adapter
            matched = reusable(entry.tokens, prompt) if same else 0
            reused = chunk_floor(matched, self.chunk)
            reused = reused if entry is None or reused >= entry.floor else 0  # the rings lost the window before it
            key = (-reused, entry.last_used if entry else -1, lane)
            if best is None or key < best[0]:
                best = (key, Pick(lane, matched if reused else 0, reused))
        return best[1]

    def cached(self, lane: int) -> LanePrefix | None:
        """`lane`'s entry, as `pick` left it (checked against the lane's stamp when the lane was among its free
        lanes); None without one."""
        entry = self._entries[lane]
        return None if entry is None else LanePrefix(lane, entry.tokens, entry.adapter)

    def held(self, versions: Sequence[int] | LaneVersions) -> list[LanePrefix]:
        """Every entry that still describes its lane's KV (`versions`: the engine's current lane stamps)."""
        return [LanePrefix(lane, e.tokens, e.adapter) for lane, e in enumerate(self._entries)
                if e is not None and e.version == versions[lane]]

    def take(self, lane: int) -> None:
        """The lane now runs a request: its cached entry no longer describes it."""
        self._entries[lane] = None

    def store(self, lane: int, tokens: Sequence[int], version: int, floor: int = 0, adapter: int = 0) -> None:
        """The lane was freed holding prefill-written KV for `tokens` (positions [0, len(tokens))) with LoRA adapter
        load `adapter`, reusable from a restart at `floor` or above (`RingHold.floor`)."""
        self._clock += 1
        self._entries[lane] = _Entry(tuple(tokens), version, self._clock, floor, adapter) if tokens else None

    def clear(self) -> int:
        """Drop every entry (the arena was rebuilt, or a client asked); returns how many there were."""
        dropped = sum(e is not None for e in self._entries)
        self._entries = [None] * len(self._entries)
        return dropped
