"""Time `step_rows` at several lane counts and live lengths, on the default model or a named shape.

Reports ms per step, tokens/s and the weight bandwidth achieved against the measured bandwidth (the roofline).
Usage:
  python -m bench.step [--reps 10] [--dtype float32]
  python -m bench.step --shape mistral-7b --lanes 1 8 32 64 --live 512 2048 --max-seq 4096   # random weights
"""

from __future__ import annotations

import argparse

import jax

from bench.common import add_model_args, bench_model, copy_bandwidth, read_bandwidth, summary, timed, write_result
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    add_model_args(ap)
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--live", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--name", default="step", help="result file name")
    args = ap.parse_args()

    model, engine_kw = bench_model(args, args.max_seq)
    weight_bytes = model.params.nbytes
    print(f"{model.source}: {args.dtype}, layer loop {args.layer_loop}, matmul {args.matmul}, "
          f"attention {args.attention}")
    copy_bw, read_bw = copy_bandwidth(), read_bandwidth()
    # the roofline: a decode step only has to read its bytes (on an accelerator, from its own memory)
    bandwidth = max(copy_bw, read_bw) if jax.default_backend() == "cpu" else read_bw
    floor_ms = 1e3 * weight_bytes / bandwidth
    print(f"weights {weight_bytes / 1e6:.0f} MB, copy {copy_bw / 1e9:.1f} GB/s, read {read_bw / 1e9:.1f} GB/s, "
          f"floor {floor_ms:.1f} ms")
    rows = []
    for lanes in args.lanes:
        engine = Engine(model, lanes=lanes, max_seq=args.max_seq, chunk=32, block=128, **engine_kw)
        engine.warmup()
        for live in args.live:
            wave = [DecodeRow(1, live - 1, SamplingParams(), 0)] * lanes
            engine.decode(wave)
            s = summary([timed(lambda e=engine, w=wave: e.decode(w)) for _ in range(args.reps)])
            ms = 1e3 * s["median"]
            row = {"lanes": lanes, "live": live, "ms_per_step": ms, "spread_ms": [1e3 * s["min"], 1e3 * s["max"]],
                   "tokens_per_s": lanes / s["median"], "weight_gb_per_s": weight_bytes / s["median"] / 1e9,
                   "fraction_of_roofline": floor_ms / ms}
            rows.append(row)
            print(f"lanes {lanes:2d} live {live:5d}: {ms:7.1f} ms/step  {row['tokens_per_s']:7.1f} tok/s  "
                  f"{row['weight_gb_per_s']:5.1f} GB/s weights ({100 * row['fraction_of_roofline']:.0f}% of roofline)")

    by = {(r["lanes"], r["live"]): r["ms_per_step"] for r in rows}
    lo, hi = min(args.live), max(args.live)
    one, widest = min(args.lanes), max(args.lanes)
    checks = {f"{one}_lane_at_{lo}_over_floor": by[one, lo] / floor_ms}
    if 8 in args.lanes:
        checks[f"8_lane_over_{one}_lane_at_{lo}"] = by[8, lo] / by[one, lo]
        checks[f"8_lane_{hi}_over_{lo}"] = by[8, hi] / by[8, lo]
    checks[f"{widest}_lane_at_{hi}_over_{one}_lane_at_{lo}"] = by[widest, hi] / by[one, lo]
    print({k: round(v, 2) for k, v in checks.items()})
    path = write_result(args.name, {"config": vars(args), "model": str(model.source), "dtype": args.dtype,
                                    "weight_bytes": weight_bytes, "copy_bandwidth": copy_bw,
                                 "read_bandwidth": read_bw,
                                 "floor_ms": floor_ms, "rows": rows, "ratios": checks})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
