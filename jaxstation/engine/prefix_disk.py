"""A disk tier under the prefix cache's host tier (engine/prefix_tier.py): entries as files that outlive the process.

With `--prefix-cache-dir`, every entry the host tier keeps for the base model (adapter 0: a LoRA adapter's load
number names another adapter in another process) is also written to a file in that directory, and the lanes' cached
prefixes are written at a clean stop (`Scheduler.drain`). A station started later over the same directory reads the
files' headers and reuses their KV as the host tier's: a request whose prompt matches a file's tokens further than
memory and the lanes do has the file loaded into the host tier and restored into its lane, bit for bit what its own
prefill would have written.

A file is `<magic><header length, 8 bytes little-endian><JSON header><arrays>`. The header holds the token ids, the
adapter, the fingerprint (`engine_fingerprint`: a hash of the weights, the weights' dtype, the KV dtype, the
arena's per-position layout, its rings' layout and window, the prefill chunk and the rest of what may change a KV bit
or a restart's boundary), the restart points (with rings; null without), each array's name, dtype and shape, and the
sha256 of the arrays' bytes. The arrays are the global layers' KV at [0, n) and, with rings, each restart point's
window (`TierEntry.windows`, named `window<n>.<leaf>`): a file restarts at its restart points only, as its host tier
entry does, and a file replaces another it extends only where it holds all of the other's restart points.

At start the directory's headers are read into an index (`DiskTier.find` looks there, in memory); a file of another
fingerprint, with a header that does not parse or of the wrong size is skipped with one log line, and one whose
arrays fail the checksum when loaded is skipped and dropped from the index: never loaded, never fatal. An unreadable
directory turns the tier off with one line.

Writes run on a writer thread of their own (`put` only queues the host copy the decode thread already holds; a full
queue drops the write): each goes to a temporary file in the same directory, is fsynced and renamed over its name
(os.replace), so a process killed at any moment leaves complete files and at worst a temporary one, which the index
never reads; a start deletes those older than an hour. `close` writes what is queued and stops the thread; `clear`
(the scheduler's reset_prefix_cache) deletes this tier's files and drops the writes queued before it. The files'
bytes stay within `capacity`: after each write the least recently used (by mtime; a load touches its file) go first.
"""

from __future__ import annotations

import dataclasses
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

import jax
import jax.numpy as jnp
import numpy as np

from jaxstation.engine.arena import KVBuffers
from jaxstation.engine.metrics import StationMetrics
from jaxstation.engine.prefix_cache import common_prefix

log = logging.getLogger(__name__)

MAGIC = b"JXPREFIX2\n"  # the format: 2 holds restart points and their windows (rings)
SUFFIX = ".kv"
MAX_HEADER = 64 << 20  # a header's bytes at most (its tokens, as JSON)
QUEUE, QUEUE_BYTES = 64, 1 << 30  # writes waiting at most, and their bytes (but one); past them a write is dropped
STALE_TMP_S = 3600  # a temporary file older than this is a killed writer's (a write takes seconds): deleted at start


def engine_fingerprint(engine: Any) -> dict[str, Any]:
    """What fixes a KV bit of `engine`'s arena besides the tokens and the adapter: a sha256 of the base weights
    (their tree, whose static fields name how each projection multiplies, and every array's bytes, read once; LoRA
    stacks left out), the weights' dtype, the KV dtype, the global layers' per-position buffer shapes and dtypes, with
    rings their buffers' shapes and dtypes, which layers are windowed and the window, the prefill chunk, the KV block,
    the attention, the packed-step budget, the device kind and the jax version."""
    t0, digest = time.perf_counter(), hashlib.sha256()
    params = _base(engine.model.params)
    digest.update(str(jax.tree_util.tree_structure(params)).encode())
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        array = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype}:{array.shape};".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    full = engine.arena.full
    layout = {f.name: [str(b.dtype), b.shape[0], *b.shape[3:]] for f in dataclasses.fields(full)
              if (b := getattr(full, f.name)) is not None}
    if (rings := engine.arena.rings) is not None:  # a window copy's slots and shapes: [layers, ring + 1, ...]
        layout["rings"] = {f.name: [str(b.dtype), b.shape[0], *b.shape[2:]] for f in dataclasses.fields(rings)
                           if (b := getattr(rings, f.name)) is not None}
        layout["windowed"] = list(engine.arena.windowed)
        layout["window"] = engine.cfg.sliding_window
    fingerprint = {"weights": digest.hexdigest(), "dtype": str(engine.model.params.dtype),
                   "kv_dtype": str(engine.kv_dtype), "layout": layout, "chunk": engine.chunk, "block": engine.block,
                   "attention": engine.attention, "budget": engine.prefill_budget,
                   "device": engine.arena.k.devices().pop().device_kind, "jax": jax.__version__}
    log.info("prefix cache on disk: the weights' fingerprint %s took %.1f s", fingerprint["weights"][:12],
             time.perf_counter() - t0)
    return fingerprint


