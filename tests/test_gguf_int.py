"""GGUF blocks multiplied in integers on the CPU kernel (weights "gguf").

The kernel rounds each activation row to 8 bits per 32 columns from that row alone, sums each 32 columns' code
products exactly in int32, then runs one fixed float epilogue of fused multiply-adds per output. A numpy reference of
the same arithmetic (its own block decoders, checked against the gguf package's dequantization) gives the kernel's
bits for every format, so a row's bits are the same alone and among others at any row count; the AVX2, AVX-VNNI and
AVX-512 (maddubs) builds give those bits too, as do AMX tiles (on the hardware's, or emulated) for 16 rows or more; so
do the formats repacked into the kernel's tiles, as a station loads them.
Against the float32 product over the dequantized weights the error is that of 8-bit activations.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import packing_reference
import pytest
from test_gguf_blocks import random_blocks

from jaxstation.kernels import cpu_kernel, packing
from jaxstation.model.quant import GGUFBlocks, stored

ROOT = Path(__file__).resolve().parent.parent
ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 23, 32, 37)
MINIMUM_FORMATS = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")


def _half(b: np.ndarray, at: int) -> np.ndarray:
    return b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)


def _fifth(qh: np.ndarray) -> np.ndarray:
    bits = qh.copy().view(np.uint32)[..., 0].astype(np.int64)
    return ((bits[..., None] >> np.arange(32)) & 1) << 4


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = b[..., 4:16].astype(np.int64)
    sc = [s[..., j] & 63 if j < 4 else (s[..., j + 4] & 15) | ((s[..., j - 4] >> 2) & 48) for j in range(8)]
    mn = [s[..., j + 4] & 63 if j < 4 else (s[..., j + 4] >> 4) | ((s[..., j] >> 2) & 48) for j in range(8)]
    return np.stack(sc, -1), np.stack(mn, -1)


def decode(w: GGUFBlocks) -> dict[str, np.ndarray]:
    """Integer weights as the kernel reads them: q [N, K] (code minus bias), per block d and m (the minimum's
    coefficient, 0 without), per 4 columns an integer scale, per 32 columns an integer minimum."""
    per, size = cpu_kernel.BLOCK_FORMATS[w.fmt]
    n, nb = w.shape[0], w.shape[1] // per
    b = w.data.reshape(n, nb, size)
    zero = np.zeros((n, nb), np.float32)
    scale, mins = np.ones((n, nb, per // 4), np.int64), np.ones((n, nb, per // 32), np.int64)
    if w.fmt == "Q8_0":
        d, m, q = _half(b, 0), zero, b[..., 2:].view(np.int8).astype(np.int64)
    elif w.fmt in ("Q4_0", "Q4_1"):
        d, m = _half(b, 0), (_half(b, 2) if w.fmt == "Q4_1" else zero)
        q = _nibbles(b[..., -16:]) - (8 if w.fmt == "Q4_0" else 0)
    elif w.fmt in ("Q5_0", "Q5_1"):
        at = 4 if w.fmt == "Q5_1" else 2
        d, m = _half(b, 0), (_half(b, 2) if w.fmt == "Q5_1" else zero)
        q = (_nibbles(b[..., -16:]) | _fifth(b[..., at:at + 4])) - (16 if w.fmt == "Q5_0" else 0)
    elif w.fmt in ("Q4_K", "Q5_K"):
        d, m = _half(b, 0), -_half(b, 2)
        sc, mins = _k_scales(b)
        qs = b[..., -128:].astype(np.int64)
        groups = [(qs[..., 32 * (j // 2):32 * (j // 2) + 32] >> 4 * (j % 2)) & 15 for j in range(8)]
        if w.fmt == "Q5_K":
            qh = b[..., 16:48].astype(np.int64)
            groups = [g | (((qh >> j) & 1) << 4) for j, g in enumerate(groups)]
        q, scale = np.concatenate(groups, -1), np.repeat(sc, 8, axis=-1)
    else:  # Q6_K
        d, m = _half(b, 208), zero
        ql, qh = b[..., :128].astype(np.int64), b[..., 128:192].astype(np.int64)
        groups = []
        for j in range(8):
            half, quarter = divmod(j, 4)
            low = (ql[..., 64 * half + 32 * (quarter % 2):][..., :32] >> 4 * (quarter // 2)) & 15
            groups.append((low | (((qh[..., 32 * half:32 * half + 32] >> 2 * quarter) & 3) << 4)) - 32)
        q, scale = np.concatenate(groups, -1), np.repeat(b[..., 192:208].view(np.int8).astype(np.int64), 4, axis=-1)
    return {"q": q.reshape(n, -1), "d": d, "m": m, "scale": scale.reshape(n, -1), "mins": mins.reshape(n, -1)}


def dequantized(w: GGUFBlocks) -> np.ndarray:
    """The decoded integers as float weights (float64): d * scale * q + m * min."""
    per = cpu_kernel.BLOCK_FORMATS[w.fmt][0]
    c = decode(w)
    n = w.shape[0]
    d, m = (np.repeat(c[k].astype(np.float64), per, axis=1) for k in ("d", "m"))
    return d * np.repeat(c["scale"], 4, axis=1) * c["q"] + m * np.repeat(c["mins"], 32, axis=1).reshape(n, -1)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row per 32 columns: (q int [M, K], d float32 [M, K / 32])."""
    xb = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1)
    inv = np.float32(127) / np.where(amax > 0, amax, np.float32(1))
    inv = np.where(amax > 0, inv, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int64)
    return q.reshape(x.shape), (amax / np.float32(127)).astype(np.float32)


