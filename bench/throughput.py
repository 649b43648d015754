"""Aggregate decode throughput at K concurrent requests, through the Scheduler directly and over HTTP /generate.

Greedy, a fixed prompt set (random English from a fixed seed, encoded by the model's tokenizer), 128 new tokens, no
early stop. Direct: one Engine with lanes = max K (continuous batching); wall time from the first submit to the last
result; aggregate = tokens generated / wall. HTTP: a station subprocess (`python -m jaxstation serve`) and K client
threads. Per K: tokens/s (median and spread over --reps, warm-up excluded), ratio to K=1, mean lanes busy per decode
wave, and scheduler overhead = (wall - time inside engine.decode/prefill) / that step time.

Usage:
  python -m bench.throughput                    # K = 1 2 4 8 16 32, 128 new tokens, 3 reps, direct + HTTP
  python -m bench.throughput --quick            # K = 1 2, 16 new tokens, 1 rep (smoke run)
  python -m bench.throughput --ks 1 8 --no-http --engine-lanes k   # an engine sized to each K instead
  python -m bench.throughput --url https://canary---svc.a.run.app --ks 1 8 --reps 1   # a running station (burst)
  python -m bench.throughput --shape mistral-7b --ks 1 8 32   # random weights at a real shape, scheduler only
  python -m bench.throughput --mesh --ks 1 4 8  # also 1, 2, 3 mesh stations, pipelining off/on (bench/mesh.py)

With --temperature (and --top-p, --top-k, --min-p), the direct runs sample (request i seeded with i) and each
repetition also runs the same requests greedy, the two alternating on one station; `direct` is then the sampled
runs', `direct.greedy` the greedy ones', and the targets hold the median over repetitions of their tokens/s ratio
at each K:
  python -m bench.throughput --model gemma-3-270m.gguf --ks 8 --no-http --temperature 0.8 --top-p 0.95
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import add_model_args, add_name_arg, bench_model, model_name, write_result
from bench.workload import (
    StepTimer,
    concurrent_run,
    free_port,
    make_prompts,
    med_spread,
    server_process,
    station_available,
    station_cmd,
    station_generate,
)
from jaxstation.engine.rows import SamplingParams


def seq_len(prompt_len: int, new: int, chunk: int, block: int) -> int:
    unit = math.lcm(chunk, block)
    return unit * math.ceil((prompt_len + new + 1) / unit)


def direct(args, model, prompts) -> dict:
    from jaxstation.engine.engine import Engine
    from jaxstation.engine.jobs import Job
    from jaxstation.engine.scheduler import Scheduler

    max_seq = seq_len(args.prompt_len, args.new_tokens, args.chunk, args.block)
    stations: dict[int, tuple] = {}

    def station(k: int):
        lanes = max(args.ks) if args.engine_lanes == "max" else k
        if lanes not in stations:
            engine = Engine(model, lanes=lanes, max_seq=max_seq, chunk=args.chunk, block=args.block, **args.engine_kw)
            engine.warmup()
            timer = StepTimer(engine)
            sched = Scheduler(engine, continuous=True, max_queue=4 * lanes, terminal_ids=frozenset())
            sched.start()
            stations[lanes] = (sched, timer)
            run(k, min(8, args.new_tokens))  # warm-up: not measured
        return stations[lanes]

    def run(k: int, new: int, sampling: SamplingParams | None = None) -> dict:
        sched, timer = station(k)
        timer.reset()
        waves0 = sched.waves
        jobs = [Job(tokens=prompts[i], max_new_tokens=new, stop_ids=frozenset(), reuse_prefix=False,
                    sampling=dataclasses.replace(sampling, seed=i) if sampling else SamplingParams())
                for i in range(k)]
        t0 = time.perf_counter()
        futures = [sched.submit(j) for j in jobs]
        results = [f.result() for f in futures]
        wall = time.perf_counter() - t0
        generated = sum(len(r.generated) for r in results)
        short = [len(r.generated) for r in results if len(r.generated) != new]
        step = timer.step_s
        return {"wall_s": wall, "generated": generated, "tokens_per_s": generated / wall,
                "waves": sched.waves - waves0, "step_s": step, "overhead_frac": (wall - step) / step,
                "mean_busy": timer.mean_busy(), "decode_waves": len(timer.decode_s),
                "decode_ms_median": 1e3 * med_spread(timer.decode_s)["median"], "short_requests": short}

    asked = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    kinds = {"greedy": None, "sampled": asked} if args.temperature > 0 else {"greedy": None}
    reps: dict[str, dict[int, list[dict]]] = {kind: {k: [] for k in args.ks} for kind in kinds}
    for rep in range(args.reps):
        for k in args.ks:
            for kind, sampling in kinds.items():
                r = run(k, args.new_tokens, sampling)
                reps[kind][k].append(r)
                print(f"direct rep {rep} K={k:2d} {kind}: {r['tokens_per_s']:7.1f} tok/s  wall {r['wall_s']:6.2f}s  "
                      f"busy {r['mean_busy']:.2f}  overhead {100 * r['overhead_frac']:.1f}%"
                      + (f"  SHORT {r['short_requests']}" if r["short_requests"] else ""))
    for sched, _ in stations.values():
        sched.drain(5)
    if args.temperature > 0:
        return summarize(args, reps["sampled"], max_seq=max_seq, greedy=summarize(args, reps["greedy"]))
    return summarize(args, reps["greedy"], max_seq=max_seq)


def summarize(args, reps: dict[int, list[dict]], **extra) -> dict:
    rows = []
    base = None
    for k in args.ks:
        runs = reps[k]
        tps = med_spread([r["tokens_per_s"] for r in runs])
        if k == args.ks[0]:
            base = tps["median"]
        row = {"k": k, "tokens_per_s": tps, "ratio_to_first": tps["median"] / base if base else None}
        for key in ("overhead_frac", "mean_busy", "decode_ms_median"):
            vals = [r[key] for r in runs if r.get(key) is not None]
            row[key] = med_spread(vals) if vals else None
        row["runs"] = runs
        rows.append(row)
    return {"rows": rows, **extra}


_METRIC = re.compile(r'^(jaxstation_step_seconds_count\{kind="decode"\}|jaxstation_generated_tokens_total) ([0-9.e+]+)',
                     re.M)


def scrape(client, base: str) -> dict | None:
    """Decode-wave count and generated-token count from the station's /metrics, if it serves them."""
    try:
        text = client.get(f"{base}/metrics", timeout=10).text
    except Exception:
        return None
    found = {m.group(1).split("{")[0]: float(m.group(2)) for m in _METRIC.finditer(text)}
    return found if len(found) == 2 else None


