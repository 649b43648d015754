"""With rings, the window copies of each lane's prompt, which the prefix cache's host tier keeps as restart points.

A windowed layer's ring holds the window before a position only until the lane writes about a ring past it
(engine/arena.py), so as a prompt's prefill passes a restart point the window before it is copied
(`Engine.save_window`): every `restart_spacing` tokens inside the prompt, and at its last chunk boundary as the
prefill ends. The copies wait here, by lane, until a request takes the lane; the host tier (engine/prefix_tier.py)
then keeps them beside the lane's prefix as its entry's restart points (docs/prefix-reuse.md). The decode thread owns
this state, as it owns the tier.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from jaxstation.engine.arena import KVBuffers
from jaxstation.engine.jobs import Job
from jaxstation.engine.prefix_cache import LanePrefix, chunk_floor, reusable
from jaxstation.engine.prefix_entries import restart_at, tree_bytes
from jaxstation.engine.runner import Runner

log = logging.getLogger(__name__)


def restart_spacing(window: int, chunk: int) -> int:
    """Tokens between a prompt's inner restart points with rings: two windows, rounded up to the chunk."""
    return -(-2 * window // chunk) * chunk


@dataclasses.dataclass
class LaneWindows:
    """The window copies of a lane's prompt: its tokens and adapter, the position its prefill restarted at, the
    furthest it reached, and the copies by restart point."""

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


@dataclasses.dataclass(frozen=True)
class LaneCopies:
    """A lane's prefix cut at its furthest restart point, with the window copies that are its restart points."""

    prefix: LanePrefix
    points: dict[int, KVBuffers]


class WindowCopies:
    """The window copies waiting beside `engine`'s lanes; the inner ones stop once all lanes' reach `capacity` bytes
    (a prompt's end is always copied)."""

    def __init__(self, engine: Runner, capacity: int) -> None:
        self.engine = engine
        self.capacity = capacity
        self.spacing = restart_spacing(engine.cfg.sliding_window, engine.chunk)
        self._lanes: dict[int, LaneWindows] = {}

    def begin(self, lane: int, prompt: Sequence[int], adapter: int, start: int, kept: dict[int, KVBuffers]) -> None:
        """A request of `prompt` (of `adapter`) takes `lane`, its prefill starting at `start`, holding the copies
        `kept` of the lane's previous prompt (those at or below `start`)."""
        self._lanes[lane] = LaneWindows(tuple(prompt), adapter, start, start, kept)

    def prefill_passed(self, lane: int, job: Job, position: int) -> None:
        """`lane`'s prefill of `job`'s prompt reached `position`. Unless the prompt is scored (its KV is not reused),
        copy the window before each restart point it passed while the rings still hold it. A failed copy keeps none
        at that point."""
        if job.prompt_logprobs or (copies := self._lanes.get(lane)) is None:
            return
        end = chunk_floor(len(job.tokens), self.engine.chunk)
        for n in self._passed_points(copies, position, end, len(job.tokens)):
            if n <= copies.start or n < self.engine.reuse_floor(lane):
                continue  # the lane has it already (or the tier: restored there), or the rings hold it no longer
            if n < end and self._waiting_bytes() >= self.capacity:
                continue  # the waiting copies are bound by the capacity; a prompt's end is always copied
            try:
                copies.windows[n] = self.engine.save_window(lane, n)
            except Exception as e:
                log.warning("prefix cache in host memory: saving lane %d's window before %d failed (%s: %s); not "
                            "kept", lane, n, type(e).__name__, e)

    def _passed_points(self, copies: LaneWindows, position: int, end: int, length: int) -> list[int]:
        """The restart points a prefill passes from `copies.passed` to `position` (recorded as passed): each multiple
        of the spacing up to the prompt's last chunk boundary `end`, and `end` itself once the prompt of `length`
        tokens is in, unless tried as an inner point already."""
        spacing = self.spacing
        points = list(range((copies.passed // spacing + 1) * spacing, min(position, end) + 1, spacing))
        if position == length and end not in points and (end % spacing or end > copies.passed):
            points.append(end)
        copies.passed = position
        return points

    def _waiting_bytes(self) -> int:
        return sum(tree_bytes(w) for copies in self._lanes.values() for w in copies.windows.values())

    def holds(self, lane: int) -> bool:
        """Whether copies of `lane`'s prompt are waiting."""
        return lane in self._lanes

    def points(self, lane: int, tokens: tuple[int, ...], adapter: int) -> dict[int, KVBuffers]:
        """`lane`'s copies that are restart points of `tokens` of `adapter` (`LaneWindows.under`)."""
        copies = self._lanes.get(lane)
        return {} if copies is None else copies.under(tokens, adapter)

    def take(self, lane: int, tokens: tuple[int, ...], adapter: int) -> dict[int, KVBuffers]:
        """`points`, and forget the lane's copies: a request takes the lane."""
        points = self.points(lane, tokens, adapter)
        self._lanes.pop(lane, None)
        return points

    def furthest(self, prefixes: Sequence[LanePrefix], prompt: tuple[int, ...], adapter: int,
                 must_exceed: int) -> LaneCopies | None:
        """Of the lanes' cached `prefixes`, the one whose copies restart `prompt` (of `adapter`) furthest past
        `must_exceed` tokens, cut at its furthest restart point; None where none does."""
        best = None
        furthest = must_exceed
        for prefix in prefixes:
            if prefix.adapter != adapter or not self.holds(prefix.lane):
                continue
            if (matched := reusable(prefix.tokens, prompt)) <= furthest:
                continue
            boundary = prefix.tokens[:chunk_floor(len(prefix.tokens), self.engine.chunk)]
            points = self.points(prefix.lane, boundary, adapter)
            if (restart := restart_at(tuple(points), matched, self.engine.chunk)) > furthest:
                best = LaneCopies(dataclasses.replace(prefix, tokens=prefix.tokens[:max(points)]), points)
                furthest = restart
        return best
