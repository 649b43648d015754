"""The CPU levers side by side, in one process with interleaved repetitions (so the ratios hold on a busy machine):
weights float32 or int8, the layer walk scan or unroll, the matmul (XLA's dot or the CPU kernel), and the sampling
filter (top-p by a vocabulary sort, or by bisection, as the JAX path does) at 1, 8 and 32 lanes. Each decode runs a
full-width wave of `lanes` rows. XLA flags need a process of their own: run it again with XLA_FLAGS set and --name.

Usage:
  python -m bench.levers
  XLA_FLAGS=--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY python -m bench.levers \\
      --name levers_xnn_greedy
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import summary, write_result
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, SamplingParams, sampling_arrays
from jaxstation.engine.sampling import _filter_mask
from jaxstation.model.loader import load_model


def sort_filter(scaled: jax.Array, s) -> jax.Array:
    """The previous top-k / top-p / min-p filter: a full sort of the vocabulary per row."""
    vocab = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    kth = jnp.take_along_axis(desc, jnp.clip(s.top_k - 1, 0, vocab - 1)[:, None], axis=-1)
    keep = jnp.where(s.top_k[:, None] > 0, scaled >= kth, True)
    probs_desc = jax.nn.softmax(desc, axis=-1)
    exclusive = jnp.cumsum(probs_desc, axis=-1) - probs_desc
    n_keep = jnp.maximum(jnp.sum(exclusive < s.top_p[:, None], axis=-1), 1)
    keep &= jnp.where(s.top_p[:, None] < 1.0, scaled >= jnp.take_along_axis(desc, (n_keep - 1)[:, None], -1), True)
    m_cut = desc[:, :1] + jnp.log(jnp.maximum(s.min_p[:, None], 1e-30))
    return keep & jnp.where(s.min_p[:, None] > 0.0, scaled >= m_cut, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--unroll-lanes", type=int, nargs="+", default=[1, 8], help="lanes at which unroll is tried")
    ap.add_argument("--live", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--name", default="levers")
    args = ap.parse_args()
    # (weights, layer walk, matmul, decode attention); the last of each dtype is the CPU default now
    combos = [("float32", "scan", "xla", "blocked"), ("float32", "unroll", "xla", "blocked"),
              ("float32", "unroll", "kernel", "blocked"), ("float32", "unroll", "kernel", "kernel"),
              ("int8", "scan", "xla", "blocked"), ("int8", "unroll", "kernel", "blocked"),
              ("int8", "unroll", "kernel", "kernel")]
    models = {c[:3]: load_model(dtype=c[0], layer_loop=c[1], matmul=c[2]) for c in combos}
    rows = []
    for lanes in args.lanes:
        variants: dict[str, object] = {}
        wave = [DecodeRow(1, args.live - 1, SamplingParams(), 0)] * lanes
        t_compile = {}
        for w, loop, matmul, attention in combos:
            if loop == "unroll" and matmul == "xla" and lanes not in args.unroll_lanes:
                continue
            name = f"{w} {loop} {matmul} {attention}"
            t0 = time.perf_counter()
            engine = Engine(models[w, loop, matmul], lanes=lanes, max_seq=512, chunk=32, block=128,
                            attention=attention)
            engine.decode(wave)
            t_compile[name] = time.perf_counter() - t0
            variants[name] = lambda e=engine, rows=wave: e.decode(rows)
        cfg = models["float32", "scan", "xla"].cfg
        scaled = jnp.asarray(np.random.default_rng(0).standard_normal((lanes, cfg.vocab_size)), jnp.float32)
        s = jax.tree_util.tree_map(jnp.asarray, sampling_arrays(
            [(SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1), 0)] * lanes))
        for name, fn in (("filter by sort", sort_filter), ("filter by bisection", _filter_mask)):
            f = jax.jit(fn)
            f(scaled, s).block_until_ready()
            variants[name] = lambda f=f, x=scaled, sa=s: f(x, sa).block_until_ready()
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.reps):
            for k, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        base = float(np.median(times["float32 scan xla blocked"]))
        for k, ts in times.items():
            s_ = summary(ts)
            row = {"lanes": lanes, "variant": k, "ms": 1e3 * s_["median"],
                   "spread_ms": [1e3 * s_["min"], 1e3 * s_["max"]], "over_baseline": s_["median"] / base,
                   "first_call_s": t_compile.get(k)}
            rows.append(row)
            first = f"  (first call {row['first_call_s']:.0f} s)" if row["first_call_s"] else ""
            print(f"lanes {lanes:2d} {k:32s} {row['ms']:8.1f} ms  x{row['over_baseline']:.2f} of float32 scan xla "
                  f"blocked{first}", flush=True)
        ms = {r["variant"]: r["ms"] for r in rows if r["lanes"] == lanes}
        best_float = min(v for k, v in ms.items() if k.startswith("float32"))
        best_int8 = min(v for k, v in ms.items() if k.startswith("int8"))
        print(f"lanes {lanes:2d} int8 / float32, both on the CPU defaults (kernel matmul and attention): "
              f"{ms['int8 unroll kernel kernel'] / ms['float32 unroll kernel kernel']:.2f}; best int8 / best float32: "
              f"{best_int8 / best_float:.2f}")
    path = write_result(args.name, {"config": vars(args), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                                    "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
