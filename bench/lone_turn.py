"""Where a lone stream's turn goes, at each lane count: the Scheduler in-process, on the engine a station of those
lanes plans (default model and settings, a fixed --max-seq), one request at a time, repetitions interleaved.

Per decode turn (medians of each request's median, microseconds): `host` (Engine.decode's work before the compiled
step is called: the rows' arrays), `dispatch` (the call of `steps.step_rows` until it returns), `wait` (from there to
Engine.decode's return: the step's compute not yet done, and reading the samples back), `between` (the decode
thread's work between two decode calls: the scheduler's turn) and `per_token` (the request's decode time per token,
as the reply's timing gives it). A wider station's lone row runs a 1-wide wave; the 1-lane station's is its full wave.
`python_only` is `host` with the compiled step replaced by a stub (after the requests): Engine.decode's Python alone.
The engines share the process, which slows the 32-lane one's turn; `--lanes 32` alone gives a station's own figures.

Usage:
  python -m bench.lone_turn                   # lanes 1 8 32, max_seq 2048, 6 reps of 128 new tokens
  python -m bench.lone_turn --lanes 32 --reps 4   # one engine in the process
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import planned_model, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    from jaxstation.config.plan import planned_engine
    from jaxstation.config.settings import StationConfig
    from jaxstation.engine import engine as engine_module
    from jaxstation.engine.jobs import Job
    from jaxstation.engine.scheduler import Scheduler

    marks: list[tuple[str, float, float]] = []
    step_rows = engine_module.step_rows

    def timed_step(*a, **kw):
        t0 = time.perf_counter()
        out = step_rows(*a, **kw)
        marks.append(("step", t0, time.perf_counter()))
        return out

    engine_module.step_rows = timed_step
    scheds = {}
    for n in args.lanes:
        model, plan = planned_model(lanes=n, max_seq=args.max_seq)
        engine = planned_engine(model, StationConfig(lanes=n, max_seq=args.max_seq), plan)
        engine.warmup()

        def decode(rows, *a, _decode=engine.decode, **kw):
            t0 = time.perf_counter()
            out = _decode(rows, *a, **kw)
            marks.append(("decode", t0, time.perf_counter()))
            return out

        engine.decode = decode
        scheds[n] = Scheduler(engine, continuous=True, max_queue=4, terminal_ids=frozenset())
        scheds[n].start()
    parts = ("host", "dispatch", "wait", "between", "per_token")
    got: dict[int, dict[str, list[float]]] = {n: {p: [] for p in parts} for n in args.lanes}
    for rep in range(args.reps):
        for n, sched in scheds.items():
            prompt = [(7 * i + 11 + 13 * rep) % 4000 + 100 for i in range(32)]
            job = Job(tokens=prompt, max_new_tokens=args.new_tokens, stop_ids=frozenset())
            marks.clear()
            sched.submit(job)
            timing = job.future.result().timing
            decodes = [m for m in marks if m[0] == "decode"]
            steps = [m for m in marks if m[0] == "step"][-len(decodes):]  # the prefill's step comes first
            turn = {"host": [s[1] - d[1] for d, s in zip(decodes, steps, strict=True)],
                    "dispatch": [s[2] - s[1] for s in steps],
                    "wait": [d[2] - s[2] for d, s in zip(decodes, steps, strict=True)],
                    "between": [b[1] - a[2] for a, b in zip(decodes, decodes[1:], strict=False)],
                    "per_token": [(timing["total_s"] - timing["ttft_s"]) / (args.new_tokens - 1)]}
            for p in parts:
                got[n][p].append(statistics.median(turn[p]))
    for sched in scheds.values():
        sched.drain(10)
    rows = {str(n): {p: 1e6 * statistics.median(got[n][p]) for p in parts} for n in args.lanes}
    for n, sched in scheds.items():
        rows[str(n)]["python_only"] = 1e6 * python_only(sched.engine, engine_module)
    parts += ("python_only",)
    print(f"{'lanes':>5} " + " ".join(f"{p:>11}" for p in parts) + "   (us)")
    for n in args.lanes:
        print(f"{n:5d} " + " ".join(f"{rows[str(n)][p]:11.1f}" for p in parts))
    print(f"wrote {write_result('lone_turn', {'args': vars(args), 'lanes': rows})}")


class _Reached(Exception):
    pass


def python_only(engine, engine_module, calls: int = 2000) -> float:
    """Median seconds from Engine.decode's call of a lone row (lane 0) to its call of the compiled step (a stub)."""
    from jaxstation.engine.rows import DecodeRow, SamplingParams

    reached: list[float] = []

    def stub(*a, **kw):
        reached.append(time.perf_counter())
        raise _Reached

    engine_module.step_rows, rows, took = stub, [None] * engine.lanes, []
    rows[0] = DecodeRow(5, 10, SamplingParams(), 0, None)
    for _ in range(calls):
        t0 = time.perf_counter()
        try:
            engine.decode(rows)
        except _Reached:
            took.append(reached[-1] - t0)
    return statistics.median(took)


if __name__ == "__main__":
    main()
