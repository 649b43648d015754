"""The decode attention kernel on one prefill chunk (Gemma 3 270M's shapes: 4 query heads on 1 kv head of 256), a task
per row against the tiled path (a task per run of rows, kernels/attention.cc), interleaved in one process: ms per call
(medians and minima), for a full layer and a windowed one, at several chunk starts; every call's bits checked equal.

Usage:
  python -m bench.prefill_attention                       # a 512-row chunk at positions 4096 and 16384
  python -m bench.prefill_attention --starts 0 4096 --tiles 8 16 32 --reps 3
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import timed, write_result
from jaxstation.kernels import cpu_kernel

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 4, 1, 256, 512


def time_chunk(start: int, rows: int, window: int | None, tiles: list[int], reps: int) -> dict:
    rng = np.random.default_rng(0)
    seq = start + rows + 1
    k, v = (jnp.asarray(rng.standard_normal((1, 1, seq, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((rows, HEADS, HEAD_DIM)), jnp.float32)
    lanes, positions = jnp.zeros(rows, jnp.int32), jnp.arange(start, start + rows, dtype=jnp.int32)
    calls = {tile: jax.jit(lambda q, k, v, t=tile: cpu_kernel.decode_attention(q, k, v, 0, lanes, positions, window,
                                                                              tile=t)) for tile in (1, *tiles)}
    ref = np.asarray(calls[1](q, k, v))
    for f in calls.values():
        assert np.array_equal(np.asarray(f(q, k, v)), ref)
    times: dict[int, list[float]] = {tile: [] for tile in calls}
    for _ in range(reps):
        for tile, f in calls.items():
            times[tile].append(timed(lambda f=f: f(q, k, v).block_until_ready()))
    ms = {tile: 1e3 * statistics.median(t) for tile, t in times.items()}
    return {"start": start, "rows": rows, "window": window, "ms": ms,
            "min_ms": {tile: 1e3 * min(t) for tile, t in times.items()},
            "speedup": {tile: ms[1] / ms[tile] for tile in tiles}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--tiles", type=int, nargs="+", default=[cpu_kernel.TILE])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--name", default="prefill_attention")
    args = ap.parse_args()
    results = []
    for start in args.starts:
        for window in (None, WINDOW):
            r = time_chunk(start, args.rows, window, args.tiles, args.reps)
            results.append(r)
            print(f"start {start:6} window {window or '-':>4}: " + ", ".join(
                f"tile {t}: {ms:9.1f} ms (min {r['min_ms'][t]:.1f})" for t, ms in r["ms"].items()), flush=True)
    print(f"wrote {write_result(args.name, {'results': results})}")


if __name__ == "__main__":
    main()
