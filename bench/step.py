"""Time `step_rows` at several lane counts and live lengths, on the default model or a named shape.

Reports ms per step, tokens/s and the fraction of the roofline: the time the step's bytes (the weights and the live
KV a device reads) take at the read bandwidth `common.ReadProbe` measures just before each timed step, over the step's
time (the median over the steps). The machine's speed drifts over seconds, so a bandwidth measured once, before the
steps, can put a fast step above 100%.
With --tensor-parallel, the model is split over each number of devices in turn (docs/sharding.md), and each row also
gives the bytes one device reads a step: its share of the weights and of the live KV. On CPU the devices are virtual
(set JAX_NUM_CPU_DEVICES to the largest N) and share the machine's cores: that measures the split's overhead, not a
speed-up.
Usage:
  python -m bench.step [--reps 10] [--dtype float32]
  python -m bench.step --shape mistral-7b --lanes 1 8 32 64 --live 512 2048 --max-seq 4096   # random weights
  python -m bench.step --model gemma-3-270m.gguf --lanes 1 8 --live 4095 --max-seq 4096 --kv-windows full
  JAX_NUM_CPU_DEVICES=4 python -m bench.step --shape qwen3-0.6b --dtype float32 --tensor-parallel 1 2 4 --lanes 1 8

With --temperature (and --top-p, --top-k, --min-p), every lane samples with those settings, a seed and its step's
counter, and each row also times the greedy wave, the two interleaved (greedy, sampled, greedy, ...) on one engine;
ms_per_step is then the sampled wave's, greedy_ms_per_step the greedy one's. --baseline-sampling names another
tree's jaxstation/engine/sampling.py whose `sample` the same step is also compiled with, its sampled wave timed third
in each round (baseline_ms_per_step):
  python -m bench.step --model gemma-3-270m.gguf --lanes 1 8 --live 512 --max-seq 1024 --temperature 0.8 --top-p 0.95
  git show main:jaxstation/engine/sampling.py > /tmp/main_sampling.py
  python -m bench.step --model gemma-3-270m.gguf --lanes 1 8 --live 512 --temperature 0.8 --top-p 0.95 \
      --baseline-sampling /tmp/main_sampling.py

With --stored, the model as a station loads it (its block formats repacked into the integer products' tiles) against
the same model with the named formats read as stored, decode waves of the two engines interleaved in one process:
  python -m bench.step --model gemma-3-270m.gguf --lanes 1 8 --live 512 --max-seq 1024 --stored Q4_K Q5_K Q6_K

Each row also gives the step's integer operations a second (a multiply and an add per weight a row, over the
projections and the head) and, where the station multiplies in integers, the integer dot's peak measured beside it
(`cpu_kernel.int_dot_peak`: the kernels' dot instruction on registers alone, every core). With --matmuls, each of the
model's matrices (the first layer's projections and the head) is multiplied alone by as many rows as each --lanes,
and the rows say the kernel's operations a second against that peak:
  python -m bench.step --model llama-3.1-8b-q4_k_m.gguf --matmuls --lanes 1 8 16 32 64

With --lora, one decode step of 8 rows, each on its own rank-16 LoRA adapter on every projection (docs/lora.md),
against the same step of an engine without adapters, the two interleaved in one process (A, B, A, B, ...) so that
whatever else runs on the machine weighs on both alike; reports the ratio of their medians:
  python -m bench.step --lora
  python -m bench.step --lora --shape mistral-7b --num-layers 4   # random weights, the first 4 of its 32 layers
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import types

import jax
import numpy as np

from bench.common import (
    ReadProbe,
    add_model_args,
    add_name_arg,
    bench_model,
    copy_bandwidth,
    model_name,
    summary,
    timed,
    write_result,
)
from jaxstation.engine import engine as engine_module
from jaxstation.engine import penalties, steps
from jaxstation.engine.arena import arena_bytes
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, SamplingParams
from jaxstation.kernels import cpu_kernel
from jaxstation.model.layers import layer_list, lora_shapes, projection_shapes
from jaxstation.model.lora import slot_arrays
from jaxstation.model.quant import matmul, matmul_transposed
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
    add_name_arg(ap)
    ap.add_argument("--lora", action="store_true", help="8 rows over 8 rank-16 adapters against the base step")
    ap.add_argument("--num-layers", type=int, default=None, help="--shape: keep only this many of its layers")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample every lane (default: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--baseline-sampling", default=None, help="another sampling.py to time the sampled wave with")
    ap.add_argument("--stored", nargs="+", default=None, metavar="FORMAT",
                    help="also load the model with these block formats as stored (not repacked), interleaved")
    ap.add_argument("--matmuls", action="store_true",
                    help="each matrix alone at each --lanes rows: the kernel's operations a second against its peak")
    args = ap.parse_args()
    if args.lora:
        lora_main(args)
        return
    if args.stored:
        stored_main(args)
        return
    if args.matmuls:
        matmuls_main(args)
        return

    probe = ReadProbe()
    copy_bw, read_bw = copy_bandwidth(), probe.best()
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
        rows += sweep(args, model, engine_kw, n, bandwidth, probe)

    one, widest, lo, hi = min(args.lanes), max(args.lanes), min(args.live), max(args.live)
    by = {(r["tensor_parallel"], r["lanes"], r["live"]): r["ms_per_step"] for r in rows}
    first = args.tensor_parallel[0]
    checks = {f"{one}_lane_at_{lo}_over_floor": by[first, one, lo] / rows[0]["floor_ms"],
              f"{widest}_lane_at_{hi}_over_{one}_lane_at_{lo}": by[first, widest, hi] / by[first, one, lo]}
    for n in args.tensor_parallel[1:]:
        checks[f"tp{n}_over_tp{first}_{widest}_lanes_at_{hi}"] = by[n, widest, hi] / by[first, widest, hi]
    print({k: round(v, 2) for k, v in checks.items()})
    path = write_result("step", {"config": vars(args), "model": str(model.source), "dtype": args.dtype,
                                 "weight_bytes": models[first]["weight_bytes"], "per_tensor_parallel": models,
                                 "copy_bandwidth": copy_bw, "read_bandwidth": read_bw,
                                 "floor_ms": rows[0]["floor_ms"], "rows": rows, "ratios": checks},
                        model=model_name(args.model, args.shape), variant=args.name, read_bandwidth=read_bw)
    print(f"wrote {path}")


def sweep(args, model, engine_kw: dict, n: int, bandwidth: float, probe: ReadProbe) -> list[dict]:
    """One row per lane count and live length: ms per step of a full decode wave, and the bytes one device reads."""
    weights = device_bytes(model.params)
    floor_ms = 1e3 * weights / bandwidth
    ops = matmul_ops(model.cfg)
    integer = args.dtype in (None, "gguf") and cpu_kernel.available() and model.source.suffix == ".gguf"
    rows = []
    for lanes in args.lanes:
        engine = Engine(model, lanes=lanes, max_seq=args.max_seq, chunk=32, block=128, kv_windows=args.kv_windows,
                        kv_dtype=args.kv_dtype, **engine_kw)
        engine.warmup()
        for live in args.live:
            greedy, times, baseline, beside = time_waves(args, engine, lanes, live, probe)
            s = summary(times)
            ms = 1e3 * s["median"]
            kv = arena_bytes(model.cfg, lanes, live, engine.kv_dtype, engine.ring, engine.windowed) // n  # live k, v
            paired = statistics.median((weights + kv) / bw / t for bw, t in zip(beside, times, strict=True))
            row = {"tensor_parallel": n, "lanes": lanes, "live": live, "ms_per_step": ms,
                   "spread_ms": [1e3 * s["min"], 1e3 * s["max"]], "tokens_per_s": lanes / s["median"],
                   "weight_bytes_per_device": weights, "kv_bytes_per_device": kv, "arena_bytes": engine.arena.nbytes,
                   "weight_gb_per_s": weights / s["median"] / 1e9, "floor_ms": floor_ms,
                   "fraction_of_roofline": paired,
                   "read_bandwidth_beside": statistics.median(beside),
                   "gops": lanes * ops / s["median"] / 1e9}
            if integer:
                row["int_dot_peak_gops"] = cpu_kernel.int_dot_peak() / 1e9
            if greedy:
                row.update(greedy_ms_per_step=1e3 * statistics.median(greedy), sampled_over_greedy=statistics.median(
                    [b / a for a, b in zip(greedy, times, strict=True)]))
            if baseline:
                row.update(baseline_ms_per_step=1e3 * statistics.median(baseline),
                           baseline_over_greedy=statistics.median([b / a for a, b in zip(greedy, baseline,
                                                                                         strict=True)]))
            rows.append(row)
            print(f"tp {n} lanes {lanes:2d} live {live:5d}: {ms:7.1f} ms/step  {row['tokens_per_s']:7.1f} tok/s  "
                  f"{(weights + kv) / 1e6:6.0f} MB a device  ({100 * paired:.0f}% of roofline, "
                  f"{row['read_bandwidth_beside'] / 1e9:.1f} GB/s beside; {row['gops']:.0f} GOPS"
                  + (f" of {row['int_dot_peak_gops']:.0f}" if integer else "") + ")"
                  + (f"  greedy {row['greedy_ms_per_step']:.1f} ms, sampled/greedy {row['sampled_over_greedy']:.3f}"
                     if greedy else "")
                  + (f"  baseline {row['baseline_ms_per_step']:.1f} ms, baseline/greedy "
                     f"{row['baseline_over_greedy']:.3f}" if baseline else ""))
        del engine
    return rows


def matmul_ops(cfg) -> int:
    """Integer (or float) operations of one row's projections and head: a multiply and an add per weight."""
    return 2 * (cfg.num_layers * sum(i * o for i, o in projection_shapes(cfg)) + cfg.hidden_size * cfg.vocab_size)


