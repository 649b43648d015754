"""Where a decode wave's time goes, at 1, 8 and 32 lanes: each part compiled and timed on its own.

- projections: every layer's norms and matmuls (q/k/v, o, gate/up, down) with attention taken out;
- attention: every layer's attention over the live length (the step's own implementation), no matmuls;
- lm_head + sampling: the final norm, the lm_head and on-device sampling (greedy, and temperature + top-p);
- step: the whole compiled `step_rows`, arguments already on the device;
- host: `Engine.decode` wall time minus the step (building the wave's arrays, fetching the samples).

The parts need not add up exactly to the step (the step fuses across them), but they show where the bytes and the
time go. Other settings run with --dtype, --layer-loop, --attention and XLA_FLAGS (a new process per flag set).

With --trace, a lone row's decode steps on an engine of each lane count, the model loaded as a station plans it, run
under JAX's profiler, and each step's compiled program is split into its kernel calls (XLA FFI custom calls, grouped
by their targets less the weights' format, the head apart), XLA's other operations, and the time no operation runs.
The tracer adds its own cost to every operation: compare a trace's parts with each other, and the step's time with
`bench.step`'s. Usage:
  python -m bench.profile                                   # default model, the backend's defaults
  python -m bench.profile --dtype int8 --name profile_int8
  python -m bench.profile --trace --lanes 1 --live 128
  python -m bench.profile --trace --model gemma-3-270m-q4_k_m.gguf --lanes 1 --live 128
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import add_lane_sweep_args, add_model_args, bench_model, model_name, summary, timed, write_result
from jaxstation.engine.attention import blocked_attention, dense_decode_attention, kernel_decode_attention
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, SamplingParams, sampling_arrays
from jaxstation.engine.sampling import sample
from jaxstation.engine.steps import step_rows
from jaxstation.model.layers import attn_out, lm_logits, mlp_block, over_layers, qkv_proj, rotary, rotary_at

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


def _median_ms(fn, reps: int) -> dict:
    fn()
    s = summary([timed(fn) for _ in range(reps)])
    return {"median_ms": 1e3 * s["median"], "spread_ms": [1e3 * s["min"], 1e3 * s["max"]]}


def parts(engine: Engine, live: int, reps: int) -> dict:
    cfg, params, lanes = engine.cfg, engine.params, engine.lanes
    positions = jnp.full((lanes, 1), live - 1, jnp.int32)
    rots = rotary(cfg, positions)
    x = jnp.ones((lanes, 1, cfg.hidden_size), params.dtype)

    @jax.jit
    def projections(params, x):
        def body(i, layer, x):
            q, _, _ = qkv_proj(cfg, layer, x, rotary_at(cfg, rots, i))
            return mlp_block(cfg, layer, attn_out(cfg, layer, x, q.reshape(lanes, 1, -1)))
        return over_layers(params, body, x)

    q = jnp.ones((lanes, 1, cfg.num_kv_heads, cfg.group_size, cfg.head_dim), params.dtype)
    n_blocks = jnp.int32(live // engine.block + 1)

    @jax.jit
    def attention(arena):
        def one(i):
            kv = arena.layer(i)
            if engine.attention == "blocked":
                return blocked_attention(cfg, q, positions, kv, i, jnp.arange(lanes), n_blocks, engine.block)
            if engine.attention == "kernel":
                return kernel_decode_attention(cfg, q.reshape(lanes, cfg.num_heads, -1), positions[:, 0], kv, i,
                                               jnp.arange(lanes))
            return dense_decode_attention(cfg, q.reshape(lanes, cfg.num_heads, -1), positions[:, 0],
                                          *kv.read(slice(None), slice(None), q.dtype), engine.attention)
        return sum(one(i) for i in range(cfg.num_layers))

    logits_in = jnp.ones((lanes, cfg.hidden_size), params.dtype)
    greedy = jax.tree_util.tree_map(jnp.asarray, sampling_arrays([(SamplingParams(), 0)] * lanes))
    nucleus = jax.tree_util.tree_map(jnp.asarray, sampling_arrays(
        [(SamplingParams(temperature=0.8, top_p=0.9, seed=1), 0)] * lanes))
    head = jax.jit(lambda params, h, s: sample(lm_logits(cfg, params, h), s))
    wave = [DecodeRow(1, live - 1, SamplingParams(), 0)] * lanes
    pos, tok = np.full(lanes, live - 1, np.int32), np.ones(lanes, np.int32)
    dev_args = jax.device_put((pos, tok, np.int32(n_blocks), greedy))

    def step() -> None:
        engine.arena, out, _ = step_rows(cfg, params, engine.arena, *dev_args, block=engine.block,
                                         attention=engine.attention)
        jax.block_until_ready(out)

    out = {
        "projections": _median_ms(lambda: projections(params, x).block_until_ready(), reps),
        "attention": _median_ms(lambda: attention(engine.arena).block_until_ready(), reps),
        "lm_head_greedy": _median_ms(lambda: jax.block_until_ready(head(params, logits_in, greedy)), reps),
        "lm_head_top_p": _median_ms(lambda: jax.block_until_ready(head(params, logits_in, nucleus)), reps),
        "step": _median_ms(step, reps),
        "engine_decode": _median_ms(lambda: engine.decode(wave), reps),
    }
    out["host_ms"] = out["engine_decode"]["median_ms"] - out["step"]["median_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    add_lane_sweep_args(ap, reps=7)
    ap.add_argument("--trace", action="store_true", help="trace a lone row's steps by operation instead")
    ap.add_argument("--steps", type=int, default=40, help="--trace: decode steps traced an engine")
    args = ap.parse_args()
    if args.trace:
        trace_main(args)
        return
    model, engine_kw = bench_model(args, args.max_seq)
    rows = []
    for lanes in args.lanes:
        engine = Engine(model, lanes=lanes, max_seq=args.max_seq, chunk=32, block=128, **engine_kw)
        engine.warmup()
        r = {"lanes": lanes, "live": args.live, **parts(engine, args.live, args.reps)}
        rows.append(r)
        ms = {k: v["median_ms"] for k, v in r.items() if isinstance(v, dict)}
        print(f"lanes {lanes:2d}: step {ms['step']:7.1f} ms | projections {ms['projections']:6.1f} | attention "
              f"{ms['attention']:6.1f} | lm_head+sample greedy {ms['lm_head_greedy']:5.1f} top-p "
              f"{ms['lm_head_top_p']:5.1f} | host {r['host_ms']:5.2f} ms", flush=True)
    path = write_result("profile", {"config": vars(args), "model": str(model.source),
                                   "weight_bytes": model.params.nbytes, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                                   "rows": rows}, model=model_name(args.model, args.shape), variant=args.name)
    print(f"wrote {path}")


def trace_main(args) -> None:
    """--trace: each lane count's lone-row decode steps traced, their time split by kind of operation."""
    from jaxstation.config.plan import load_planned, planned_engine, resolve_plan
    from jaxstation.config.settings import StationConfig
    from jaxstation.model.loader import checkpoint_config

    rows = []
    for lanes in args.lanes:
        config = StationConfig(lanes=lanes, max_seq=128 * (args.live // 128 + 1),
                               **({"model": args.model} if args.model else {}))
        plan = resolve_plan(config, checkpoint_config(config.model))
        model = load_planned(config, plan)
        engine = planned_engine(model, config, plan)
        wave = [DecodeRow(1, args.live - 1, SamplingParams(), 0)] + [None] * (lanes - 1)
        kinds = call_kinds(engine, wave, model.cfg.vocab_size)
        for _ in range(20):
            engine.decode(wave)
        steps = []
        for _ in range(0, args.steps, TRACED):  # short traces: a long one loses events
            with tempfile.TemporaryDirectory() as tmp:
                jax.profiler.start_trace(tmp, create_perfetto_trace=True)
                for _ in range(TRACED + 2):
                    engine.decode(wave)
                jax.profiler.stop_trace()
                steps += traced_steps(Path(tmp))[2:]  # the first two overlap the tracer's start
        out = {"lanes": lanes, "live": args.live, **summarize(steps, kinds)}
        rows.append(out)
        print(f"{model.source}: {lanes} lanes, live {args.live}, {out['runs']} whole steps traced; medians, us")
        print(f"step {out['step_us']:.0f}: kernel calls {out['kernel_calls_us']:.0f}, {out['other_ops']:.0f} other "
              f"operations {out['other_ops_us']:.0f}, no operation {out['idle_us']:.0f}")
        for kind, c in out["kernel_calls"].items():
            print(f"  {kind:18s} {c['us']:7.0f} us a step, {c['calls']:3d} calls, {c['us'] / c['calls']:6.1f} us "
                  "a call")
    path = write_result("profile_trace", {"config": vars(args), "rows": rows}, model=model_name(args.model),
                        variant=args.name)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
