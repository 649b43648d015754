"""Where one decode step's time goes, operation by operation: a JAX profiler trace of lone-row decode steps.

Traces `--steps` decode steps of a lone row (live `--live` positions) on an engine of `--lanes` lanes, the model
loaded as a station plans it, and splits each step's compiled program into the kernel calls (XLA FFI custom calls,
grouped by their targets less the weights' format, the head apart), XLA's other operations, and the time no operation
runs. The tracer adds its own cost to every operation: compare a trace's parts with each other, and the step's time
with `bench.step`'s. Usage:
  python -m bench.step_trace
  python -m bench.step_trace --model gemma-3-270m-q4_k_m.gguf --live 512
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import tempfile
from pathlib import Path

from bench.common import write_result

WRAPPERS = ("$", "end:", "Wait for", "ThreadpoolListener", "ThunkExecutor")  # trace events that are not operations
RUN = "ThunkExecutor::Execute (wait for completion)"  # one execution of a compiled program
TRACED = 5  # steps a trace


def covered(spans: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of (start, end) spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def call_kinds(engine, rows, vocab: int) -> dict[str, str]:
    """The compiled decode step's custom calls: HLO instruction name -> its FFI target less the weights' format, or
    "head" for the call whose output spans the vocabulary."""
    from jaxstation.engine import engine as engine_module

    seen: dict = {}
    jitted = engine_module.step_rows

    def record(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return jitted(*args, **kwargs)

    engine_module.step_rows = record
    try:
        engine.decode(rows)
    finally:
        engine_module.step_rows = jitted
    text = jitted.lower(*seen["args"], **seen["kwargs"]).compile().as_text()
    found = re.findall(r'%?([\w.-]+) = ([^=\n]*?) custom-call\([^\n]*custom_call_target="jaxstation_([\w.-]+)"', text)
    return {name: "head" if re.match(rf"f32\[\d+,{vocab}\]", shape) and "matmul" in target
            else re.sub(r"_q\d\w*$", "", target) for name, shape, target in found}


def traced_steps(trace_dir: Path) -> list[tuple[float, list[dict]]]:
    """Each traced program run: (its microseconds, its operations' events in start order)."""
    path = sorted(trace_dir.glob("**/*.trace.json.gz"))[-1]
    events = [e for e in json.load(gzip.open(path))["traceEvents"] if e.get("ph") == "X"]
    ops = sorted((e for e in events if not e["name"].startswith(WRAPPERS) and not e["name"][0].isupper()),
                 key=lambda e: e["ts"])
    runs = sorted((e for e in events if e["name"] == RUN), key=lambda e: e["ts"])
    return [(r["dur"], [e for e in ops if r["ts"] <= e["ts"] <= r["ts"] + r["dur"]]) for r in runs]


def summarize(steps: list[tuple[float, list[dict]]], kinds: dict[str, str]) -> dict:
    """The medians over the step program's runs: the step, its kernel calls, its other operations and its idle time
    (microseconds), and each kind of kernel call's count and time a step."""
    calls = [sum(e["name"] in kinds for e in ops) for _, ops in steps]
    steps = [s for s, n in zip(steps, calls, strict=True) if n == max(calls)]  # whole runs of the decode step
    parts: dict[str, list[float]] = collections.defaultdict(list)
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for run_us, ops in steps:
        spans = {kind: [(e["ts"], e["ts"] + e["dur"]) for e in ops if (e["name"] in kinds) == kind]
                 for kind in (True, False)}
        parts["step_us"].append(run_us)
        parts["kernel_calls_us"].append(covered(spans[True]))
        parts["other_ops_us"].append(covered(spans[False]))
        parts["idle_us"].append(run_us - covered(spans[True] + spans[False]))
        parts["other_ops"].append(len(spans[False]))
        totals: collections.Counter = collections.Counter()
        for e in (e for e in ops if e["name"] in kinds):
            totals[kinds[e["name"]]] += e["dur"]
        for kind, us in totals.items():
            by_kind[kind].append(us)
    counts = collections.Counter(kinds[e["name"]] for e in steps[0][1] if e["name"] in kinds)
    return {**{k: statistics.median(v) for k, v in parts.items()}, "runs": len(steps),
            "kernel_calls": {kind: {"calls": counts[kind], "us": statistics.median(v)} for kind, v in
                             sorted(by_kind.items(), key=lambda kv: -statistics.median(kv[1]))}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a checkpoint (default: the default model)")
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--live", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--name", default="step_trace")
    args = ap.parse_args()
    import jax

    from jaxstation.config.plan import load_planned, planned_engine, resolve_plan
    from jaxstation.config.settings import StationConfig
    from jaxstation.engine.rows import DecodeRow, SamplingParams
    from jaxstation.model.loader import checkpoint_config

    config = StationConfig(lanes=args.lanes, max_seq=128 * (args.live // 128 + 1),
                           **({"model": args.model} if args.model else {}))
    plan = resolve_plan(config, checkpoint_config(config.model))
    model = load_planned(config, plan)
    engine = planned_engine(model, config, plan)
    rows = [DecodeRow(1, args.live - 1, SamplingParams(), 0)] + [None] * (args.lanes - 1)
    kinds = call_kinds(engine, rows, model.cfg.vocab_size)
    for _ in range(20):
        engine.decode(rows)
    steps = []
    for _ in range(0, args.steps, TRACED):  # short traces: a long one loses events
        with tempfile.TemporaryDirectory() as tmp:
            jax.profiler.start_trace(tmp, create_perfetto_trace=True)
            for _ in range(TRACED + 2):
                engine.decode(rows)
            jax.profiler.stop_trace()
            steps += traced_steps(Path(tmp))[2:]  # the first two overlap the tracer's start
    out = summarize(steps, kinds)
    print(f"{model.source}: {args.lanes} lanes, live {args.live}, {out['runs']} whole steps traced; medians, us")
    print(f"step {out['step_us']:.0f}: kernel calls {out['kernel_calls_us']:.0f}, {out['other_ops']:.0f} other "
          f"operations {out['other_ops_us']:.0f}, no operation {out['idle_us']:.0f}")
    for kind, c in out["kernel_calls"].items():
        print(f"  {kind:18s} {c['us']:7.0f} us a step, {c['calls']:3d} calls, {c['us'] / c['calls']:6.1f} us a call")
    print(f"wrote {write_result(args.name, {'args': vars(args), **out})}")


if __name__ == "__main__":
    main()
