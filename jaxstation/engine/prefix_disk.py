"""A disk tier under the prefix cache's host tier (engine/prefix_tier.py): entries as files that outlive the process.

Every entry the host tier keeps for the base model (a LoRA load's number names nothing in another process) is also
written to a file (engine/prefix_files.py), and a clean stop writes the lanes' prefixes; a later station over the same
directory finds a prompt's entry among the files' headers (`DiskTier.find`, in memory) and loads it into the host
tier. A file of another fingerprint, short or corrupt is skipped with one log line, never fatal; an unusable directory
turns the tier off with one line (docs/prefix-reuse.md).

Threads. The decode thread looks up, loads and queues (`put`); a writer thread of its own writes each file, then
deletes the least recently used (by mtime) past `capacity`. `_lock` guards the index, the queue's generation and its
bytes, which both read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxstation.engine.metrics import StationMetrics
from jaxstation.engine.prefix_entries import Found, PrefixIndex, TierEntry
from jaxstation.engine.prefix_files import (
    SUFFIX,
    DiskEntry,
    ForeignFile,
    encode,
    payload_bytes,
    read_entry,
    read_header,
    write_file,
)

log = logging.getLogger(__name__)

QUEUE = 64  # writes waiting at most; past them a write is dropped
QUEUE_BYTES = 1 << 30  # the waiting writes' bytes at most (but one); past them a write is dropped
STALE_TMP_S = 3600  # a temporary file older than this is a killed writer's (a write takes seconds): deleted at start


class DiskTier:
    """The files of `directory` written for `fingerprint`, at most `capacity` bytes of them."""

    def __init__(self, directory: str | os.PathLike, capacity: int, fingerprint: dict[str, Any],
                 metrics: StationMetrics | None = None) -> None:
        self.directory = Path(directory)
        self.capacity = capacity
        self.metrics = metrics or StationMetrics()  # the tier above gives the station's (`attach`)
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as a header reads back
        self.key = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        self.evictions = 0
        self.dropped = 0  # writes dropped: the queue was full
        self._lock = threading.Lock()  # guards the index (the decode thread's lookups, the writer's writes)
        self._index: PrefixIndex[DiskEntry] = PrefixIndex()
        self._queue: queue.Queue = queue.Queue(QUEUE)
        self._writer: threading.Thread | None = None
        self._serial = 0
        self._generation = 0  # `clear` moves it on: writes queued before are dropped (under the lock)
        self._pending = 0  # bytes queued (under the lock)
        self.on = self._scan()
        if self.on:
            self._evict()
            self._gauges()
            self._writer = threading.Thread(target=self._write_loop, name="jaxstation-prefix-disk", daemon=True)
            self._writer.start()

    # ---- the index -------------------------------------------------------------------------------------------
    def _scan(self) -> bool:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            names = sorted(p for p in self.directory.iterdir() if p.name.endswith(SUFFIX) and
                           not p.name.startswith("."))
            probe = self.directory / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            log.warning("prefix cache on disk: off, since %s is not a writable directory (%s: %s)", self.directory,
                        type(e).__name__, e)
            return False
        self._clean()
        for path in names:
            entry = self._read_header(path)
            if entry is not None:
                self._index.add(entry)
        log.info("prefix cache on disk: %d entries, %d MiB in %s (at most %d MiB)", len(self._index),
                 self.nbytes >> 20, self.directory, self.capacity >> 20)
        return True

    def _clean(self) -> None:
        """Delete the temporary files older than `STALE_TMP_S` (another process's recent ones may still be written)."""
        stale = 0
        for path in self.directory.glob(".*.tmp"):
            try:
                if time.time() - path.stat().st_mtime > STALE_TMP_S:
                    path.unlink()
                    stale += 1
            except OSError:  # renamed or deleted meanwhile, or not ours to delete: left as is
                continue
        if stale:
            log.info("prefix cache on disk: deleted %d temporary files older than %d s", stale, STALE_TMP_S)

    def _read_header(self, path: Path) -> DiskEntry | None:
        """The entry `path` holds, or None (logged) where it is not one of this tier's complete files."""
        try:
            return read_header(path, self.fingerprint)
        except ForeignFile:
            log.info("prefix cache on disk: skipping %s, written for another model or settings", path.name)
            return None
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            log.warning("prefix cache on disk: skipping %s (%s: %s)", path.name, type(e).__name__, e)
            return None

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes()

    def _bytes(self) -> int:
        """The files' bytes. Holds the lock."""
        return sum(e.nbytes for e in self._index)

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def entries(self) -> list[DiskEntry]:
        """The files the index holds."""
        with self._lock:
            return list(self._index)

    def find(self, prompt: Sequence[int], adapter: int, chunk: int) -> Found[DiskEntry] | None:
        """The file of `adapter` with the furthest restart point for `prompt` (`PrefixIndex.find`)."""
        with self._lock:
            return self._index.find(prompt, adapter, chunk)

    def covers(self, tokens: tuple[int, ...], adapter: int, restarts: tuple[int, ...] | None) -> bool:
        """Whether a file of `adapter` starts with `tokens` (so holds their KV) and holds the restart points
        `restarts` (None: every chunk boundary)."""
        with self._lock:
            return self._index.covering(tokens, adapter, restarts) is not None

    def load(self, entry: DiskEntry) -> TierEntry | None:
        """`entry`'s KV, its file touched (the most recently used now); None (logged, the entry forgotten) where the
        file is gone, short or fails its checksum."""
        try:
            loaded = read_entry(entry)
            os.utime(entry.path)
            entry.mtime = time.time()
            return loaded
        except (OSError, ValueError, TypeError) as e:
            log.warning("prefix cache on disk: skipping %s (%s: %s)", entry.path.name, type(e).__name__, e)
            with self._lock:
                if self._index.get(entry.tokens, entry.adapter) is entry:
                    self._index.remove(entry)
            self._gauges()
            return None

    # ---- writes ----------------------------------------------------------------------------------------------
    def put(self, entry: TierEntry) -> bool:
        """Queue a write of `entry` (a host copy no one writes to); False where the tier is off or the queue full
        (dropped, and counted)."""
        if not self.on:
            return False
        nbytes = payload_bytes(entry)
        with self._lock:
            if self._pending and self._pending + nbytes > QUEUE_BYTES:
                return self._drop()
            try:
                self._queue.put_nowait((self._generation, entry))
            except queue.Full:
                return self._drop()
            self._pending += nbytes
        return True

    def _drop(self) -> bool:
        """Count a write dropped; returns False, as `put` does then. Holds the lock."""
        self.dropped += 1
        self.metrics.prefix_disk_dropped.inc()
        return False

    def clear(self) -> int:
        """Forget and delete every file of this tier, and drop the writes queued so far; returns how many files. A
        closed tier keeps its files (they are the next process's)."""
        if not self.on:
            return 0
        with self._lock:
            self._generation += 1
            gone = list(self._index)
            self._index.clear()
        for entry in gone:
            entry.path.unlink(missing_ok=True)
        self._gauges()
        return len(gone)

    def close(self) -> None:
        """Write what is queued, then stop the writer. Idempotent."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        self.on = False

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            generation, entry = item
            try:
                self._write(generation, entry)
            except Exception as e:  # a full disk, a directory gone: the entry stays in memory only
                log.warning("prefix cache on disk: writing %d tokens failed (%s: %s)", len(entry.tokens),
                            type(e).__name__, e)
            finally:
                with self._lock:
                    self._pending -= payload_bytes(entry)

    def _write(self, generation: int, entry: TierEntry) -> None:
        """Write `entry`'s file, unless `clear` came since it was queued or a file holds it already; then forget the
        files it covers and delete the least recently used past the capacity."""
        if generation != self._generation or self.covers(entry.tokens, entry.adapter, entry.restarts):
            return
        encoded = encode(entry, self.fingerprint)
        if encoded.size > self.capacity:
            return
        name = encoded.name(self.key)
        path = self.directory / name
        self._serial += 1
        write_file(encoded, path, self.directory / f".{name}.{os.getpid()}.{self._serial}.tmp")
        written = encoded.described(path)
        with self._lock:
            gone = [path] if generation != self._generation else self._replace(written)  # else: cleared meanwhile
        for old in gone:
            old.unlink(missing_ok=True)
        self._evict()
        self._gauges()

    def _replace(self, written: DiskEntry) -> list[Path]:
        """Index the file just `written`; returns the files of those it covers, forgotten. A file of the same tokens
        was replaced in place (its name is theirs). Holds the lock."""
        covered = [e for e in self._index.covered_by(written) if e.tokens != written.tokens]
        for e in covered:
            self._index.remove(e)
        self._index.add(written)
        return [e.path for e in covered]

    def _evict(self) -> None:
        """Delete the least recently used files (by mtime) while the bytes exceed the capacity."""
        while True:
            with self._lock:
                if self._bytes() <= self.capacity or not len(self._index):
                    return
                victim = min(self._index, key=lambda e: e.mtime)
                self._index.remove(victim)
            victim.path.unlink(missing_ok=True)
            self.evictions += 1
            self.metrics.prefix_disk_evictions.inc()

    def attach(self, metrics: StationMetrics) -> None:
        """Report on `metrics` from now on (the station's, given by the tier above)."""
        self.metrics = metrics
        self._gauges()

    def _gauges(self) -> None:
        with self._lock:
            self.metrics.prefix_disk_bytes.set(self._bytes())
            self.metrics.prefix_disk_entries.set(len(self._index))

