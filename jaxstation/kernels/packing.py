"""GGUF block weights laid out once, at load, as the integer products read them (int_matmul.cc): each tile of
`cpu_kernel.int_channels()` channels holds its channels' scales side by side and their codes in the dwords one
vpdpbusd takes, so a one-row call loads them as they lie instead of decoding and transposing every channel's blocks.
The same bytes as the file's, so memory does not grow, and the same integers, so a row's bits are the stored layout's.
The layout is pack.cc's, which lays out a matrix in one pass over its bytes on every core, straight into a mapping of
its own, 2 MiB-aligned, which JAX takes without a copy and which the engine's pager then moves onto 2 MiB pages whole
(engine/host_memory.py): asked for at once, those pages cost an 8B model's load seconds of the kernel's zeroing and
compaction.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence

import numpy as np

from jaxstation.kernels.cpu_kernel import REPACKED, int_channels, library

HUGE_PAGE = 1 << 21


def pack_blocks(parts: np.ndarray | Sequence[np.ndarray], packed: str) -> np.ndarray:
    """Block weights uint8 [..., N, K / block * block bytes] (as stored; or the row runs of one, joined along N) laid
    out as format `packed` reads them, the same shape and bytes (pack.cc), in a page-aligned array of its own (which
    `jax.device_put` takes without a copy). Raises ValueError for a format or a shape the layout does not take."""
    fmt = REPACKED[packed]
    parts = [np.ascontiguousarray(p, np.uint8) for p in ([parts] if isinstance(parts, np.ndarray) else parts)]
    if any(p.shape[-2] % int_channels() for p in parts):  # a tile would straddle two parts: lay out the joined rows
        parts = [np.concatenate(parts, axis=-2)]
    *lead, _, row_len = parts[0].shape
    out = aligned_array((*lead, sum(p.shape[-2] for p in parts), row_len))
    pack = library().jaxstation_pack_blocks
    pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_char_p, ctypes.c_int]
    rows = 0
    for part in parts:
        n = part.shape[-2]
        if lead:  # stacked layers: pack each layer's rows of this part into its place
            for i in np.ndindex(*lead):
                _pack_one(pack, part[i], out[i][rows:rows + n], fmt, packed)
        else:
            _pack_one(pack, part, out[rows:rows + n], fmt, packed)
        rows += n
    return out


def _pack_one(pack, src: np.ndarray, dst: np.ndarray, fmt: str, packed: str) -> None:
    if pack(src.ctypes.data, dst.ctypes.data, src.shape[0], src.shape[1], fmt.encode(), os.cpu_count() or 1):
        raise ValueError(f"cannot lay out {fmt} blocks of shape {src.shape} as {packed}")


def aligned_array(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialized uint8 array of `shape` in a private anonymous mapping of its own (a shared one would be shmem,
    which gets no 2 MiB pages), starting on a 2 MiB boundary; freed when the array is."""
    nbytes = int(np.prod(shape))
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(mapping, np.uint8)
    start = -base.ctypes.data % HUGE_PAGE
    return base[start:start + nbytes].reshape(shape)
