"""Mesh throughput (`python -m bench.throughput --mesh`): aggregate tokens/s at K concurrent requests for a model
split over 1, 2 and 3 station processes on loopback, with and without pipelining, and the transport cost of a hop.

Each mesh is driven by the unchanged Scheduler on a MeshEngine in this process (the host), greedy, no early stop, as
the direct throughput run does; the single local station (`direct`) is the baseline. Per mesh and K: tokens/s
(median over --reps), bytes on the wire per decode wave (every hop, both ways), and per hop the wall ms p50/p99 and
the part the station did not spend computing (transport, codec, HTTP).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.workload import StepTimer, free_port, med_spread, percentiles, server_process

SPLITS = {1: ["0:30"], 2: ["0:13", "13:30"], 3: ["0:7", "7:19", "19:30"]}
TOKEN = "bench-mesh-token"


def _station_cmd(port: int, layers: str, lanes: int, max_seq: int, args) -> list[str]:
    return [sys.executable, "-m", "jaxstation", "station", "--layers", layers, "--port", str(port),
            "--lanes", str(lanes), "--max-seq", str(max_seq), "--prefill-chunk", str(args.chunk),
            "--kv-block", str(args.block), "--dtype", args.dtype, "--layer-loop", args.layer_loop,
            "--attention", args.attention]


def _one_mesh(args, model, prompts, urls: list[str], lanes: int, max_seq: int, pipeline: bool) -> dict:
    from jaxstation.config.plan import resolve_plan
    from jaxstation.config.settings import StationConfig
    from jaxstation.engine.jobs import Job
    from jaxstation.engine.scheduler import Scheduler
    from jaxstation.mesh.host_engine import MeshEngine
    from jaxstation.mesh.stage import fingerprint

    config = StationConfig(stations=",".join(urls), mesh_token=TOKEN, lanes=lanes, max_seq=max_seq,
                           prefill_chunk=args.chunk, kv_block=args.block, dtype=args.dtype, layer_loop=args.layer_loop,
                           attention=args.attention, mesh_pipeline=pipeline)
    engine = MeshEngine.connect(config, resolve_plan(config, model.cfg), model.cfg, fingerprint(model))
    engine.warmup()
    timer = StepTimer(engine)
    sched = Scheduler(engine, continuous=True, max_queue=4 * lanes, terminal_ids=frozenset())
    sched.start()

    def run(k: int, new: int) -> dict:
        timer.reset()
        for c in engine.clients:
            c.hops.clear()
        t0 = time.perf_counter()
        futures = [sched.submit(Job(tokens=prompts[i], max_new_tokens=new, stop_ids=frozenset())) for i in range(k)]
        generated = sum(len(f.result().generated) for f in futures)
        wall = time.perf_counter() - t0
        hops = [h for c in engine.clients for h in c.hops if h.wave == "decode"]
        waves = len(timer.decode_s)
        return {"k": k, "wall_s": wall, "generated": generated, "tokens_per_s": generated / wall,
                "decode_waves": waves, "bytes_per_decode_wave": sum(h.sent + h.received for h in hops) / waves,
                "hop_ms": percentiles([h.ms for h in hops]),
                "hop_transport_ms": percentiles([h.ms - h.compute_ms for h in hops]),
                "decode_wave_ms": percentiles([1e3 * s for s in timer.decode_s])}

    try:
        run(max(args.ks), min(8, args.new_tokens))  # warm-up: not measured
        reps: dict[int, list[dict]] = {k: [] for k in args.ks}
        for _ in range(args.reps):
            for k in args.ks:
                r = run(k, args.new_tokens)
                reps[k].append(r)
                print(f"mesh {len(urls)} station(s) pipeline={pipeline!s:5} K={k}: {r['tokens_per_s']:6.1f} tok/s, "
                      f"{r['bytes_per_decode_wave'] / 1024:.1f} KiB/wave, hop p50 {r['hop_ms']['p50']:.2f} ms "
                      f"(transport {r['hop_transport_ms']['p50']:.2f}), p99 {r['hop_ms']['p99']:.2f} ms")
    finally:
        sched.drain(10)
        engine.close()
    rows = []
    for k, runs in reps.items():
        best = runs[len(runs) // 2]
        rows.append({"k": k, "tokens_per_s": med_spread([r["tokens_per_s"] for r in runs]),
                     "bytes_per_decode_wave": best["bytes_per_decode_wave"], "hop_ms": best["hop_ms"],
                     "hop_transport_ms": best["hop_transport_ms"], "decode_wave_ms": best["decode_wave_ms"],
                     "runs": runs})
    return {"stations": len(urls), "pipeline": pipeline, "group_size": engine.group_size, "rows": rows}


def mesh(args, model, prompts, max_seq: int) -> list[dict]:
    lanes = max(args.ks)
    out = []
    for n in args.mesh_stations:
        with contextlib.ExitStack() as stack:
            urls = []
            for layers in SPLITS[n]:
                port = free_port()
                log = Path(tempfile.gettempdir()) / f"jaxstation-bench-mesh-{port}.log"
                stack.enter_context(server_process(_station_cmd(port, layers, lanes, max_seq, args),
                                                   f"http://127.0.0.1:{port}/health", args.server_timeout, log,
                                                   env={"MOONSHINE_MESH_TOKEN": TOKEN,
                                                        "PYTHONPATH": os.pathsep.join(sys.path)}))
                urls.append(f"http://127.0.0.1:{port}")
            for pipeline in ((False, True) if n > 1 else (False,)):
                out.append(_one_mesh(args, model, prompts, urls, lanes, max_seq, pipeline))
    return out


def print_mesh(direct: dict, meshes: list[dict]) -> dict:
    """A markdown table, and the targets: per-hop p50 at the largest K, 2-station / local at K=8."""
    local = {r["k"]: r["tokens_per_s"]["median"] for r in direct.get("rows", [])}
    print("\n| stations | pipelining | K | tok/s | vs local | KiB/decode wave | hop p50 ms | hop p99 ms | "
          "transport p50 ms |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for k, v in sorted(local.items()):
        print(f"| local | - | {k} | {v:.1f} | 1.00 | - | - | - | - |")
    targets = {}
    for m in meshes:
        for r in m["rows"]:
            tps = r["tokens_per_s"]["median"]
            ratio = tps / local[r["k"]] if r["k"] in local else float("nan")
            print(f"| {m['stations']} | {'on' if m['pipeline'] else 'off'} | {r['k']} | {tps:.1f} | {ratio:.2f} | "
                  f"{r['bytes_per_decode_wave'] / 1024:.1f} | {r['hop_ms']['p50']:.2f} | {r['hop_ms']['p99']:.2f} | "
                  f"{r['hop_transport_ms']['p50']:.2f} |")
            if r["k"] == 8 and m["stations"] == 2 and not m["pipeline"]:
                targets["mesh2_k8_over_local"] = ratio
            if r["k"] == 8 and not m["pipeline"]:
                targets[f"mesh{m['stations']}_k8_hop_p50_ms"] = r["hop_ms"]["p50"]
                targets[f"mesh{m['stations']}_k8_hop_transport_p50_ms"] = r["hop_transport_ms"]["p50"]
    print("targets:", {k: round(v, 3) for k, v in targets.items()}, "(want hop p50 <= 2 ms at K=8; "
          "2 stations >= 0.8x local at K=8)")
    return targets