def http_runs(args, prompts, base: str, headers: dict[str, str]) -> dict[int, list[dict]]:
    """The HTTP reps against the station at `base`; raises RuntimeError if a request fails or a reply is malformed."""
    import httpx

    with httpx.Client(headers=headers) as client:
        call = lambda c, t, n: station_generate(c, base, t, n)  # noqa: E731
        concurrent_run(call, prompts[:max(args.ks)], min(8, args.new_tokens), headers=headers)  # warm-up
        reps: dict[int, list[dict]] = {k: [] for k in args.ks}
        for rep in range(args.reps):
            for k in args.ks:
                before = scrape(client, base)
                wall, replies = concurrent_run(call, prompts[:k], args.new_tokens, headers=headers)
                after = scrape(client, base)
                generated = sum(r["n_generated"] for r in replies)
                busy = None
                if before and after:
                    waves = after["jaxstation_step_seconds_count"] - before["jaxstation_step_seconds_count"]
                    # every request's first token comes from its prefill, the rest from decode waves
                    decoded = after["jaxstation_generated_tokens_total"] - \
                        before["jaxstation_generated_tokens_total"] - k
                    busy = decoded / waves if waves else None
                short = [r["n_generated"] for r in replies if r["n_generated"] != args.new_tokens]
                r = {"wall_s": wall, "generated": generated, "tokens_per_s": generated / wall, "mean_busy": busy,
                     "short_requests": short,
                     "server_queue_s_median": med_spread([x["timing"]["queue_s"] for x in replies])["median"]}
                reps[k].append(r)
                print(f"http   rep {rep} K={k:2d}: {r['tokens_per_s']:7.1f} tok/s  wall {wall:6.2f}s"
                      + (f"  busy {busy:.2f}" if busy is not None else "")
                      + (f"  SHORT {short}" if short else ""))
    return reps


def http(args, prompts) -> dict:
    if args.url:  # a running station (e.g. a Cloud Run canary): any failure is fatal
        token = os.environ.get("JAXSTATION_BEARER_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return summarize(args, http_runs(args, prompts, args.url.rstrip("/"), headers), url=args.url)
    why = station_available()
    if why:
        return {"skipped": why}
    lanes = max(args.ks)
    max_seq = seq_len(args.prompt_len, args.new_tokens, args.chunk, args.block)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.gettempdir()) / f"jaxstation-bench-station-{port}.log"
    cmd = station_cmd(port, lanes, max_seq, args.chunk, args.block, max_queue=4 * lanes, dtype=args.dtype)
    try:
        with server_process(cmd, f"{base}/ready", timeout_s=args.server_timeout, log=log):
            reps = http_runs(args, prompts, base, {})
    except (RuntimeError, OSError) as e:
        print(f"http: skipped: {e}")
        return {"skipped": str(e)[:2000]}
    return summarize(args, reps, max_seq=max_seq, lanes=lanes)


