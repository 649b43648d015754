"""Bitwise batch invariance at a real shape: a target's logits alone in lane 0 against the same target in a random lane
beside neighbours of random lengths, for several cases. Writes the counts (and any mismatch) to JSON.

Usage:
  python -m bench.invariance --shape mistral-7b --dtype bfloat16 --lanes 8 --max-len 2000   # on a GPU
  python -m bench.invariance --shape smollm2-135m --lanes 4 --max-len 300 --cases 2        # a CPU smoke run
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from bench.common import add_model_args, bench_model, model_name, write_result
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, SamplingParams

STEPS = 4


def run(engine: Engine, lanes: dict[int, list[int]], steps: int) -> dict[int, list[np.ndarray]]:
    """Prefill every lane, then `steps` greedy decode waves; each lane's logits (prefill's last row, then per wave)."""
    logits: dict[int, list[np.ndarray]] = {}
    last: dict[int, int] = {}
    for lane, prompt in lanes.items():
        for start in range(0, len(prompt), engine.chunk):
            sample, lg = engine.prefill(lane, prompt, start, SamplingParams(), return_logits=True)
        logits[lane], last[lane] = [np.asarray(lg, np.float32)[0]], sample.token
    for step in range(steps):
        rows: list[DecodeRow | None] = [None] * engine.lanes
        for lane, prompt in lanes.items():
            rows[lane] = DecodeRow(last[lane], len(prompt) + step, SamplingParams(), step + 1)
        samples, lg = engine.decode(rows, return_logits=True)
        for lane in lanes:
            logits[lane].append(np.asarray(lg, np.float32)[lane])
            last[lane] = samples[lane].token
    return logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2000, help="neighbours' longest prompt")
    ap.add_argument("--target-len", type=int, default=100)
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    max_seq = 128 * math.ceil((args.max_len + STEPS + 1) / 128)
    model, engine_kw = bench_model(args, max_seq)
    engine = Engine(model, lanes=args.lanes, max_seq=max_seq, chunk=32, block=128, **engine_kw)
    rng = np.random.default_rng(args.seed)
    target = rng.integers(3, model.cfg.vocab_size, args.target_len).tolist()
    alone = run(engine, {0: target}, STEPS)[0]
    cases = []
    for case in range(args.cases):
        lane = int(rng.integers(0, args.lanes))
        lanes = {lane: target}
        for other in range(args.lanes):
            if other != lane and rng.random() < 0.8:
                lanes[other] = rng.integers(3, model.cfg.vocab_size, int(rng.integers(1, args.max_len))).tolist()
        got = run(engine, lanes, STEPS)[lane]
        diffs = [float(np.abs(a - b).max()) for a, b in zip(got, alone, strict=True)]
        equal = all(np.array_equal(a, b) for a, b in zip(got, alone, strict=True))
        cases.append({"lane": lane, "neighbours": len(lanes) - 1, "longest": max(map(len, lanes.values())),
                      "bit_equal": equal, "max_abs_diff": max(diffs)})
        print(f"case {case}: lane {lane}, {len(lanes) - 1} neighbours up to {cases[-1]['longest']} tokens: "
              f"{'bit-equal' if equal else f'DIFFERS by {max(diffs):.3g}'}", flush=True)
    n_equal = sum(c["bit_equal"] for c in cases)
    print(f"{n_equal} of {len(cases)} cases bit-equal ({args.dtype}, {args.layer_loop}, attention {args.attention})")
    path = write_result("invariance", {"config": vars(args), "model": str(model.source), "bit_equal": n_equal,
                                       "cases": cases}, model=model_name(args.model, args.shape))
    print(f"wrote {path}")
    raise SystemExit(0 if n_equal == len(cases) else 1)


if __name__ == "__main__":
    main()