def matmuls_main(args) -> None:
    """The --matmuls sweep: the first layer's projections and the head, each multiplied alone by `lanes` rows of
    random activations, timed in turn, args.reps times; a row's operations a second over the sum of the medians, and
    the integer dot's peak measured just before each lane count."""
    model, _ = bench_model(args, args.max_seq)
    layer = layer_list(model.params)[0]
    head = model.params.lm_head or model.params.embed
    weights = {"wqkv": layer.wqkv, "wo": layer.wo, "w_gate_up": layer.w_gate_up, "w_down": layer.w_down,
               "lm_head": head}
    shapes_ = dict(zip(("wqkv", "wo", "w_gate_up", "w_down"), projection_shapes(model.cfg), strict=True))
    shapes_["lm_head"] = (model.cfg.hidden_size, model.cfg.vocab_size)
    rng = np.random.default_rng(0)
    mm = jax.jit(matmul_transposed if model.params.lm_head is None else matmul)
    rows = []
    for lanes in args.lanes:
        peak = cpu_kernel.int_dot_peak()
        per = {}
        for name, w in weights.items():
            x = jax.numpy.asarray(rng.standard_normal((lanes, shapes_[name][0]), np.float32))
            f = mm if name == "lm_head" else jax.jit(matmul)
            f(x, w).block_until_ready()
            per[name] = statistics.median(timed(lambda f=f, x=x, w=w: f(x, w).block_until_ready())
                                          for _ in range(args.reps))
        ops = {name: 2 * lanes * i * o for name, (i, o) in shapes_.items()}
        row = {"rows": lanes, "ms": {k: 1e3 * v for k, v in per.items()},
               "gops": {k: ops[k] / per[k] / 1e9 for k in per}, "int_dot_peak_gops": peak / 1e9,
               "total_gops": sum(ops.values()) / sum(per.values()) / 1e9}
        row["fraction_of_peak"] = row["total_gops"] * 1e9 / peak
        rows.append(row)
        print(f"rows {lanes:3d}: " + ", ".join(f"{k} {row['gops'][k]:.0f}" for k in per)
              + f" GOPS; all {row['total_gops']:.0f} of {peak / 1e9:.0f} ({100 * row['fraction_of_peak']:.0f}%)")
    path = write_result("step_matmuls", {"config": vars(args), "model": str(model.source),
                                         "int_dot": cpu_kernel.int_dot(), "rows": rows},
                        model=model_name(args.model, args.shape), variant=args.name)
    print(f"wrote {path}")


