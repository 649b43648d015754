"""What the token controls (penalties, logit_bias, min_tokens) cost a decode step, measured in one process.

Three compiled variants of the same `step_rows`, arguments already on the device, timed round-robin so that
drift hits them alike:
- none: no penalty machinery in the program at all (penalties=None), the baseline;
- idle: the machinery, no row asking for a control (what a request without controls pays: a wave-wide predicate
  and a one-element count update per row);
- active: every row with presence, frequency and repetition penalties, a logit bias and min_tokens.
Also `Engine.decode` (host side included) idle and active, and `Engine.begin` (a request's lane state, once per
request). Writes bench/results/penalty_cost-<date>-<machine>.json.
Usage:
  python -m bench.penalty_cost [--lanes 1 8 32] [--live 512] [--reps 20]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from bench.common import add_lane_sweep_args, add_model_args, bench_model, summary, timed, write_result
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, SamplingParams, penalty_arrays, sampling_arrays
from jaxstation.engine.steps import step_rows

CONTROLLED = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                            logit_bias=tuple((t, 2.0) for t in range(0, 3000, 10)), min_tokens=4)


def measure(engine: Engine, live: int, reps: int) -> dict:
    lanes, cfg, params = engine.lanes, engine.cfg, engine.params
    prompt = list(range(1, live))
    for lane in range(lanes):
        engine.begin(lane, prompt, CONTROLLED, frozenset({0}))
    pos, tok = np.full(lanes, live - 1, np.int32), np.ones(lanes, np.int32)
    n_blocks = np.int32((live - 1) // engine.block + 1)
    plain = [(SamplingParams(), 1)] * lanes
    unmasked = [None] * lanes
    args = {"none": (sampling_arrays(plain), None),
            "idle": (sampling_arrays(plain), penalty_arrays(plain, cfg.vocab_size, unmasked)),
            "active": (sampling_arrays([(CONTROLLED, 1)] * lanes),
                       penalty_arrays([(CONTROLLED, 1)] * lanes, cfg.vocab_size, unmasked))}
    args = {k: jax.device_put((pos, tok, n_blocks, s, p)) for k, (s, p) in args.items()}

    def step(mode: str) -> None:
        pos, tok, n_blocks, s, p = args[mode]
        engine.arena, out, _ = step_rows(cfg, params, engine.arena, pos, tok, n_blocks, s, None, p,
                                         block=engine.block, attention=engine.attention)
        jax.block_until_ready(out)

    def begin() -> None:
        engine.begin(0, prompt, CONTROLLED, frozenset({0}))
        jax.block_until_ready(engine.arena.tokens)

    waves = {"engine_idle": [DecodeRow(1, live - 1, SamplingParams(), 1)] * lanes,
             "engine_active": [DecodeRow(1, live - 1, CONTROLLED, 1)] * lanes}
    runs = {**{m: (lambda m=m: step(m)) for m in args},
            **{m: (lambda w=w: engine.decode(w)) for m, w in waves.items()}, "begin": begin}
    for run in runs.values():  # compile and warm each
        run()
        run()
    samples: dict[str, list[float]] = {m: [] for m in runs}
    for _ in range(reps):
        for m, run in runs.items():
            samples[m].append(timed(run))
    out = {m: {k: (1e3 * v if k != "n" else v) for k, v in summary(s).items()} for m, s in samples.items()}
    med = {m: out[m]["median"] for m in out}
    out["ratios"] = {"idle_over_none": med["idle"] / med["none"], "active_over_none": med["active"] / med["none"],
                     "engine_active_over_idle": med["engine_active"] / med["engine_idle"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    add_lane_sweep_args(ap, reps=20, name="penalty_cost")
    args = ap.parse_args()
    model, engine_kw = bench_model(args, args.max_seq)
    print(f"{model.source}: {args.dtype}, layer loop {args.layer_loop}, matmul {args.matmul}, "
          f"attention {args.attention}, vocab {model.cfg.vocab_size}")
    rows = []
    for lanes in args.lanes:
        engine = Engine(model, lanes=lanes, max_seq=args.max_seq, chunk=32, block=128, **engine_kw)
        r = measure(engine, args.live, args.reps)
        rows.append({"lanes": lanes, "live": args.live, **r})
        times = "  ".join(f"{m} {v['median']:.2f} ms" for m, v in r.items() if m != "ratios")
        print(f"lanes {lanes:2d}: {times}  {({k: round(v, 3) for k, v in r['ratios'].items()})}")
    path = write_result(args.name, {"config": vars(args), "model": str(model.source), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
