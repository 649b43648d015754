"""The decode attention kernel's tiled path (kernels/attention.cc): rows of one lane at consecutive positions, a
prefill chunk's, share a task and each key and value load, and every row keeps the one-row walk's bits, whatever the
tile, the chunk's start and length, the rows beside it, the window or the ring; and over a bfloat16 or int8 arena, read
in place, every row has the bits it has over the arena's float32 read (LayerKV.read)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, run_wave

from jaxstation.engine.arena import KVBuffers, LayerKV, quantize
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import SamplingParams
from jaxstation.kernels import cpu_kernel
from jaxstation.model.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernels do not build here")


def _case(seed: int, kvh: int, group: int, hd: int, seq: int, rows: list[tuple[int, int]]):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((2, 4, seq, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((2, 4, seq, kvh, hd)).astype(np.float32)
    q = rng.standard_normal((len(rows), kvh * group, hd)).astype(np.float32)
    lanes, positions = (np.array(c, np.int32) for c in zip(*rows, strict=True))
    return q, k, v, lanes, positions


def _rows(chunks: list[tuple[int, int, int]], decode: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(lane, position) rows: each chunk (lane, start, length) as consecutive rows, a decode row after each chunk."""
    out: list[tuple[int, int]] = []
    for i, (lane, start, n) in enumerate(chunks):
        out += [(lane, start + j) for j in range(n)]
        out += decode[i:i + 1]
    return out + decode[len(chunks):]


def _attend(q, k, v, lanes, positions, window, ring, scratch_pos, tile, k_scale=None, v_scale=None):
    f = jax.jit(lambda q, k, v, lanes, positions, ks, vs: cpu_kernel.decode_attention(
        q, k, v, 1, lanes, positions, window, ring=ring, scratch_pos=scratch_pos, tile=tile, k_scale=ks, v_scale=vs))
    return np.asarray(f(q, jnp.asarray(k), jnp.asarray(v), lanes, positions, k_scale, v_scale))