def baseline_step(path: str):
    """`steps.step_rows`, jitted anew with the `sample` of the sampling module at `path` (through `choose` and
    `sample_penalized`)."""
    spec = importlib.util.spec_from_file_location("baseline_sampling", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    penalized = penalties.sample_penalized
    scope = dict(vars(steps), sample=module.sample, sample_penalized=types.FunctionType(
        penalized.__code__, dict(vars(penalties), sample=module.sample), penalized.__name__, penalized.__defaults__))
    scope["choose"] = types.FunctionType(steps.choose.__code__, scope, "choose")
    raw = steps.step_rows.__wrapped__
    fn = types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__, raw.__closure__)
    fn.__kwdefaults__ = raw.__kwdefaults__
    return jax.jit(fn, static_argnames=("cfg", "block", "attention", "return_logits"), donate_argnames=("arena",))


def time_waves(args, engine: Engine, lanes: int, live: int, probe: ReadProbe
               ) -> tuple[list[float], list[float], list[float], list[float]]:
    """Seconds per full decode wave, args.reps times: (greedy waves, the waves asked for, the baseline's sampled
    waves, the read bandwidth `probe` measured just before each wave asked for). With --temperature greedy and sampled
    waves alternate; without, the first list is empty; the third is empty without --baseline-sampling."""
    sampled = args.temperature > 0
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=7) if sampled else SamplingParams()

    def wave(sampling: SamplingParams, counter: int) -> list[DecodeRow]:
        return [DecodeRow(1, live - 1, sampling, counter)] * lanes

    ours = engine_module.step_rows
    theirs = baseline_step(args.baseline_sampling) if args.baseline_sampling and sampled else None

    def baseline_decode(rows: list[DecodeRow]) -> None:
        engine_module.step_rows = theirs
        try:
            engine.decode(rows)
        finally:
            engine_module.step_rows = ours

    engine.decode(wave(params, 0))
    engine.decode(wave(SamplingParams(), 0))
    if theirs:
        baseline_decode(wave(params, 0))
    greedy, times, baseline, beside = [], [], [], []
    for rep in range(args.reps):
        plain, asked = wave(SamplingParams(), rep), wave(params, rep)
        if sampled:
            greedy.append(timed(lambda w=plain: engine.decode(w)))
        beside.append(probe())
        times.append(timed(lambda w=asked: engine.decode(w)))
        if theirs:
            baseline.append(timed(lambda w=asked: baseline_decode(w)))
    return greedy, times, baseline, beside


