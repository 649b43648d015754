"""The roofline: this machine's memory bandwidth and matmul throughput, the fastest a decode step could be, and how
close each measured step gets.

Bandwidth: numpy copy and a compiled XLA read (bench.common); the limit uses the larger. Compute: a jitted float32
matmul, GFLOP/s. Minimum step time for lanes x live = max((weight bytes + live KV bytes) / bandwidth,
step FLOPs / matmul FLOP/s), live KV bytes = lanes x live x (2 x layers x kv_heads x head_dim x itemsize). Each
measured step (engine.decode timed like bench/step.py, or with --from-step the model's canonical
bench/results/step-<model>.json)
is reported as limit / measured: 1.0 would be at the roofline.

Usage:
  python -m bench.roofline                        # lanes 1 2 4 8 16 x live 128 1024, 10 reps
  python -m bench.roofline --quick                # lanes 1 8 x live 128, 3 reps
  python -m bench.roofline --from-step            # read the steps of bench/results/step-<model>.json
"""

from __future__ import annotations

import argparse
import json
import math

from bench.common import (
    add_model_args,
    bench_model,
    copy_bandwidth,
    model_name,
    read_bandwidth,
    result_path,
    summary,
    timed,
    write_result,
)


def matmul_flops(n: int, reps: int) -> float:
    """float32 matmul throughput, FLOP/s (best of reps) of a jitted n x n @ n x n."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    b = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, b).block_until_ready()
    return 2 * n ** 3 / min(timed(lambda: mm(a, b).block_until_ready()) for _ in range(reps))


def step_flops(cfg, lanes: int, live: int) -> float:
    """FLOPs of one decode wave: 2 x matmul weights per token, plus attention over `live` positions."""
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    per_layer = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * d + 3 * d * f
    matmul = cfg.num_layers * per_layer + cfg.vocab_size * d  # + the lm_head
    attention = cfg.num_layers * cfg.num_heads * hd * live * 2  # q.k and p.v
    return 2.0 * lanes * (matmul + attention)


def measured_steps(model, lanes_list, live_list, reps: int, engine_kw: dict) -> list[dict]:
    from jaxstation.engine.engine import Engine
    from jaxstation.engine.rows import DecodeRow, SamplingParams

    rows = []
    max_seq = 128 * math.ceil((max(live_list) + 1) / 128)
    for lanes in lanes_list:
        engine = Engine(model, lanes=lanes, max_seq=max_seq, chunk=32, block=128, **engine_kw)
        engine.warmup()
        for live in live_list:
            wave = [DecodeRow(1, live - 1, SamplingParams(), 0)] * lanes
            engine.decode(wave)
            s = summary([timed(lambda e=engine, w=wave: e.decode(w)) for _ in range(reps)])
            rows.append({"lanes": lanes, "live": live, "ms_per_step": 1e3 * s["median"],
                         "spread_ms": [1e3 * s["min"], 1e3 * s["max"]]})
            print(f"measured lanes {lanes:2d} live {live:5d}: {rows[-1]['ms_per_step']:.1f} ms/step")
    return rows


def from_step_file(model: str) -> tuple[list[dict], str]:
    """The steps of the model's canonical `bench.step` result, and its file's name."""
    path = result_path("step", model)
    if not path.exists():
        raise SystemExit(f"no {path}: run `python -m bench.step` first, or drop --from-step")
    data = json.loads(path.read_text())
    return [{k: r[k] for k in ("lanes", "live", "ms_per_step", "spread_ms")} for r in data["rows"]], path.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--live", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--matmul-n", type=int, default=2048)
    add_model_args(ap)
    ap.add_argument("--from-step", action="store_true", help="read the model's step-<model>.json instead of timing")
    ap.add_argument("--quick", action="store_true", help="lanes 1 8, live 128, 3 reps, 1024 matmul")
    args = ap.parse_args()
    if args.quick:
        args.lanes, args.live, args.reps, args.matmul_n = [1, 8], [128], 3, 1024

    import jax.numpy as jnp

    from jaxstation.model.quant import compute_dtype

    model, engine_kw = bench_model(args, 128 * math.ceil((max(args.live) + 1) / 128))
    cfg = model.cfg
    weight_bytes = model.params.nbytes
    itemsize = jnp.dtype(compute_dtype(args.dtype)).itemsize  # the arena's
    kv_per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize  # k and v, one lane, one position
    copy_bw, read_bw = copy_bandwidth(), read_bandwidth()
    bandwidth = max(copy_bw, read_bw)
    flops = matmul_flops(args.matmul_n, max(3, args.reps))
    print(f"weights {weight_bytes / 1e6:.0f} MB, KV {kv_per_pos / 1e3:.1f} kB/position; copy {copy_bw / 1e9:.1f} GB/s, "
          f"read {read_bw / 1e9:.1f} GB/s, matmul {flops / 1e9:.1f} GFLOP/s (f32, n={args.matmul_n})")

    if args.from_step:
        measured, source = from_step_file(model_name(args.model, args.shape))
    else:
        measured, source = measured_steps(model, args.lanes, args.live, args.reps, engine_kw), "measured here"
    rows = []
    for m in measured:
        lanes, live = m["lanes"], m["live"]
        kv = lanes * live * kv_per_pos
        mem_ms = 1e3 * (weight_bytes + kv) / bandwidth
        compute_ms = 1e3 * step_flops(cfg, lanes, live) / flops
        limit_ms = max(mem_ms, compute_ms)
        rows.append({**m, "kv_bytes": kv, "memory_limit_ms": mem_ms, "compute_limit_ms": compute_ms,
                     "limit_ms": limit_ms, "bound": "memory" if mem_ms >= compute_ms else "compute",
                     "fraction_of_roofline": limit_ms / m["ms_per_step"],
                     "fraction_of_memory_limit": mem_ms / m["ms_per_step"]})
    print(f"\nsteps: {source}\n| lanes | live | measured ms | memory min ms | compute min ms | bound | of roofline |")
    print("|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['lanes']} | {r['live']} | {r['ms_per_step']:.1f} | {r['memory_limit_ms']:.1f} | "
              f"{r['compute_limit_ms']:.1f} | {r['bound']} | {100 * r['fraction_of_roofline']:.0f}% |")
    path = write_result("roofline", {"dtype": args.dtype, "weight_bytes": weight_bytes, "kv_bytes_per_position":
                                     kv_per_pos, "copy_bandwidth": copy_bw, "read_bandwidth": read_bw,
                                     "bandwidth": bandwidth, "matmul_flops": flops, "matmul_n": args.matmul_n,
                                     "steps_source": source, "rows": rows},
                        model=model_name(args.model, args.shape), read_bandwidth=read_bw)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