def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once, as a fused multiply-add: the product is exact in long double (64-bit
    significand), and the sum's rounding to it can change the float32 result only on an exact tie (never seen)."""
    return (a.astype(np.longdouble) * b + c).astype(np.float32)


def reference(x: np.ndarray, w: GGUFBlocks) -> np.ndarray:
    """The kernel's arithmetic in numpy: an exact integer sum per 32 columns (Q6_K: per 16), then the float epilogue
    of fused multiply-adds in column order, the K-quants' integer scales joining d_w as floats (exact)."""
    per = cpu_kernel.BLOCK_FORMATS[w.fmt][0]
    c = decode(w)
    qx, dx = quantize_rows(x)
    rows, k = x.shape
    n = w.shape[0]
    halves = (qx[:, None, :] * c["q"][None]).reshape(rows, n, k // 16, 16).sum(-1).astype(np.float32)
    sums = halves.reshape(rows, n, k // 32, 2).sum(-1)  # exact in float32: below 2^24
    scale = c["scale"][:, ::4].astype(np.float32)  # [n, k / 16]: 1 but for the K-quants
    dsums = dx * qx.reshape(rows, k // 32, 32).sum(-1).astype(np.float32)
    acc = np.zeros((rows, n), np.float32)
    for g in range(k // 32):
        d = c["d"][:, g * 32 // per]
        if w.fmt == "Q6_K":
            low, high = d * scale[:, 2 * g], d * scale[:, 2 * g + 1]
            acc = fma(fma(high[None], halves[:, :, 2 * g + 1], low[None] * halves[:, :, 2 * g]), dx[:, None, g], acc)
        else:
            acc = fma((d * scale[:, 2 * g])[None] * dx[:, None, g], sums[:, :, g], acc)
        if w.fmt in MINIMUM_FORMATS:
            acc = fma((c["m"][:, g * 32 // per] * c["mins"][:, g].astype(np.float32))[None], dsums[:, None, g], acc)
    return acc


def int_matmul(x: np.ndarray, w: GGUFBlocks) -> np.ndarray:
    f = jax.jit(cpu_kernel.rowwise_matmul, static_argnames=("blocks", "integer"))
    return np.asarray(f(jnp.asarray(x), jnp.asarray(w.data), None, blocks=w.fmt, integer=True))


def activations(rows: int, n_in: int) -> np.ndarray:
    """Normal rows with a few large outliers (as a model's activations have), and one row of zeros."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    x[rng.random(x.shape) < 0.01] *= 20
    x[5] = 0
    return x


def check_formats_against_the_reference(formats: tuple[str, ...] = tuple(cpu_kernel.BLOCK_FORMATS),
                                        n_in: int = 512, n_out: int = 40) -> None:
    """Every format: the kernel's bits are the numpy reference's, for every row alone and among others (also run in
    the AVX2 and AVX-VNNI subprocesses)."""
    x = activations(37, n_in)
    for i, fmt in enumerate(formats):
        blocks = random_blocks(fmt, n_out, n_in, seed=i)
        full = int_matmul(x, blocks)
        assert np.array_equal(full, reference(x, blocks)), fmt
        for rows in ROW_COUNTS:
            assert np.array_equal(int_matmul(x[:rows], blocks), full[:rows]), (fmt, rows)
        for row in (0, 5, 17, 36):
            assert np.array_equal(int_matmul(x[row:row + 1], blocks), full[row:row + 1]), (fmt, row)


def check_repacked(n_in: int = 512, n_out: int = 48) -> None:
    """Every block format repacked into the integer products' tiles (`packing.pack_blocks`): the bytes the numpy
    reference lays out, the plain layout's bits for every row alone and among others, and a table's rows looked up
    alike (also run in the other builds' subprocesses)."""
    x = activations(37, n_in)
    for packed, fmt in cpu_kernel.REPACKED.items():
        blocks = random_blocks(fmt, n_out, n_in, seed=11)
        tiles = dataclasses.replace(blocks, data=packing.pack_blocks(blocks.data, packed), fmt=packed)
        assert tiles.data.shape == blocks.data.shape and not np.array_equal(tiles.data, blocks.data)
        assert np.array_equal(tiles.data, packing_reference.pack_blocks(blocks.data, packed)), packed
        full = int_matmul(x, blocks)
        for rows in ROW_COUNTS:
            assert np.array_equal(int_matmul(x[:rows], tiles), full[:rows]), (packed, rows)
        for row in (0, 5, 17, 36):
            assert np.array_equal(int_matmul(x[row:row + 1], tiles), full[row:row + 1]), (packed, row)
        ids = jnp.asarray([[0, 47], [16, 5], [15, 31]], jnp.int32)  # every tile, its first and last lanes
        assert np.array_equal(np.asarray(cpu_kernel.block_rows(jnp.asarray(tiles.data), ids, packed)),
                              np.asarray(cpu_kernel.block_rows(jnp.asarray(blocks.data), ids, fmt))), packed


def test_the_repacked_formats_give_the_plain_layouts_bits() -> None:
    check_repacked()


def test_the_block_formats_load_repacked_for_the_integer_products_where_their_channels_fill_tiles() -> None:
    tile = cpu_kernel.int_channels()
    assert tile == cpu_kernel.vector_lanes()  # a tile is one vector of channels
    for fmt, (per_block, _) in cpu_kernel.BLOCK_FORMATS.items():
        assert stored(random_blocks(fmt, 3 * tile, 2 * per_block, seed=1), "gguf", "kernel").blocks == f"{fmt}R"
        assert stored(random_blocks(fmt, 3 * tile, 2 * per_block, seed=1), "gguf-exact", "kernel").blocks == fmt
        assert stored(random_blocks(fmt, 3 * tile + 4, 2 * per_block, seed=1), "gguf", "kernel").blocks == fmt


def test_the_numpy_decoders_read_what_gguf_dequantizes() -> None:
    for i, fmt in enumerate(cpu_kernel.BLOCK_FORMATS):
        blocks = random_blocks(fmt, 8, 512, seed=i)
        np.testing.assert_allclose(dequantized(blocks), blocks.dequantize(), rtol=1e-6, atol=1e-9, err_msg=fmt)


def test_every_format_gives_the_references_bits_at_every_row_count() -> None:
    check_formats_against_the_reference()


def test_the_integer_product_is_close_to_float32s() -> None:
    """Normal activations against the float64 product over the dequantized weights, relative to its root mean
    square over 37 rows x 40 outputs: the error's root mean square measured 0.48-0.53% across the formats, its largest
    1.8-2.7%."""
    x = np.random.default_rng(9).standard_normal((37, 512)).astype(np.float32)
    for i, fmt in enumerate(cpu_kernel.BLOCK_FORMATS):
        blocks = random_blocks(fmt, 40, 512, seed=i)
        exact = x.astype(np.float64) @ blocks.dequantize().astype(np.float64).T
        err = np.abs(int_matmul(x, blocks) - exact) / np.sqrt(np.mean(exact ** 2))
        rms = np.sqrt(np.mean(err ** 2))
        assert 0.004 < rms < 0.006 and err.max() < 0.035, (fmt, rms, err.max())


# each build, and the CPU flags it needs
BUILDS = {"avx2": {"avx2"}, "avx-vnni": {"avx_vnni"}, "avx512": {"avx512f", "avx512bw"}}
AMX = {"amx_tile", "amx_int8"}


def run_checks(build: str, script: str) -> subprocess.CompletedProcess:
    """`script` after the reference checks' imports, in a process whose kernels are `build` (JAXSTATION_KERNEL_ISA;
    "": the CPU decides)."""
    header = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        from jaxstation.kernels import cpu_kernel
        from test_gguf_int import check_formats_against_the_reference, check_repacked
    """)
    env = {**os.environ, cpu_kernel.ISA_ENV: build, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", header + textwrap.dedent(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("isa", list(BUILDS))
def test_every_build_gives_the_same_bits(isa: str) -> None:
    """vpdpbusd and maddubs give the same int32 sums, and the epilogue is the same: on every instruction set the
    kernels build for (here, those this CPU runs), the reference's bits."""
    if not BUILDS[isa] <= cpu_kernel.cpu_info()[1]:
        pytest.skip(f"this CPU has no {isa}")
    done = run_checks(isa, f"""
        assert cpu_kernel.int_dot_isa() == {isa!r}, cpu_kernel.int_dot_isa()
        check_formats_against_the_reference()
        check_repacked()
        print("ok")
    """)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr[-3000:]


@pytest.mark.parametrize("build", ["amx-emulated", "amx", "avx512-vnni"])
def test_amx_tiles_give_the_vector_kernels_bits(build: str) -> None:
    """Products of 16 rows or more run on AMX tiles where the CPU has them and Linux grants them, each whole tile of
    16 rows with exact int32 sums and the vector kernel's epilogue: the reference's bits at every row count (37 rows:
    two tiles, then 5 rows on the vector tiles), plain and repacked. "amx-emulated" runs that code path on tiles
    emulated in plain loops (any AVX-512 VNNI CPU); "amx" on the hardware's (the default build on a CPU with AMX);
    "avx512-vnni" is the vector kernel alone on such a CPU (without AMX, the default build is that one)."""
    flags = cpu_kernel.cpu_info()[1]
    if not {"avx512f", "avx512_vnni"} <= flags:
        pytest.skip("the AMX path is built with the AVX-512 VNNI kernel, which this CPU lacks")
    if build != "amx-emulated" and not AMX <= flags:
        pytest.skip(f"this CPU has no AMX ({', '.join(sorted(AMX - flags))}): its tiles run emulated only")
    done = run_checks("" if build == "amx" else build, """
        print("state:", cpu_kernel.int_amx())
        if not cpu_kernel.int_amx().startswith("off: Linux refused"):
            check_formats_against_the_reference()
            check_repacked()
            print("ok")
    """)
    state = next((ln.partition(": ")[2] for ln in done.stdout.splitlines() if ln.startswith("state: ")), "")
    if build == "amx" and state.startswith("off: Linux refused"):
        pytest.skip(f"the CPU lists AMX, and {state[5:]}: the vector kernel serves")
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr[-3000:]
    assert state == ("amx-emulated" if build == "amx-emulated" else "amx" if build == "amx" else
                     "off: this build has no AMX-INT8 (the CPU has none, or JAXSTATION_KERNEL_ISA named a build "
                     "without it)"), state
