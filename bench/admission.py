"""Admission: one prefill chunk per turn (`--prefill-budget off`) against packed admission (`auto`), in one run.

Sections (each writes its numbers into one JSON):
  steps   in-process, the default model: the wall time of one call of each step a turn may run (a decode wave of
          every lane, a prefill chunk, a packed step at each width), and one turn with a prompt piece and every
          other lane decoding, fused into one packed step against a packed step plus a decode wave
  churn   station subprocesses over HTTP: tiny /generate requests (1-8 prompt tokens, 1-3 new tokens) from 32
          keep-alive clients, requests per second at each lane count, old path, new path and llama-server (-np equal
          to the lanes, the same GGUF and token ids) side by side
  burst   in-process Scheduler, 32 lanes: 32 prompts of mixed lengths (16-512 tokens) at once, TTFT p50/p99 and
          the time to the last first token; and 8 lanes decoding while 24 prompts arrive, the p99 gap between their
          tokens against a plain decode step
  steady  in-process Scheduler: decode throughput at K = 8 and 32 with no arrivals

Usage:
  python -m bench.admission                        # everything, ~25 min on 2 cores
  python -m bench.admission --only steps burst     # a subset
  python -m bench.admission --churn-requests 200   # a shorter churn run
  python -m bench.admission --only steps --update  # rerun one section into today's result file
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time

import numpy as np

from bench.common import planned_model, result_path, write_result
from bench.workload import (
    free_port,
    llama_server_cmd,
    llama_server_completion,
    percentiles,
    server_process,
    station_cmd,
    station_generate,
)

SECTIONS = ("steps", "churn", "burst", "steady")
MODES = {"chunk": "off", "packed": "auto"}  # name -> --prefill-budget


def _median_ms(fn, reps: int) -> float:
    fn()  # compile and warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def steps_section(model, lanes: int, reps: int) -> dict:
    from jaxstation.engine.engine import Engine
    from jaxstation.engine.rows import DecodeRow, PromptPiece, SamplingParams

    engine = Engine(model, lanes=lanes, max_seq=512, chunk=32, block=128, attention="kernel", prefill_budget=None)
    sp = SamplingParams()
    rows = [DecodeRow(1, 100, sp, 1) for _ in range(lanes)]
    prompt = list(range(10, 10 + engine.prefill_budget))
    out = {"lanes": lanes, "pack_budget": engine.prefill_budget,
           "decode_wave_ms": _median_ms(lambda: engine.decode(rows), reps),
           "prefill_chunk_ms": _median_ms(lambda: engine.prefill(0, prompt[:32], 0, sp), reps),
           "pack_ms": {}}
    idle = [None] * lanes
    for w in engine.pack_widths:
        out["pack_ms"][w] = _median_ms(lambda w=w: engine.pack([PromptPiece(0, prompt[:w], 0, w, sp)], idle), reps)
    # a turn: lane 0 takes a piece of what the budget leaves, every other lane decodes
    n = engine.prefill_budget - (lanes - 1)
    others = [None] + rows[1:]
    piece = [PromptPiece(0, prompt[:n], 0, n, sp)]
    out["turn_piece_tokens"] = n
    out["turn_fused_ms"] = _median_ms(lambda: engine.pack(piece, others), reps)
    out["turn_separate_ms"] = _median_ms(lambda: (engine.pack(piece, idle), engine.decode(others)), reps)
    return out


def churn_section(lanes_list: list[int], n_requests: int, clients: int, llama: str | None, cache: str,
                  modes: list[str]) -> dict:
    import httpx

    rng = np.random.default_rng(0)
    work = [(rng.integers(100, 4000, int(rng.integers(1, 9))).tolist(), int(rng.integers(1, 4)))
            for _ in range(n_requests)]
    out: dict = {"requests": n_requests, "clients": clients, "prompt_tokens": "1-8", "new_tokens": "1-3"}

    def run(call, n: int = len(work)) -> float:
        lock, queue = threading.Lock(), list(range(n))

        def client_loop() -> None:
            with httpx.Client() as client:
                while True:
                    with lock:
                        if not queue:
                            return
                        i = queue.pop()
                    call(client, *work[i])

        threads = [threading.Thread(target=client_loop) for _ in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return n / (time.perf_counter() - t0)

    for lanes in lanes_list:
        row: dict = {}
        for name, budget in ((m, MODES[m]) for m in modes):
            port = free_port()
            cmd = station_cmd(port, lanes, 512, max_queue=4096) + ["--prefill-budget", budget,
                                                                    "--compile-cache-dir", cache]
            base = f"http://127.0.0.1:{port}"
            with server_process(cmd, f"{base}/ready", timeout_s=900):
                run(lambda c, t, n, b=base: station_generate(c, b, t, n), 2 * clients)  # warm the connections
                row[name] = run(lambda c, t, n, b=base: station_generate(c, b, t, n))
        if llama:
            port = free_port()
            from jaxstation.model.default_model import default_model_path

            cmd = llama_server_cmd(llama, str(default_model_path()), port, lanes, 512 * lanes)
            out["llama_server_cmd"] = cmd[4:]
            base = f"http://127.0.0.1:{port}"
            with server_process(cmd, f"{base}/health", timeout_s=300):
                run(lambda c, t, n, b=base: llama_server_completion(c, b, t, n), 2 * clients)
                row["llama-server"] = run(lambda c, t, n, b=base: llama_server_completion(c, b, t, n))
        out[lanes] = row
        print(f"churn lanes={lanes}: " + ", ".join(f"{k} {v:.1f} req/s" for k, v in row.items()), flush=True)
    return out


def _scheduler(model, lanes: int, budget: int | None):
    from jaxstation.engine.engine import Engine
    from jaxstation.engine.scheduler import Scheduler

    engine = Engine(model, lanes=lanes, max_seq=1024, chunk=32, block=128, attention="kernel", prefill_budget=budget)
    engine.warmup()
    sched = Scheduler(engine, continuous=True, max_queue=1024, terminal_ids=frozenset())
    sched.start()
    return sched


def burst_section(model) -> dict:
    from jaxstation.engine.jobs import Job

    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, 4000, int(n)).tolist() for n in rng.integers(16, 513, 32)]
    out: dict = {"prompts": len(prompts), "lengths": [len(p) for p in prompts]}
    for name, budget in (("chunk", 0), ("packed", None)):
        sched = _scheduler(model, 32, budget)
        try:
            jobs = [Job(tokens=p, max_new_tokens=2) for p in prompts]
            for job in jobs:
                sched.submit(job)
            ttft = [job.future.result().timing["ttft_s"] for job in jobs]
            # 8 lanes decoding, then 24 prompts arrive: the gaps between the decoding lanes' tokens
            stamps: list[list[float]] = [[] for _ in range(8)]
            decoding = [Job(tokens=prompts[i][:16], max_new_tokens=40,
                            on_token=lambda s, st=stamps[i]: st.append(time.perf_counter())) for i in range(8)]
            for job in decoding:
                sched.submit(job)
            while min(len(s) for s in stamps) < 8:
                time.sleep(0.01)
            plain = [b - a for s in stamps for a, b in zip(s[1:7], s[2:8], strict=True)]
            arrive = time.perf_counter()
            late = [Job(tokens=p, max_new_tokens=2) for p in prompts[8:]]
            for job in late:
                sched.submit(job)
            for job in late + decoding:
                job.future.result()
            gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if b > arrive]
        finally:
            sched.drain(30)
        out[name] = {"ttft_s": percentiles(ttft), "last_first_token_s": max(ttft),
                     "plain_gap_ms": 1000 * statistics.median(plain),
                     "burst_gap_ms": {k: v if k == "n" else 1000 * v for k, v in percentiles(gaps).items()}}
        print(f"burst {name}: {out[name]}", flush=True)
    return out


def steady_section(model, lanes_list: list[int], new: int) -> dict:
    from jaxstation.engine.jobs import Job

    out: dict = {"new_tokens": new}
    for lanes in lanes_list:
        row = {}
        for name, budget in (("chunk", 0), ("packed", None)):
            sched = _scheduler(model, lanes, budget)
            try:
                stamps: list[list[float]] = [[] for _ in range(lanes)]
                jobs = [Job(tokens=list(range(100 + i, 116 + i)), max_new_tokens=new,
                            on_token=lambda s, st=stamps[i]: st.append(time.perf_counter())) for i in range(lanes)]
                for job in jobs:
                    sched.submit(job)
                for job in jobs:
                    job.future.result()
                # tokens/s while every lane decodes: from the last first token to the first last token
                t0, t1 = max(s[0] for s in stamps), min(s[-1] for s in stamps)
                row[name] = sum(t0 < t <= t1 for s in stamps for t in s) / (t1 - t0)
            finally:
                sched.drain(30)
        out[lanes] = row
        print(f"steady K={lanes}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in row.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--churn-requests", type=int, default=1000)
    ap.add_argument("--churn-lanes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--steady-new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="the churn's station paths")
    ap.add_argument("--update", action="store_true", help="keep the other sections of today's result file")
    ap.add_argument("--llama-server", help="path of the llama-server binary (default: bench.peers' build cache)")
    args = ap.parse_args()

    result: dict = {}
    if {"steps", "burst", "steady"} & set(args.only):
        model = planned_model()[0]  # the station's defaults on this machine
        if "steps" in args.only:
            result["steps"] = {lanes: steps_section(model, lanes, args.reps) for lanes in (8, 32)}
            print(f"steps: {result['steps']}", flush=True)
        if "burst" in args.only:
            result["burst"] = burst_section(model)
        if "steady" in args.only:
            result["steady"] = steady_section(model, [8, 32], args.steady_new)
    if "churn" in args.only:
        from bench.peers import find_llama_server

        with tempfile.TemporaryDirectory(prefix="jaxstation-admission-cache-") as cache:
            result["churn"] = churn_section(args.churn_lanes, args.churn_requests, args.clients,
                                            find_llama_server(args.llama_server), cache, args.modes)
    if args.update:
        canonical = result_path("admission")
        previous = json.loads(canonical.read_text()) if canonical.exists() else {}
        result = {k: v for k, v in previous.items() if k in SECTIONS} | result
    path = write_result("admission", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