LORA_ROWS, LORA_RANK = 8, 16


def lora_main(args) -> None:
    """The --lora comparison: interleaved decode steps with and without a distinct adapter per row."""
    if args.num_layers:
        from jaxstation.model import shapes
        shapes.ARCHITECTURES[args.shape] = dataclasses.replace(shapes.ARCHITECTURES[args.shape],
                                                               num_layers=args.num_layers)
    max_seq, live = 1024, 512
    model, engine_kw = bench_model(args, max_seq)
    shape = dict(lanes=LORA_ROWS, max_seq=max_seq, chunk=32, block=128, wave_widths=(LORA_ROWS,), **engine_kw)
    base = Engine(model, **shape)
    lora = Engine(model, **shape, max_loras=LORA_ROWS, max_lora_rank=LORA_RANK)
    rng, cfg = np.random.default_rng(0), model.cfg
    shapes_ = lora_shapes(cfg)
    for slot in range(1, LORA_ROWS + 1):
        per_layer = {m: (rng.normal(0, d_in ** -0.5, (LORA_RANK, d_in)).astype(np.float32),
                         rng.normal(0, 0.01, (d_out, LORA_RANK)).astype(np.float32))
                     for m, (d_in, d_out) in shapes_.items()}
        lora.write_lora(slot, [slot_arrays(per_layer, shapes_, LORA_RANK)] * cfg.num_layers)
    for lane in range(LORA_ROWS):
        lora.begin(lane, [1], SamplingParams(), frozenset(), lora=lane + 1)
    wave = [DecodeRow(1, live - 1, SamplingParams(), 0)] * LORA_ROWS
    for engine in (base, lora):  # compile, and one run
        engine.decode(wave)
        engine.decode(wave)
    times: dict[str, list[float]] = {"base": [], "lora": []}
    for _ in range(args.reps):
        for name, engine in (("base", base), ("lora", lora)):
            times[name].append(timed(lambda e=engine: e.decode(wave)))  # decode reads its samples back
    base_ms, lora_ms = (1e3 * statistics.median(times[k]) for k in ("base", "lora"))
    pairs = [b / a for a, b in zip(times["base"], times["lora"], strict=True)]
    result = {"rows": LORA_ROWS, "rank": LORA_RANK, "live": live, "layers": cfg.num_layers,
              "base_ms": base_ms, "lora_ms": lora_ms, "ratio": lora_ms / base_ms,
              "pair_ratio_median": statistics.median(pairs), "base_times_s": times["base"],
              "lora_times_s": times["lora"], "adapter_bytes": sum(
                  a.nbytes for layer in layer_list(lora.params) for a in jax.tree_util.tree_leaves(layer.lora)),
              "weight_bytes": model.params.nbytes}
    print(f"{model.source} ({args.dtype}, {cfg.num_layers} layers): base {base_ms:.1f} ms, {LORA_ROWS} adapters "
          f"{lora_ms:.1f} ms: {result['ratio']:.3f}x (pairwise median {result['pair_ratio_median']:.3f}x)")
    path = write_result("step_lora", {"config": vars(args), "model": str(model.source), "dtype": args.dtype, **result},
                        model=model_name(args.model, args.shape), variant=args.name)
    print(f"wrote {path}")


