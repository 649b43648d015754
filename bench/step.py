"""Time `decode_step_batch` for lanes 1, 2, 4, 8, 16 at live lengths 128 and 1024 on the default model.

Reports ms per step, tokens/s and the weight bandwidth achieved against the measured copy bandwidth (the roofline).
Usage: python -m bench.step [--reps 10] [--dtype float32]
"""

from __future__ import annotations

import argparse

from bench.common import copy_bandwidth, read_bandwidth, summary, timed, write_result
from jaxstation.engine import DecodeRow, Engine, SamplingParams
from jaxstation.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--live", type=int, nargs="+", default=[128, 1024])
    args = ap.parse_args()

    model = load_model(dtype=args.dtype)
    weight_bytes = model.params.nbytes
    copy_bw, read_bw = copy_bandwidth(), read_bandwidth()
    bandwidth = max(copy_bw, read_bw)  # the roofline: a decode step only has to read its bytes
    floor_ms = 1e3 * weight_bytes / bandwidth
    print(f"weights {weight_bytes / 1e6:.0f} MB, copy {copy_bw / 1e9:.1f} GB/s, read {read_bw / 1e9:.1f} GB/s, "
          f"floor {floor_ms:.1f} ms")
    rows = []
    for lanes in args.lanes:
        engine = Engine(model, lanes=lanes, max_seq=2048, chunk=32, block=128)
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
    checks = {}
    if (1, 128) in by and (8, 128) in by:
        checks["8_lane_over_1_lane_at_128"] = by[8, 128] / by[1, 128]
    if (1, 128) in by:
        checks["1_lane_over_floor"] = by[1, 128] / floor_ms
    if (8, 128) in by and (8, 1024) in by:
        checks["8_lane_1024_over_128"] = by[8, 1024] / by[8, 128]
    print({k: round(v, 2) for k, v in checks.items()})
    path = write_result("step", {"dtype": args.dtype, "weight_bytes": weight_bytes, "copy_bandwidth": copy_bw,
                                 "read_bandwidth": read_bw,
                                 "floor_ms": floor_ms, "rows": rows, "ratios": checks})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
