"""The integer products' repacked layout written with numpy, from its description (jaxstation/kernels/pack.cc lays
out the same bytes in C++): the reference the tests hold the packer to, byte for byte."""

from __future__ import annotations

import numpy as np

from jaxstation.kernels import cpu_kernel

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def pack_blocks(data: np.ndarray, packed: str) -> np.ndarray:
    """Block weights uint8 [..., N, K / block * block bytes] (as stored) laid out as format `packed` reads them, the
    same shape and bytes. The 32-column formats: per tile of `int_channels()` channels and per 32 columns, the tile's
    float16 fields side by side (d, then m), then the code bytes in dwords, dword i holding each channel's bytes
    4i..4i+3, then (Q5_0, Q5_1) each code vector's fifth bits, 4 a channel. The K-quants: `_pack_k` (int_matmul.cc)."""
    fmt, c = cpu_kernel.REPACKED[packed], cpu_kernel.int_channels()
    if fmt in K_QUANTS:
        return _pack_k(data, fmt)
    per_block, block_bytes = cpu_kernel.BLOCK_FORMATS[fmt]
    head = 4 if fmt in ("Q4_1", "Q5_1") else 2  # bytes of float16 fields a block
    high = 4 if fmt in ("Q5_0", "Q5_1") else 0  # bytes of fifth bits a block, after the fields
    *lead, n, row_len = data.shape
    groups, dwords = row_len // block_bytes, (block_bytes - head - high) // 4
    tile = (*lead, n // c, c, groups)
    blocks = data.reshape(*tile, block_bytes)  # [..., tile, channel, group, fields | fifth bits | codes]
    fields = np.moveaxis(blocks[..., :head].reshape(*tile, head // 2, 2), -4, -2)
    codes = np.moveaxis(blocks[..., head + high:].reshape(*tile, dwords, 4), -4, -2)
    parts = [fields.reshape(*lead, n // c, groups, head * c), codes.reshape(*lead, n // c, groups, 4 * dwords * c)]
    if high:
        words = blocks[..., head:head + 4].copy().view("<u4")[..., 0]  # [..., tile, channel, group]
        parts.append(_fifth_bits(words))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(data.shape))


def _fifth_bits(words: np.ndarray) -> np.ndarray:
    """Each channel's fifth-bit words [..., tile, channel, group] (bit b: code b's) as the kernel reads them: for each
    group, code vector j's bits 4j..4j+3 of each channel, two channels a byte -> [..., tile, group, 4 * channels]."""
    *lead, c, groups = words.shape
    nibbles = (words.astype(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    pairs = nibbles.reshape(*lead, c // 2, 2, groups, 8)
    masks = (pairs[..., 0, :, :] | pairs[..., 1, :, :] << 4).astype(np.uint8)  # [..., tile, c / 2, group, 8]
    return np.moveaxis(masks, -3, -1).reshape(*lead, groups, 4 * c)


def _k_groups(blocks: np.ndarray, fmt: str) -> tuple[np.ndarray, ...]:
    """A K-quant's blocks [..., 256-column block bytes] as each group of 32 columns' codes [..., 8, 32] (0..63) and
    integer scales: Q4_K and Q5_K (d and dmin bytes, scales [..., 8], minimums [..., 8]), Q6_K (d bytes, the scales of
    columns 0-15 and 16-31 [..., 8, 2] as int8 bytes)."""
    k = np.arange(32)
    if fmt == "Q6_K":
        ql, qh = blocks[..., :128].astype(np.int32), blocks[..., 128:192].astype(np.int32)
        codes = np.stack([(ql[..., 64 * (j // 4) + 32 * (j % 2) + k] >> 4 * (j % 4 // 2) & 15)
                          | (qh[..., 32 * (j // 4) + k] >> 2 * (j % 4) & 3) << 4 for j in range(8)], axis=-2)
        return codes.astype(np.uint8), blocks[..., 208:210], blocks[..., 192:208].reshape(*blocks.shape[:-1], 8, 2)
    s = blocks[..., 4:16].astype(np.int32)
    sc = [s[..., j] & 63 if j < 4 else (s[..., j + 4] & 15) | (s[..., j - 4] >> 2 & 48) for j in range(8)]
    mn = [s[..., j + 4] & 63 if j < 4 else (s[..., j + 4] >> 4) | (s[..., j] >> 2 & 48) for j in range(8)]
    qs = blocks[..., -128:].astype(np.int32)
    codes = np.stack([qs[..., 32 * (j // 2) + k] >> 4 * (j % 2) & 15 for j in range(8)], axis=-2)
    if fmt == "Q5_K":
        qh = blocks[..., 16:48].astype(np.int32)
        codes |= np.stack([(qh >> j & 1) << 4 for j in range(8)], axis=-2)
    return codes.astype(np.uint8), blocks[..., :4], np.stack(sc, -1), np.stack(mn, -1)


def _pack_k(data: np.ndarray, fmt: str) -> np.ndarray:
    """A K-quant laid out as its repacked format: per tile of `int_channels()` channels and per 256 columns, Q4_K and
    Q5_K the tile's float16 d, then dmin; each group's scale and its minimum's low 2 bits, a byte a channel; groups j
    and j + 4's minimums' high 4 bits, a byte a channel; then each group's codes as the 32-column formats' nibbles
    (Q5_K: then their fifth bits as Q5_0's). Q6_K: d; then each group's two int8 scales, a byte a channel each, its
    codes' low 4 bits as nibbles and their high 2 bits, 4 code vectors a byte (int_matmul.cc, PackedK)."""
    c = cpu_kernel.int_channels()
    block_bytes = cpu_kernel.BLOCK_FORMATS[fmt][1]
    *lead, n, row_len = data.shape
    blocks = data.reshape(*lead, n // c, c, row_len // block_bytes, block_bytes)  # [..., tile, channel, block, bytes]
    codes, fields, *scales = _k_groups(blocks, fmt)

    def side_by_side(a: np.ndarray, rows: int) -> np.ndarray:
        """[..., tile, channel, block, *x, b] -> [..., tile, block, rows, -1]: for each x, the channels' b bytes."""
        a = np.moveaxis(a, len(lead) + 1, -2)
        return a.reshape(*a.shape[:len(lead) + 2], rows, -1)

    low = codes & 15
    nibbles = (low[..., :16] | low[..., 16:] << 4).reshape(*codes.shape[:-1], 4, 4)  # [..., group, dword, 4]
    groups = [side_by_side(nibbles, 8)]  # [..., tile, block, group, 16 c]
    if fmt == "Q6_K":
        high = (codes >> 4).reshape(*codes.shape[:-1], 2, 4, 4).astype(np.uint32)  # [..., group, h, k, t]
        shifts = (2 * np.arange(4, dtype=np.uint32))[:, None]
        bits = (high << shifts).sum(axis=-2).astype(np.uint8)  # [..., group, h, t]
        groups = [side_by_side(scales[0][..., None], 8), groups[0], side_by_side(bits, 8)]
        head = [side_by_side(fields[..., None, :], 1)]
    else:
        sc, mn = scales
        a = (sc | (mn & 3) << 6).astype(np.uint8)  # [..., tile, channel, block, group]
        b = ((mn[..., :4] >> 2) | (mn[..., 4:] >> 2) << 4).astype(np.uint8)
        head = [side_by_side(fields.reshape(*fields.shape[:-1], 2, 2), 1), side_by_side(a[..., None], 1),
                side_by_side(b[..., None], 1)]
        if fmt == "Q5_K":
            words = ((codes >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
            fifth = _fifth_bits(words.reshape(*words.shape[:len(lead) + 2], -1))  # [..., tile, block * group, 4 c]
            groups.append(fifth.reshape(*groups[0].shape[:-1], 4 * c))
    parts = [p.reshape(*p.shape[:len(lead) + 2], -1) for p in (*head, np.concatenate(groups, axis=-1))]
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(data.shape))