def stored_main(args) -> None:
    """The --stored comparison: the model with its matrices repacked as a station loads them, against the same model
    with the named block formats read as stored, decode waves interleaved on two engines in one process."""
    repacked, _ = bench_model(args, args.max_seq)
    kept = dict(cpu_kernel.REPACKED)
    for fmt in args.stored:
        cpu_kernel.REPACKED.pop(f"{fmt}R")
    try:
        stored, engine_kw = bench_model(args, args.max_seq)
    finally:
        cpu_kernel.REPACKED.update(kept)
    rows = []
    for lanes in args.lanes:
        engines = {name: Engine(model, lanes=lanes, max_seq=args.max_seq, chunk=32, block=128, **engine_kw)
                   for name, model in (("repacked", repacked), ("stored", stored))}
        for live in args.live:
            wave = [DecodeRow(1, live - 1, SamplingParams(), 0)] * lanes
            for engine in engines.values():  # compile, and one run
                engine.decode(wave)
                engine.decode(wave)
            times: dict[str, list[float]] = {name: [] for name in engines}
            for _ in range(args.reps):
                for name, engine in engines.items():
                    times[name].append(timed(lambda e=engine, w=wave: e.decode(w)))
            row = {"lanes": lanes, "live": live, **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()},
                   "pair_ratio_median": statistics.median([a / b for a, b in zip(times["repacked"], times["stored"],
                                                                                  strict=True)])}
            rows.append(row)
            print(f"lanes {lanes:2d} live {live:5d}: repacked {row['repacked_ms']:.2f} ms, {' '.join(args.stored)} "
                  f"stored {row['stored_ms']:.2f} ms, repacked / stored {row['pair_ratio_median']:.3f}")
        del engines
    path = write_result("step_stored", {"config": vars(args), "model": str(repacked.source), "dtype": args.dtype,
                                        "rows": rows}, model=model_name(args.model, args.shape), variant=args.name)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