def print_table(name: str, res: dict) -> None:
    if "skipped" in res:
        print(f"\n{name}: skipped ({res['skipped'].splitlines()[0]})")
        return
    print(f"\n{name}:\n|  K | tok/s (median) | spread | ratio to K={res['rows'][0]['k']} | lanes busy | overhead |")
    print("|---:|---:|---|---:|---:|---:|")
    for row in res["rows"]:
        t = row["tokens_per_s"]
        busy = f"{row['mean_busy']['median']:.2f}" if row.get("mean_busy") else "-"
        ov = f"{100 * row['overhead_frac']['median']:.1f}%" if row.get("overhead_frac") else "-"
        print(f"| {row['k']:2d} | {t['median']:.1f} | {t['min']:.1f}-{t['max']:.1f} | {row['ratio_to_first']:.2f} "
              f"| {busy} | {ov} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="concurrency levels")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    add_model_args(ap)
    add_name_arg(ap)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--engine-lanes", choices=("max", "k"), default="max",
                    help="direct: one engine with lanes = max K (default), or one engine per K with lanes = K")
    ap.add_argument("--overhead-k", type=int, default=8, help="K at which scheduler overhead is reported")
    ap.add_argument("--no-direct", action="store_true")
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--server-timeout", type=float, default=300.0)
    ap.add_argument("--quick", action="store_true", help="K = 1 2, 16 new tokens, 1 rep")
    ap.add_argument("--url", help="measure this running station over HTTP only (no direct run, no subprocess); "
                                  "exit 1 on any failed request or malformed reply. Bearer: $JAXSTATION_BEARER_TOKEN")
    ap.add_argument("--mesh", action="store_true", help="also meshes of --mesh-stations station processes "
                                                         "(implies --no-http); writes throughput_mesh-*.json")
    ap.add_argument("--mesh-stations", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    ap.add_argument("--temperature", type=float, default=0.0, help="direct: sample, against greedy runs")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    args = ap.parse_args()
    if args.url:
        args.no_direct, args.no_http = True, False
    if args.quick:
        args.ks, args.new_tokens, args.reps = [1, 2], 16, 1
    args.ks = sorted(set(args.ks))

    if args.shape:  # random weights: no tokenizer and no checkpoint for a station subprocess
        args.no_http = True
    if args.url:  # a running station: the prompts need the model's tokenizer here, not its weights
        from jaxstation.model.loader import load_tokenizer, model_source

        source = model_source(args.model)
        prompts = make_prompts(load_tokenizer(source), max(args.ks), args.prompt_len, seed=args.seed)
    else:
        model, args.engine_kw = bench_model(args, seq_len(args.prompt_len, args.new_tokens, args.chunk, args.block))
        source = model.source
        if model.tokenizer is None:
            rng = np.random.default_rng(args.seed)
            prompts = rng.integers(3, model.cfg.vocab_size, (max(args.ks), args.prompt_len)).tolist()
        else:
            prompts = make_prompts(model.tokenizer, max(args.ks), args.prompt_len, seed=args.seed)
    out = {"config": {k: v for k, v in vars(args).items()}, "model": str(source)}
    out["direct"] = {"skipped": "--no-direct"} if args.no_direct else direct(args, model, prompts)
    out["http"] = {"skipped": "--no-http"} if args.no_http or args.mesh else http(args, prompts)
    if args.mesh:
        from bench.mesh import mesh, print_mesh

        out["mesh"] = mesh(args, model, prompts, seq_len(args.prompt_len, args.new_tokens, args.chunk, args.block))
        out["targets"] = print_mesh(out["direct"], out["mesh"])
        path = write_result("throughput_mesh", out, model=model_name(args.model, args.shape), variant=args.name)
        print(f"wrote {path}")
        return

    targets = {}
    for name in ("direct", "http"):
        rows = {r["k"]: r for r in out[name].get("rows", [])}
        if 1 in rows and 8 in rows:
            targets[f"{name}_k8_over_k1"] = rows[8]["ratio_to_first"]
        if name == "direct" and args.overhead_k in rows and rows[args.overhead_k].get("overhead_frac"):
            targets[f"direct_overhead_frac_k{args.overhead_k}"] = rows[args.overhead_k]["overhead_frac"]["median"]
    if "greedy" in out["direct"]:
        for row, greedy in zip(out["direct"]["rows"], out["direct"]["greedy"]["rows"], strict=True):
            pairs = [s["tokens_per_s"] / g["tokens_per_s"] for s, g in zip(row["runs"], greedy["runs"], strict=True)]
            targets[f"direct_k{row['k']}_sampled_over_greedy"] = float(np.median(pairs))  # each rep's pair
        print_table("direct (Scheduler), greedy", out["direct"]["greedy"])
    out["targets"] = targets
    print_table("direct (Scheduler)", out["direct"])
    print_table("HTTP /generate", out["http"])
    print("targets:", {k: round(v, 3) for k, v in targets.items()}, "(want k8/k1 >= 5 direct, >= 4.5 http; "
          "overhead <= 0.10)")
    print(f"wrote {write_result('throughput', out, model=model_name(args.model, args.shape), variant=args.name)}")


if __name__ == "__main__":
    main()
