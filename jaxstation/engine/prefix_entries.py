"""The entries of the prefix cache's tiers, one model for host memory (engine/prefix_tier.py) and disk
(engine/prefix_disk.py), so that both find, cover and replace entries by the same rules.

An entry holds the prefill-written KV of its token ids under one LoRA adapter load, and a prefill may restart from it
at its restart points only: every chunk boundary without rings, and with rings (engine/arena.py) the points whose
window was copied beside the KV (docs/prefix-reuse.md). `PrefixIndex` keeps a tier's entries by (adapter, tokens),
least recently used first. It is bookkeeping without a lock: the host tier is the decode thread's, and the disk tier
calls it under its own lock.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

import jax

from jaxstation.engine.prefix_cache import chunk_floor, reusable

Windows = tuple[tuple[int, Any], ...]  # restart points with their windows' host copies, ascending
Key = tuple[int, tuple[int, ...]]  # (adapter, tokens)


class Entry(Protocol):
    """What either tier's entry tells the index: its tokens, its adapter load and its restart points."""

    @property
    def tokens(self) -> tuple[int, ...]: ...

    @property
    def adapter(self) -> int: ...

    @property
    def restarts(self) -> tuple[int, ...] | None: ...


E = TypeVar("E", bound=Entry)


def restart_at(restarts: tuple[int, ...] | None, matched: int, chunk: int) -> int:
    """The furthest of `restarts` at or below `matched` tokens (0: none); None is every chunk boundary."""
    if restarts is None:
        return chunk_floor(matched, chunk)
    return max((n for n in restarts if n <= matched), default=0)


def holds(have: tuple[int, ...] | None, want: tuple[int, ...] | None) -> bool:
    """Whether restart points `have` include `want` (None: every chunk boundary, without rings)."""
    return have is None or want is not None and set(want) <= set(have)


def merge_windows(*sets: Iterable[tuple[int, Any]] | dict[int, Any] | None) -> Windows:
    """Restart points and their windows from several entries or lanes, as one ascending tuple; where two sets hold the
    same point, the later set's window is kept."""
    merged: dict[int, Any] = {}
    for windows in sets:
        merged.update(windows or ())
    return tuple(sorted(merged.items(), key=lambda point: point[0]))


def restart_points(windows: Windows | None) -> tuple[int, ...] | None:
    """The restart points of `windows` (None without rings: every chunk boundary)."""
    return None if windows is None else tuple(n for n, _ in windows)


def tree_bytes(tree: object) -> int:
    """The bytes of every array in `tree`."""
    return sum(a.nbytes for a in jax.tree_util.tree_leaves(tree))


@dataclasses.dataclass(frozen=True)
class TierEntry:
    """A host copy of a prefix's KV: a host tier entry, or a disk tier file once loaded."""

    tokens: tuple[int, ...]  # the ids whose prefill-written KV `kv` holds, a whole number of chunks
    adapter: int  # the LoRA adapter load that computed it (0: the base model)
    kv: Any  # KVBuffers of numpy arrays [global layers, len(tokens), kv_heads(, head_dim)] per leaf
    # with rings, the restart points: (n, the windowed layers' ring content of the window before n, as
    # `Engine.save_window` copies it), n ascending; None without rings (every chunk boundary is a restart point)
    windows: Windows | None = None

    @property
    def restarts(self) -> tuple[int, ...] | None:
        """The restart points with rings (None without: every chunk boundary)."""
        return restart_points(self.windows)

    @property
    def nbytes(self) -> int:
        return tree_bytes((self.kv, [w for _, w in self.windows or ()]))

    def window(self, n: int) -> Any:
        """The ring content for a restart at n (None without rings)."""
        return None if self.windows is None else dict(self.windows)[n]


@dataclasses.dataclass(frozen=True)
class Found(Generic[E]):
    """A tier's answer to a prompt: the entry that restarts it furthest, and how far."""

    entry: E
    matched: int  # prompt tokens equal to the entry's (at most len(prompt) - 1)
    reused: int  # the entry's furthest restart point at or below `matched`: prefill restarts here


class PrefixIndex(Generic[E]):
    """A tier's entries by (adapter, tokens), least recently used first."""

    def __init__(self) -> None:
        self._entries: OrderedDict[Key, E] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[E]:
        return iter(list(self._entries.values()))

    def keys(self) -> list[Key]:
        """The entries' (adapter, tokens), least recently used first."""
        return list(self._entries)

    def get(self, tokens: tuple[int, ...], adapter: int) -> E | None:
        """The entry of exactly `tokens` and `adapter`, if held."""
        return self._entries.get((adapter, tokens))

    def add(self, entry: E) -> E | None:
        """Hold `entry` as the most recent; returns the entry it replaces (of the same tokens and adapter), if any."""
        key = (entry.adapter, entry.tokens)
        replaced = self._entries.pop(key, None)
        self._entries[key] = entry
        return replaced

    def remove(self, entry: E) -> E | None:
        """Forget the entry of `entry`'s tokens and adapter; returns it, if one was held."""
        return self._entries.pop((entry.adapter, entry.tokens), None)

    def oldest(self) -> E:
        """Forget the least recently used entry and return it."""
        return self._entries.popitem(last=False)[1]

    def used(self, entry: E) -> None:
        """`entry` was reused: it becomes the most recent (if held)."""
        if (entry.adapter, entry.tokens) in self._entries:
            self._entries.move_to_end((entry.adapter, entry.tokens))

    def clear(self) -> int:
        """Forget every entry; returns how many there were."""
        dropped = len(self._entries)
        self._entries.clear()
        return dropped

    def find(self, prompt: Sequence[int], adapter: int, chunk: int) -> Found[E] | None:
        """The entry of `adapter` with the furthest restart point for `prompt`; None where none has one."""
        prompt = tuple(prompt)
        best: Found[E] | None = None
        for entry in self._entries.values():
            if entry.adapter != adapter:
                continue
            matched = reusable(entry.tokens, prompt)
            if (reused := restart_at(entry.restarts, matched, chunk)) > (best.reused if best else 0):
                best = Found(entry, matched, reused)
        return best

    def under(self, tokens: tuple[int, ...], adapter: int) -> list[E]:
        """The entries of `adapter` that `tokens` extends (their tokens a prefix of it, itself included)."""
        return [e for e in self._entries.values() if e.adapter == adapter and tokens[:len(e.tokens)] == e.tokens]

    def covering(self, tokens: tuple[int, ...], adapter: int, holding: tuple[int, ...] | None = ()) -> E | None:
        """An entry of `adapter` that starts with `tokens` (so holds their KV) and holds the restart points
        `holding` (None: every chunk boundary; by default none), if any."""
        return next((e for e in self._entries.values() if e.adapter == adapter
                     and e.tokens[:len(tokens)] == tokens and holds(e.restarts, holding)), None)

    def covered_by(self, entry: E) -> list[E]:
        """The entries `entry` makes redundant: those of its adapter that it extends, with no restart point it lacks."""
        return [e for e in self.under(entry.tokens, entry.adapter) if holds(entry.restarts, e.restarts)]