def _base(params: Any) -> Any:
    """`params` without LoRA stacks (which hold whatever adapters are loaded)."""
    def strip(layer: Any) -> Any:
        return dataclasses.replace(layer, lora=None) if getattr(layer, "lora", None) is not None else layer

    layers = tuple(map(strip, params.layers)) if isinstance(params.layers, tuple) else strip(params.layers)
    return dataclasses.replace(params, layers=layers)


Windows = tuple[tuple[int, Any], ...] | None  # restart points and their windows, as `TierEntry.windows`


def _leaves(kv: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """A host copy's arrays by name: a KVBuffers' fields (those present), or one array."""
    if isinstance(kv, KVBuffers):
        return {prefix + f.name: np.asarray(a) for f in dataclasses.fields(kv)
                if (a := getattr(kv, f.name)) is not None}
    return {prefix + "array": np.asarray(kv)}


def _arrays(kv: Any, windows: Windows = None) -> dict[str, np.ndarray]:
    """An entry's arrays by name: the global layers' KV's, then each restart point's window's (`window<n>.<leaf>`)."""
    arrays = _leaves(kv)
    for n, window in windows or ():
        arrays.update(_leaves(window, f"window{n}."))
    return arrays


def _from_leaves(arrays: dict[str, np.ndarray]) -> Any:
    return arrays["array"] if set(arrays) == {"array"} else KVBuffers(**arrays)


def _from_arrays(arrays: dict[str, np.ndarray], restarts: tuple[int, ...] | None) -> tuple[Any, Windows]:
    """(the global layers' KV, the windows) of a file's arrays (`_arrays`)."""
    kv = _from_leaves({name: a for name, a in arrays.items() if not name.startswith("window")})
    if restarts is None:
        return kv, None
    return kv, tuple((n, _from_leaves({name.split(".", 1)[1]: a for name, a in arrays.items()
                                       if name.startswith(f"window{n}.")})) for n in restarts)


@dataclasses.dataclass
class DiskEntry:
    path: Path
    tokens: tuple[int, ...]
    adapter: int
    nbytes: int  # the file's
    mtime: float
    arrays: list[tuple[str, str, tuple[int, ...]]]  # name, dtype, shape
    offset: int  # where the arrays start
    sha256: str
    restarts: tuple[int, ...] | None = None  # with rings, the restart points, ascending; None: every chunk boundary

    def restart(self, matched: int, chunk: int) -> int:
        """The furthest restart point at or below `matched` tokens (0: none), as `TierEntry.restart`."""
        if self.restarts is None:
            return matched // chunk * chunk
        return max((n for n in self.restarts if n <= matched), default=0)


@dataclasses.dataclass(frozen=True)
class Loaded:
    tokens: tuple[int, ...]
    adapter: int
    kv: Any
    windows: Windows = None


class DiskTier:
    """The files of `directory` written for `fingerprint`, at most `capacity` bytes of them."""

    def __init__(self, directory: str | os.PathLike, capacity: int, fingerprint: dict[str, Any],
                 metrics: StationMetrics | None = None) -> None:
        self.directory, self.capacity, self.metrics = Path(directory), capacity, metrics
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as a header reads back
        self.key = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        self.evictions = self.dropped = 0
        self._lock = threading.Lock()  # guards the index (the decode thread's lookups, the writer's writes)
        self._index: dict[tuple[int, tuple[int, ...]], DiskEntry] = {}
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
                self._index[(entry.adapter, entry.tokens)] = entry
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
            with path.open("rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    raise ValueError("not a prefix cache file")
                (length,) = struct.unpack("<Q", f.read(8))
                if length > MAX_HEADER:
                    raise ValueError(f"a header of {length} bytes")
                raw = f.read(length)
                if len(raw) != length:
                    raise ValueError("truncated header")
                header = json.loads(raw)
            stat = path.stat()
            offset = len(MAGIC) + 8 + length
            arrays = [(name, dtype, tuple(shape)) for name, dtype, shape in header["arrays"]]
            if header["fingerprint"] != self.fingerprint:
                log.info("prefix cache on disk: skipping %s, written for another model or settings", path.name)
                return None
            if stat.st_size != offset + header["bytes"]:
                raise ValueError(f"{stat.st_size} bytes, not {offset + header['bytes']}: truncated")
            restarts = None if header["restarts"] is None else tuple(sorted(int(n) for n in header["restarts"]))
            return DiskEntry(path, tuple(int(t) for t in header["tokens"]), int(header["adapter"]), stat.st_size,
                             stat.st_mtime, arrays, offset, header["sha256"], restarts)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            log.warning("prefix cache on disk: skipping %s (%s: %s)", path.name, type(e).__name__, e)
            return None

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._index.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def find(self, prompt: Sequence[int], adapter: int, chunk: int) -> tuple[DiskEntry | None, int, int]:
        """(the entry with the furthest restart point for `prompt` of `adapter`, the prompt tokens it matches (at most
        len(prompt) - 1), that restart point: `DiskEntry.restart`); (None, 0, 0) where none has one."""
        prompt, best, matched, reused = tuple(prompt), None, 0, 0
        with self._lock:
            for (load, tokens), entry in self._index.items():
                if load == adapter:
                    n = min(common_prefix(tokens, prompt), len(prompt) - 1)
                    if (restart := entry.restart(n, chunk)) > reused:
                        best, matched, reused = entry, n, restart
        return best, matched, reused

    def covers(self, tokens: tuple[int, ...], adapter: int, restarts: tuple[int, ...] | None = None) -> bool:
        """Whether a file of `adapter` starts with `tokens` (so holds their KV) and, with rings, holds every one of
        `restarts`."""
        with self._lock:
            return any(load == adapter and have[:len(tokens)] == tokens and _holds(entry.restarts, restarts)
                       for (load, have), entry in self._index.items())

    def load(self, entry: DiskEntry) -> Loaded | None:
        """`entry`'s KV, its file touched (the most recently used now); None (logged, the entry forgotten) where the
        file is gone, short or fails its checksum."""
        try:
            with entry.path.open("rb") as f:
                f.seek(entry.offset)
                payload = f.read()
            if len(payload) != entry.nbytes - entry.offset:
                raise ValueError("truncated")
            if hashlib.sha256(payload).hexdigest() != entry.sha256:
                raise ValueError("the checksum does not match: corrupt")
            arrays, at = {}, 0  # views of the payload: read-only, as a host copy is to the tier
            for name, dtype, shape in entry.arrays:
                dt = jnp.dtype(dtype)
                count = int(np.prod(shape, dtype=np.int64))
                arrays[name] = np.frombuffer(payload, dt, count, at).reshape(shape)
                at += count * dt.itemsize
            os.utime(entry.path)
            entry.mtime = time.time()
            return Loaded(entry.tokens, entry.adapter, *_from_arrays(arrays, entry.restarts))
        except (OSError, ValueError, TypeError) as e:
            log.warning("prefix cache on disk: skipping %s (%s: %s)", entry.path.name, type(e).__name__, e)
            with self._lock:
                if self._index.get((entry.adapter, entry.tokens)) is entry:
                    del self._index[(entry.adapter, entry.tokens)]
            self._gauges()
            return None

    # ---- writes ----------------------------------------------------------------------------------------------
    def put(self, tokens: tuple[int, ...], adapter: int, kv: Any, windows: Windows = None) -> bool:
        """Queue a write of `kv` (a host copy no one writes to) for `tokens` of `adapter`, with rings with its restart
        points' `windows`; False where the tier is off or the queue full (dropped)."""
        if not self.on:
            return False
        nbytes = sum(a.nbytes for a in _arrays(kv, windows).values())
        with self._lock:
            if self._pending and self._pending + nbytes > QUEUE_BYTES:
                self.dropped += 1
                return False
            try:
                self._queue.put_nowait((self._generation, tokens, adapter, kv, windows))
            except queue.Full:
                self.dropped += 1
                return False
            self._pending += nbytes
        return True

    def clear(self) -> int:
        """Forget and delete every file of this tier, and drop the writes queued so far; returns how many files. A
        closed tier keeps its files (they are the next process's)."""
        if not self.on:
            return 0
        with self._lock:
            self._generation += 1
            gone = list(self._index.values())
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
            try:
                self._write(*item)
            except Exception as e:  # a full disk, a directory gone: the entry stays in memory only
                log.warning("prefix cache on disk: writing %d tokens failed (%s: %s)", len(item[1]),
                            type(e).__name__, e)
            finally:
                with self._lock:
                    self._pending -= sum(a.nbytes for a in _arrays(item[3], item[4]).values())

    def _write(self, generation: int, tokens: tuple[int, ...], adapter: int, kv: Any, windows: Windows) -> None:
        restarts = None if windows is None else tuple(n for n, _ in windows)
        if generation != self._generation or self.covers(tokens, adapter, restarts):
            return
        arrays = _arrays(kv, windows)
        blobs = [np.ascontiguousarray(a).tobytes() for a in arrays.values()]
        digest = hashlib.sha256()
        for blob in blobs:
            digest.update(blob)
        header = json.dumps({"fingerprint": self.fingerprint, "adapter": adapter, "tokens": list(tokens),
                             "restarts": None if restarts is None else list(restarts),
                             "arrays": [[n, a.dtype.name, list(a.shape)] for n, a in arrays.items()],
                             "bytes": sum(map(len, blobs)), "sha256": digest.hexdigest()}).encode()
        size = len(MAGIC) + 8 + len(header) + sum(map(len, blobs))
        if size > self.capacity:
            return
        name = f"{self.key}-{adapter}-{hashlib.sha256(repr(tokens).encode()).hexdigest()[:24]}{SUFFIX}"
        path = self.directory / name
        self._serial += 1
        tmp = self.directory / f".{name}.{os.getpid()}.{self._serial}.tmp"
        try:
            with tmp.open("wb") as f:
                f.write(MAGIC)
                f.write(struct.pack("<Q", len(header)))
                f.write(header)
                for blob in blobs:
                    f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.directory)
        entry = DiskEntry(path, tokens, adapter, size, path.stat().st_mtime, [(n, a.dtype.name, a.shape)
                          for n, a in arrays.items()], size - sum(map(len, blobs)), digest.hexdigest(), restarts)
        with self._lock:
            if generation != self._generation:  # cleared while it was written
                gone = [path]
            else:
                covered = [k for k, e in self._index.items() if k[0] == adapter and tokens[:len(k[1])] == k[1] and
                           k[1] != tokens and _holds(restarts, e.restarts)]
                gone = [self._index.pop(k).path for k in covered]
                self._index[(adapter, tokens)] = entry
        for old in gone:
            old.unlink(missing_ok=True)
        self._evict()
        self._gauges()

    def _evict(self) -> None:
        """Delete the least recently used files (by mtime) while the bytes exceed the capacity."""
        while True:
            with self._lock:
                if sum(e.nbytes for e in self._index.values()) <= self.capacity or not self._index:
                    return
                key = min(self._index, key=lambda k: self._index[k].mtime)
                victim = self._index.pop(key)
            victim.path.unlink(missing_ok=True)
            self.evictions += 1
            if self.metrics is not None:
                self.metrics.prefix_disk_evictions.inc()

    def attach(self, metrics: StationMetrics) -> None:
        """Report on `metrics` from now on (the station's, given by the tier above)."""
        self.metrics = metrics
        self._gauges()

    def _gauges(self) -> None:
        if self.metrics is not None:
            with self._lock:
                self.metrics.prefix_disk_bytes.set(sum(e.nbytes for e in self._index.values()))
                self.metrics.prefix_disk_entries.set(len(self._index))


def _holds(have: tuple[int, ...] | None, want: tuple[int, ...] | None) -> bool:
    """Whether restart points `have` include `want` (None: every chunk boundary, without rings)."""
    return have is None or want is not None and set(want) <= set(have)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (where the platform allows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
