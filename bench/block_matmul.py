"""A GGUF file's own matrices on the CPU kernel, integer products (`gguf`) against float32-exact ones (`gguf-exact`),
each matrix alone at several row counts: ms per call (medians of interleaved repetitions) and the weights' bytes
read per second. A matrix in a format the integer products repack at load (Q8_0, Q4_0, Q4_1) is timed in its stored
layout (`gguf`) and repacked (`gguf repacked`, what a station runs), interleaved with the others.

Usage:
  python -m bench.block_matmul --model gemma-3-270m-q4_k_m.gguf            # its head and block 0's matrices
  python -m bench.block_matmul --rows 1 8 32 128 --tensors blk.3.ffn_down.weight
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGUFReader

from bench.common import timed, write_result
from jaxstation.kernels import cpu_kernel, packing
from jaxstation.model.default_model import default_model_path

TENSORS = ("token_embd.weight", "blk.0.attn_output.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight")


def blocks(path: str, names: list[str]) -> dict[str, tuple[str, np.ndarray]]:
    """The named tensors of a GGUF file in a block format the kernel reads: (format, uint8 [out, row bytes])."""
    out = {}
    for t in GGUFReader(path).tensors:
        if t.name in names and t.tensor_type.name in cpu_kernel.BLOCK_FORMATS:
            out[t.name] = (t.tensor_type.name, np.asarray(t.data).reshape(int(t.shape[-1]), -1).view(np.uint8))
    return out


def time_matrix(fmt: str, w: np.ndarray, rows: int, reps: int) -> dict:
    per, size = cpu_kernel.BLOCK_FORMATS[fmt]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, w.shape[1] // size * per)), jnp.float32)
    def call(blocks: str, integer: bool):
        return jax.jit(lambda x, w: cpu_kernel.rowwise_matmul(x, w, None, blocks, integer=integer))

    calls = {"gguf": (call(fmt, True), jnp.asarray(w)), "gguf-exact": (call(fmt, False), jnp.asarray(w))}
    if packed := cpu_kernel.repacked_format(fmt, w.shape[0]):
        calls["gguf repacked"] = (call(packed, True), jnp.asarray(packing.pack_blocks(w, packed)))
    for f, wj in calls.values():
        f(x, wj).block_until_ready()
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, (f, wj) in calls.items():
            times[name].append(timed(lambda f=f, wj=wj: f(x, wj).block_until_ready()))
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    out = {"rows": rows, "ms": ms, "weight_gb_per_s": {n: w.nbytes / t / 1e6 for n, t in ms.items()},
           "exact_over_integer": ms["gguf-exact"] / ms["gguf"]}
    if packed:
        out["plain_over_repacked"] = ms["gguf"] / ms["gguf repacked"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--tensors", nargs="+", default=list(TENSORS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--name", default="block_matmul")
    args = ap.parse_args()
    path = args.model or str(default_model_path())
    results = []
    for name, (fmt, w) in blocks(path, args.tensors).items():
        for rows in args.rows:
            r = {"tensor": name, "format": fmt, "shape": [w.shape[0], w.shape[1] // cpu_kernel.BLOCK_FORMATS[fmt][1]
                                                          * cpu_kernel.BLOCK_FORMATS[fmt][0]],
                 **time_matrix(fmt, w, rows, max(3, args.reps // (4 if w.nbytes > 50e6 else 1)))}
            results.append(r)
            repacked = f", repacked {r['ms']['gguf repacked']:8.2f} ms" if "gguf repacked" in r["ms"] else ""
            print(f"{name:26} {fmt:5} {r['shape']} rows {rows:4}: integer {r['ms']['gguf']:8.2f} ms{repacked}, exact "
                  f"{r['ms']['gguf-exact']:8.2f} ms ({r['exact_over_integer']:.2f}x)", flush=True)
    print(f"wrote {write_result(args.name, {'model': path, 'isa': cpu_kernel.int_dot_isa(), 'results': results})}")


if __name__ == "__main__":
    main()