def _reference(q, k, v, lanes, positions, window, ring, scratch_pos) -> np.ndarray:
    """float64 softmax over each row's own positions, position p at slot p mod ring (or p); the scratch row over
    itself."""
    seq, kvh, hd = k.shape[2], k.shape[3], k.shape[4]
    group = q.shape[1] // kvh
    out = np.zeros(q.shape)
    for r, (lane, pos) in enumerate(zip(lanes, positions, strict=True)):
        scratch = pos == scratch_pos
        lo = pos if scratch else 0 if window is None else max(0, pos - window + 1)
        slots = [seq - 1] if scratch else [p % ring if ring else p for p in range(lo, pos + 1)]
        for h in range(q.shape[1]):
            keys, vals = k[1, lane, slots, h // group].astype(np.float64), v[1, lane, slots, h // group]
            s = keys @ q[r, h] / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[r, h] = (p / p.sum()) @ vals
    return out


CASES = {  # name: (kvh, group, hd, window, ring, chunks (lane, start, length), decode rows (lane, position))
    "full": (2, 3, 32, None, 0, [(0, 0, 37), (2, 5, 20)], [(1, 17), (3, 99)]),
    "windowed": (1, 4, 256, 9, 0, [(1, 3, 30), (0, 60, 33)], [(2, 0), (3, 41), (1, 99)]),
    "group 8, 3 vectors": (1, 8, 48, 20, 0, [(3, 70, 29)], [(0, 5), (1, 80)]),
    "one head, 96 wide": (3, 1, 96, None, 0, [(2, 11, 64), (2, 75, 3)], [(0, 50)]),
    "ring": (1, 4, 64, 9, 12, [(0, 5, 40), (3, 86, 13)], [(1, 30), (2, 100)]),
    "ring full width": (2, 2, 16, 12, 12, [(2, 40, 25)], [(0, 99), (3, 100), (1, 3)]),
}


@pytest.mark.parametrize("name", CASES)
def test_a_tiled_chunk_has_the_one_row_walks_bits(name: str) -> None:
    """Any tile gives every row the bits of a task per row, which a float64 softmax bounds; a row alone too."""
    kvh, group, hd, window, ring, chunks, decode = CASES[name]
    seq, scratch_pos = (ring + 1, 100) if ring else (100, 99)
    args = _case(len(name), kvh, group, hd, seq, _rows(chunks, decode))
    one = _attend(*args, window, ring, scratch_pos, tile=1)
    for tile in (2, 5, 16, 64):
        assert np.array_equal(_attend(*args, window, ring, scratch_pos, tile), one), tile
    np.testing.assert_allclose(one, _reference(*args, window, ring, scratch_pos), rtol=1e-5, atol=1e-5)
    q, k, v, lanes, positions = args
    for r in (0, 7, len(lanes) - 1):
        alone = _attend(q[r:r + 1], k, v, lanes[r:r + 1], positions[r:r + 1], window, ring, scratch_pos, 16)
        assert np.array_equal(alone, one[r:r + 1]), r


@pytest.mark.parametrize("start", [0, 1, 15, 16, 47])
@pytest.mark.parametrize("length", [2, 17, 33])
def test_chunk_starts_and_lengths(start: int, length: int) -> None:
    """A chunk of any length from any start, split at any tile, beside decode rows of other lanes."""
    args = _case(start * 100 + length, 1, 4, 128, 100, _rows([(1, start, length)], [(0, 63), (2, 30), (3, 99)]))
    one = _attend(*args, None, 0, 99, tile=1)
    for tile in (3, 16):
        assert np.array_equal(_attend(*args, None, 0, 99, tile), one), tile


def test_the_engines_prefill_does_not_depend_on_the_tile(monkeypatch) -> None:
    """tiny-gemma3 (windowed layers on a ring, the kernel's attention) prefilling 32-row chunks: the same tokens and
    logits at any tile."""

    def run(tile: int) -> dict:
        monkeypatch.setattr(cpu_kernel, "TILE", tile)
        jax.clear_caches()
        model = load_model(str(FIXTURES / "tiny-gemma3"), "float32", "unroll", "kernel")
        engine = Engine(model, lanes=4, max_seq=96, chunk=32, block=16, attention="kernel", prefill_budget=32,
                        kv_windows="ring")
        rng = np.random.default_rng(7)
        lanes = {lane: (rng.integers(3, model.cfg.vocab_size, n).tolist(), SamplingParams(temperature=0.8, seed=lane))
                 for lane, n in ((0, 70), (2, 41), (3, 5))}
        return run_wave(engine, lanes, steps=4)

    one, tiled = run(1), run(16)
    assert one.keys() == tiled.keys()
    for lane in one:
        assert one[lane][0] == tiled[lane][0], lane
        for x, y in zip(one[lane][1], tiled[lane][1], strict=True):
            np.testing.assert_array_equal(x, y)


def _stored(k: np.ndarray, v: np.ndarray, kv_dtype: str) -> KVBuffers:
    """k and v as an arena of `kv_dtype` stores them (LayerKV.write's cast, or its int8 quantization)."""
    if kv_dtype == "int8":
        (kq, ks), (vq, vs) = quantize(jnp.asarray(k)), quantize(jnp.asarray(v))
        return KVBuffers(kq, vq, ks, vs)
    return KVBuffers(jnp.asarray(k, kv_dtype), jnp.asarray(v, kv_dtype))


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("name", CASES)
def test_a_smaller_arena_read_in_place_has_the_float32_reads_bits(name: str, kv_dtype: str) -> None:
    """The kernel over bfloat16 or int8 k and v (and their scales) equals, bit for bit, the kernel over the float32
    copy LayerKV.read makes of them: decode rows and tiled chunks, full buffers, windows and rings."""
    kvh, group, hd, window, ring, chunks, decode = CASES[name]
    seq, scratch_pos = (ring + 1, 100) if ring else (100, 99)
    q, k, v, lanes, positions = _case(len(name) + 3, kvh, group, hd, seq, _rows(chunks, decode))
    stored = _stored(k, v, kv_dtype)
    read = jax.jit(lambda b: LayerKV(b, slice(None), ring, scratch_pos).read(slice(None), slice(None), jnp.float32))
    k32, v32 = read(stored)
    assert not np.array_equal(np.asarray(k32), k)  # the arena rounded them
    for tile in (1, 16):
        small = _attend(q, stored.k, stored.v, lanes, positions, window, ring, scratch_pos, tile, stored.k_scale,
                        stored.v_scale)
        assert np.array_equal(small, _attend(q, k32, v32, lanes, positions, window, ring, scratch_pos, tile)), tile


def test_int8_needs_its_scales() -> None:
    q, k, v, lanes, positions = _case(1, 1, 2, 16, 20, [(0, 3)])
    stored = _stored(k, v, "int8")
    with pytest.raises(ValueError, match="int8 k and v take k_scale and v_scale"):
        _attend(q, stored.k, stored.v, lanes, positions, None, 0, 19, 1)
