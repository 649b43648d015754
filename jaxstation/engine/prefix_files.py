"""The prefix cache's disk tier's files (engine/prefix_disk.py): what a file holds, and how it is read and written.

A file is `<magic><header length, 8 bytes little-endian><JSON header><arrays>`. The header holds the token ids, the
adapter, the fingerprint (`engine_fingerprint`: what else may change a KV bit or a restart's boundary), the restart
points (with rings; null without), each array's name, dtype and shape, and the sha256 of the arrays' bytes. The arrays
are the global layers' KV at [0, n) and, with rings, each restart point's window (`window<n>.<leaf>`). A write goes to
a temporary file in the same directory, is fsynced and renamed over its name, so a killed process leaves complete
files and at worst a temporary one, which no index reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstation.engine.arena import KVBuffers
from jaxstation.engine.prefix_entries import TierEntry, Windows

log = logging.getLogger(__name__)

MAGIC = b"JXPREFIX2\n"  # the format: 2 holds restart points and their windows (rings)
SUFFIX = ".kv"
MAX_HEADER = 64 << 20  # a header's bytes at most (its tokens, as JSON)


def engine_fingerprint(engine: Any) -> dict[str, Any]:
    """What fixes a KV bit of `engine`'s arena besides the tokens and the adapter: a sha256 of the base weights
    (their tree, whose static fields name how each projection multiplies, and every array's bytes, read once; LoRA
    stacks left out), the weights' dtype, the KV dtype, the global layers' per-position buffer shapes and dtypes, with
    rings their buffers' shapes and dtypes, which layers are windowed and the window, the prefill chunk, the KV block,
    the attention, the packed-step budget, the device kind and the jax version."""
    t0 = time.perf_counter()
    digest = hashlib.sha256()
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


def _leaves(kv: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """A host copy's arrays by name: a KVBuffers' fields (those present), or one array."""
    if isinstance(kv, KVBuffers):
        return {prefix + f.name: np.asarray(a) for f in dataclasses.fields(kv)
                if (a := getattr(kv, f.name)) is not None}
    return {prefix + "array": np.asarray(kv)}


def _arrays(kv: Any, windows: Windows | None = None) -> dict[str, np.ndarray]:
    """An entry's arrays by name: the global layers' KV's, then each restart point's window's (`window<n>.<leaf>`)."""
    arrays = _leaves(kv)
    for n, window in windows or ():
        arrays.update(_leaves(window, f"window{n}."))
    return arrays


def _from_leaves(arrays: dict[str, np.ndarray]) -> Any:
    return arrays["array"] if set(arrays) == {"array"} else KVBuffers(**arrays)


def _from_arrays(arrays: dict[str, np.ndarray], restarts: tuple[int, ...] | None) -> tuple[Any, Windows | None]:
    """(the global layers' KV, the windows) of a file's arrays (`_arrays`)."""
    kv = _from_leaves({name: a for name, a in arrays.items() if not name.startswith("window")})
    if restarts is None:
        return kv, None
    return kv, tuple((n, _from_leaves({name.split(".", 1)[1]: a for name, a in arrays.items()
                                       if name.startswith(f"window{n}.")})) for n in restarts)


@dataclasses.dataclass
class DiskEntry:
    """A file of the tier as its header describes it: the index's entry (`PrefixIndex`), its arrays not read."""

    path: Path
    tokens: tuple[int, ...]
    adapter: int
    nbytes: int  # the file's
    mtime: float
    arrays: list[tuple[str, str, tuple[int, ...]]]  # name, dtype, shape
    offset: int  # where the arrays start
    sha256: str
    restarts: tuple[int, ...] | None = None  # with rings, the restart points, ascending; None: every chunk boundary


class ForeignFile(Exception):
    """A complete file written for another fingerprint: another model or settings."""


