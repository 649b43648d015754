"""Time the decode step with the CPU kernels' workers spinning for each of several times after a job (0: XLA's
intra-op pool runs the kernels' items), interleaved in one process (one block of steps per value in turn, every round)
so that whatever else runs on the machine weighs on every value alike.

Usage:
  python -m bench.kernel_spin [--spin-us 0 50 100 200] [--lanes 1 8] [--rounds 10] [--steps 20] [--live 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import add_model_args, bench_model, write_result
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, SamplingParams
from jaxstation.kernels import cpu_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--spin-us", type=int, nargs="+", default=[0, 50, 100, 200])
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20, help="steps a block, one block per value a round")
    ap.add_argument("--live", type=int, default=512)
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--name", default="kernel_spin", help="result file name")
    args = ap.parse_args()
    model, engine_kw = bench_model(args, args.max_seq)
    rows = []
    for lanes in args.lanes:
        engine = Engine(model, lanes=lanes, max_seq=args.max_seq, chunk=32, block=128, **engine_kw)
        engine.warmup()
        wave = [DecodeRow(1, args.live - 1, SamplingParams(), 0)] * lanes
        blocks = {us: [] for us in args.spin_us}  # median ms per step of each block
        for _ in range(args.rounds):
            for us in args.spin_us:
                cpu_kernel.set_spin_us(us)
                engine.decode(wave)  # the first step after a switch is not timed
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    engine.decode(wave)
                    times.append(time.perf_counter() - t0)
                blocks[us].append(1e3 * statistics.median(times))
        base = statistics.median(blocks[args.spin_us[0]])
        for us, ms in blocks.items():
            paired = statistics.median(a / b for a, b in zip(ms, blocks[args.spin_us[0]], strict=True))
            row = {"lanes": lanes, "spin_us": us, "ms_per_step": statistics.median(ms), "spread_ms": [min(ms), max(ms)],
                   "blocks": ms, "over_first": statistics.median(ms) / base, "paired_over_first": paired}
            rows.append(row)
            print(f"lanes {lanes:2d} spin {us:4d} us: {row['ms_per_step']:6.2f} ms/step (blocks {min(ms):.2f}.."
                  f"{max(ms):.2f}), {row['over_first']:.3f} x spin {args.spin_us[0]} us, a round's ratio's median "
                  f"{paired:.3f}")
        del engine
    cpu_kernel.set_spin_us(cpu_kernel.SPIN_US)
    print(f"wrote {write_result(args.name, {'config': vars(args), 'model': str(model.source), 'rows': rows})}")


if __name__ == "__main__":
    main()
