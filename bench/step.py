"""Time `step_rows` at several lane counts and live lengths, on the default model or a named shape.

Reports ms per step, tokens/s and the weight bandwidth achieved against the measured bandwidth (the roofline).
With --tensor-parallel, the model is split over each number of devices in turn (docs/sharding.md), and each row also
gives the bytes one device reads a step: its share of the weights and of the live KV. On CPU the devices are virtual
(set JAX_NUM_CPU_DEVICES to the largest N) and share the machine's cores: that measures the split's overhead, not a
speed-up.
Usage:
  python -m bench.step [--reps 10] [--dtype float32]
  python -m bench.step --shape mistral-7b --lanes 1 8 32 64 --live 512 2048 --max-seq 4096   # random weights
  python -m bench.step --model gemma-3-270m.gguf --lanes 1 8 --live 4095 --max-seq 4096 --kv-windows full
  JAX_NUM_CPU_DEVICES=4 python -m bench.step --shape qwen3-0.6b --dtype float32 --tensor-parallel 1 2 4 --lanes 1 8
"""

from __future__ import annotations

import argparse
import dataclasses

import jax

from bench.common import add_model_args, bench_model, copy_bandwidth, read_bandwidth, summary, timed, write_result
from jaxstation.engine.arena import arena_bytes
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, SamplingParams
from jaxstation.model.sharding import device_bytes, make_mesh, shard_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    add_model_args(ap)
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--live", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--tensor-parallel", type=int, nargs="+", default=[1], help="devices to split the model over")
    ap.add_argument("--kv-windows", default="ring", help="windowed layers' KV: ring or full")
    ap.add_argument("--kv-dtype", default="auto", help="the arena's dtype: auto, float32, bfloat16 or int8")
    ap.add_argument("--vocab-replicated", action="store_true",
                    help="keep the embedding and the head whole on every device (default: split by vocabulary rows)")
    ap.add_argument("--name", default="step", help="result file name")
    args = ap.parse_args()

    copy_bw, read_bw = copy_bandwidth(), read_bandwidth()
    # the roofline: a decode step only has to read its bytes (on an accelerator, from its own memory)
    bandwidth = max(copy_bw, read_bw) if jax.default_backend() == "cpu" else read_bw
    rows, models = [], {}
    for n in args.tensor_parallel:
        model, engine_kw = bench_model(args, args.max_seq, n)
        if args.vocab_replicated and n > 1:
            model = dataclasses.replace(model, params=shard_params(model.params, make_mesh(n), vocab=False))
        models[n] = {"weight_bytes": model.params.nbytes, "weight_bytes_per_device": device_bytes(model.params)}
        print(f"{model.source}: {args.dtype}, layer loop {args.layer_loop}, matmul {args.matmul}, attention "
              f"{args.attention}, tensor_parallel {n}; weights {model.params.nbytes / 1e6:.0f} MB, "
              f"{models[n]['weight_bytes_per_device'] / 1e6:.0f} MB a device")
        rows += sweep(args, model, engine_kw, n, bandwidth)

    one, widest, lo, hi = min(args.lanes), max(args.lanes), min(args.live), max(args.live)
    by = {(r["tensor_parallel"], r["lanes"], r["live"]): r["ms_per_step"] for r in rows}
    first = args.tensor_parallel[0]
    checks = {f"{one}_lane_at_{lo}_over_floor": by[first, one, lo] / rows[0]["floor_ms"],
              f"{widest}_lane_at_{hi}_over_{one}_lane_at_{lo}": by[first, widest, hi] / by[first, one, lo]}
    for n in args.tensor_parallel[1:]:
        checks[f"tp{n}_over_tp{first}_{widest}_lanes_at_{hi}"] = by[n, widest, hi] / by[first, widest, hi]
    print({k: round(v, 2) for k, v in checks.items()})
    path = write_result(args.name, {"config": vars(args), "model": str(model.source), "dtype": args.dtype,
                                    "weight_bytes": models[first]["weight_bytes"], "per_tensor_parallel": models,
                                    "copy_bandwidth": copy_bw, "read_bandwidth": read_bw,
                                    "floor_ms": rows[0]["floor_ms"], "rows": rows, "ratios": checks})
    print(f"wrote {path}")


def sweep(args, model, engine_kw: dict, n: int, bandwidth: float) -> list[dict]:
    """One row per lane count and live length: ms per step of a full decode wave, and the bytes one device reads."""
    weights = device_bytes(model.params)
    floor_ms = 1e3 * weights / bandwidth
    rows = []
    for lanes in args.lanes:
        engine = Engine(model, lanes=lanes, max_seq=args.max_seq, chunk=32, block=128, kv_windows=args.kv_windows,
                        kv_dtype=args.kv_dtype, **engine_kw)
        engine.warmup()
        for live in args.live:
            wave = [DecodeRow(1, live - 1, SamplingParams(), 0)] * lanes
            engine.decode(wave)
            s = summary([timed(lambda e=engine, w=wave: e.decode(w)) for _ in range(args.reps)])
            ms = 1e3 * s["median"]
            kv = arena_bytes(model.cfg, lanes, live, engine.kv_dtype, engine.ring, engine.windowed) // n  # live k, v
            row = {"tensor_parallel": n, "lanes": lanes, "live": live, "ms_per_step": ms,
                   "spread_ms": [1e3 * s["min"], 1e3 * s["max"]], "tokens_per_s": lanes / s["median"],
                   "weight_bytes_per_device": weights, "kv_bytes_per_device": kv, "arena_bytes": engine.arena.nbytes,
                   "weight_gb_per_s": weights / s["median"] / 1e9, "floor_ms": floor_ms,
                   "fraction_of_roofline": floor_ms / ms}
            rows.append(row)
            print(f"tp {n} lanes {lanes:2d} live {live:5d}: {ms:7.1f} ms/step  {row['tokens_per_s']:7.1f} tok/s  "
                  f"{(weights + kv) / 1e6:6.0f} MB a device  ({100 * row['fraction_of_roofline']:.0f}% of roofline)")
        del engine
    return rows


if __name__ == "__main__":
    main()