def read_header(path: Path, fingerprint: dict[str, Any]) -> DiskEntry:
    """The entry `path` holds. Raises ForeignFile for a file of another `fingerprint`, and OSError, ValueError,
    KeyError, TypeError or struct.error where it is not a complete file of the format."""
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
    if header["fingerprint"] != fingerprint:
        raise ForeignFile(path.name)
    if stat.st_size != offset + header["bytes"]:
        raise ValueError(f"{stat.st_size} bytes, not {offset + header['bytes']}: truncated")
    restarts = None if header["restarts"] is None else tuple(sorted(int(n) for n in header["restarts"]))
    return DiskEntry(path, tuple(int(t) for t in header["tokens"]), int(header["adapter"]), stat.st_size,
                     stat.st_mtime, arrays, offset, header["sha256"], restarts)


def read_entry(entry: DiskEntry) -> TierEntry:
    """`entry`'s KV as a host copy (read-only views of the file's bytes). Raises OSError, or ValueError where the
    file is short or fails its checksum."""
    with entry.path.open("rb") as f:
        f.seek(entry.offset)
        payload = f.read()
    if len(payload) != entry.nbytes - entry.offset:
        raise ValueError("truncated")
    if hashlib.sha256(payload).hexdigest() != entry.sha256:
        raise ValueError("the checksum does not match: corrupt")
    arrays = {}
    at = 0
    for name, dtype, shape in entry.arrays:
        dt = jnp.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        arrays[name] = np.frombuffer(payload, dt, count, at).reshape(shape)
        at += count * dt.itemsize
    return TierEntry(entry.tokens, entry.adapter, *_from_arrays(arrays, entry.restarts))


def payload_bytes(entry: TierEntry) -> int:
    """The bytes of `entry`'s arrays, as its file holds them."""
    return sum(a.nbytes for a in _arrays(entry.kv, entry.windows).values())


@dataclasses.dataclass(frozen=True)
class Encoded:
    """An entry's file before it is written: its JSON header and its arrays' bytes."""

    entry: TierEntry
    header: bytes
    blobs: list[bytes]
    arrays: list[tuple[str, str, tuple[int, ...]]]  # name, dtype, shape
    sha256: str

    @property
    def size(self) -> int:
        return len(MAGIC) + 8 + len(self.header) + sum(map(len, self.blobs))

    def name(self, key: str) -> str:
        """The file's name in a tier of fingerprint `key`: one file per adapter and tokens."""
        digest = hashlib.sha256(repr(self.entry.tokens).encode()).hexdigest()[:24]
        return f"{key}-{self.entry.adapter}-{digest}{SUFFIX}"

    def described(self, path: Path) -> DiskEntry:
        """The index's entry of the file once written at `path`."""
        payload = sum(map(len, self.blobs))
        return DiskEntry(path, self.entry.tokens, self.entry.adapter, self.size, path.stat().st_mtime, self.arrays,
                         self.size - payload, self.sha256, self.entry.restarts)


def encode(entry: TierEntry, fingerprint: dict[str, Any]) -> Encoded:
    """`entry`'s file, for a tier of `fingerprint`."""
    arrays = _arrays(entry.kv, entry.windows)
    blobs = [np.ascontiguousarray(a).tobytes() for a in arrays.values()]
    digest = hashlib.sha256()
    for blob in blobs:
        digest.update(blob)
    restarts = entry.restarts
    header = json.dumps({"fingerprint": fingerprint, "adapter": entry.adapter, "tokens": list(entry.tokens),
                         "restarts": None if restarts is None else list(restarts),
                         "arrays": [[n, a.dtype.name, list(a.shape)] for n, a in arrays.items()],
                         "bytes": sum(map(len, blobs)), "sha256": digest.hexdigest()}).encode()
    described = [(n, a.dtype.name, a.shape) for n, a in arrays.items()]
    return Encoded(entry, header, blobs, described, digest.hexdigest())


def write_file(encoded: Encoded, path: Path, tmp: Path) -> None:
    """Write `encoded` to `tmp`, fsync it and rename it over `path` (a temporary file in the same directory)."""
    try:
        with tmp.open("wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", len(encoded.header)))
            f.write(encoded.header)
            for blob in encoded.blobs:
                f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


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
