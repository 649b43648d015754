"""GGUF block weights laid out once, at load, as the integer products read them (int_matmul.cc): each tile of
`cpu_kernel.int_channels()` channels holds its channels' scales side by side and their codes in the dwords one
vpdpbusd takes, so a one-row call loads them as they lie instead of decoding and transposing every channel's blocks.
The same bytes as the file's, so memory does not grow, and the same integers, so a row's bits are the stored layout's.
The layout is pack.cc's, which lays out a matrix in one pass over its bytes on every core.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from jaxstation.kernels.cpu_kernel import REPACKED, library


def pack_blocks(data: np.ndarray, packed: str) -> np.ndarray:
    """Block weights uint8 [..., N, K / block * block bytes] (as stored) laid out as format `packed` reads them, the
    same shape and bytes (pack.cc). Raises ValueError for a format or a shape the layout does not take."""
    fmt = REPACKED[packed]
    src = np.ascontiguousarray(data, np.uint8)
    out = np.empty_like(src)
    n = int(np.prod(src.shape[:-1]))  # leading axes (stacked layers) are more tiles: a matrix's rows fill whole tiles
    pack = library().jaxstation_pack_blocks
    pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_char_p, ctypes.c_int]
    if pack(src.ctypes.data, out.ctypes.data, n, src.shape[-1], fmt.encode(), os.cpu_count() or 1):
        raise ValueError(f"cannot lay out {fmt} blocks of shape {data.shape} as {packed}")
    return out
