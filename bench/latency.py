"""Latency under load: open-loop Poisson arrivals at several rates, and a long prefill arriving beside decoding lanes.

Load: at each rate (requests/s) a dispatcher submits requests at Poisson arrival times whatever the station is doing
(open loop), with a mixed prompt-length distribution (mostly 16-96 tokens, ~15% of 500-600 tokens). Per request:
TTFT (submit to first token), inter-token gaps (from `Job.on_token` timestamps) and queue time (submit to lane);
p50/p95/p99 of each, achieved throughput and the rejected count (QueueFull). Through the Scheduler directly, and with
--http also against a station subprocess (TTFT/queue from the reply's timing; no per-token gaps).

Prefix reuse is off here (the same prompts repeat at every rate and rep): this measures fresh prefill. See
bench.prefix for reuse.

Scenario: 4 lanes decoding, then a 512-token prompt arrives. For each prefill chunk size (a separate Engine) it
reports the decoding lanes' inter-token gap p50 and p99 (and p99/p50, target <= 2.5) and the long prompt's TTFT.

Usage:
  python -m bench.latency                         # rates 1 2 4 req/s x 40 requests, chunks 16 32 64 128
  python -m bench.latency --quick                 # smoke run: few requests, chunks 32 128
  python -m bench.latency --rates 0.5 1 2 3 --requests 80 --http
"""

from __future__ import annotations

import argparse
import math
import tempfile
import threading
import time
from pathlib import Path

from bench.common import write_result
from bench.workload import (
    free_port,
    make_prompts,
    med_spread,
    mixed_lengths,
    open_loop,
    percentiles,
    poisson_arrivals,
    server_process,
    station_available,
    station_cmd,
    station_generate,
)

BLOCK = 128


def new_station(model, lanes: int, max_seq: int, chunk: int, max_queue: int):
    from jaxstation.engine.engine import Engine
    from jaxstation.engine.scheduler import Scheduler

    engine = Engine(model, lanes=lanes, max_seq=max_seq, chunk=chunk, block=BLOCK)
    engine.warmup()
    sched = Scheduler(engine, continuous=True, max_queue=max_queue, terminal_ids=frozenset())
    sched.start()
    return sched


def load_direct(sched, prompts, arrivals, new_tokens: int) -> dict:
    """Open-loop run: submit prompts[i] at arrivals[i] (seconds from start); wait for all; per-request figures."""
    from jaxstation.engine.jobs import Job, QueueFull

    stamps: list[list[float]] = [[] for _ in prompts]
    jobs, rejected = [], 0
    t0 = time.perf_counter()
    for i, (prompt, at) in enumerate(zip(prompts, arrivals, strict=True)):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        job = Job(tokens=prompt, max_new_tokens=new_tokens, stop_ids=frozenset(), reuse_prefix=False,
                  on_token=lambda s, ts=stamps[i]: ts.append(time.perf_counter()))
        try:
            sched.submit(job)
            jobs.append((i, job))
        except QueueFull:
            rejected += 1
    results = [(i, job.future.result()) for i, job in jobs]
    end = time.perf_counter()
    return figures(results, stamps, prompts, rejected, end - t0)


def figures(results, stamps, prompts, rejected: int, wall: float) -> dict:
    ttft, ttft_long, ttft_short, queue, gaps, e2e = [], [], [], [], [], []
    generated = 0
    for i, r in results:
        timing = r["timing"] if isinstance(r, dict) else r.timing
        n = r["n_generated"] if isinstance(r, dict) else len(r.generated)
        generated += n
        ttft.append(timing["ttft_s"])
        (ttft_long if len(prompts[i]) >= 500 else ttft_short).append(timing["ttft_s"])
        queue.append(timing["queue_s"])
        e2e.append(r["client_s"] if isinstance(r, dict) else timing["total_s"])
        ts = stamps[i] if stamps else []
        gaps += [b - a for a, b in zip(ts, ts[1:], strict=False)]
    return {"completed": len(results), "rejected": rejected, "wall_s": wall, "generated": generated,
            "achieved_tokens_per_s": generated / wall, "achieved_requests_per_s": len(results) / wall,
            "ttft_s": percentiles(ttft), "ttft_short_s": percentiles(ttft_short), "ttft_long_s": percentiles(ttft_long),
            "itl_s": percentiles(gaps), "queue_s": percentiles(queue), "e2e_s": percentiles(e2e)}


def load_http(base: str, prompts, arrivals, new_tokens: int) -> dict:
    import httpx

    results, rejected, lock = [], [0], threading.Lock()

    def one(i: int) -> None:
        with httpx.Client() as client:
            try:
                r = station_generate(client, base, prompts[i], new_tokens)
            except httpx.HTTPStatusError as e:
                if e.response.status_code == 503:
                    with lock:
                        rejected[0] += 1
                    return
                raise
            with lock:
                results.append((i, r))

    wall = open_loop(arrivals, one)
    return figures(results, None, prompts, rejected[0], wall)


def scenario(sched, chunk: int, decoders: int, long_len: int, base_tokens: int, tail_tokens: int, tokenizer,
             seed: int) -> dict:
    """`decoders` lanes decode; once lane 0 has base_tokens, a long_len prompt arrives. Gaps and the long TTFT."""
    from jaxstation.engine.jobs import Job

    short = make_prompts(tokenizer, decoders, 32, seed=seed)
    long_prompt = make_prompts(tokenizer, 1, long_len, seed=seed + 1)[0]
    new = base_tokens + math.ceil(long_len / chunk) + tail_tokens
    stamps: list[list[float]] = [[] for _ in range(decoders)]
    long_job = Job(tokens=long_prompt, max_new_tokens=4, stop_ids=frozenset(), reuse_prefix=False)

    def on_token(_s, i: int) -> None:
        stamps[i].append(time.perf_counter())
        if i == 0 and len(stamps[0]) == base_tokens:
            sched.submit(long_job)

    jobs = [Job(tokens=p, max_new_tokens=new, stop_ids=frozenset(), reuse_prefix=False,
                on_token=lambda s, i=i: on_token(s, i)) for i, p in enumerate(short)]
    for j in jobs:
        sched.submit(j)
    for j in jobs:
        j.future.result()
    long_res = long_job.future.result()
    start = max(ts[0] for ts in stamps)  # every decoder past its prefill
    arrive = long_job.submitted_at
    first = arrive + long_res.timing["ttft_s"]
    gaps, during = [], []
    for ts in stamps:
        for a, b in zip(ts, ts[1:], strict=False):
            if a >= start:
                gaps.append(b - a)
                if arrive <= b <= first:
                    during.append(b - a)
    p = percentiles(gaps)
    return {"chunk": chunk, "itl_s": p, "itl_during_prefill_s": percentiles(during),
            "p99_over_p50": p["p99"] / p["p50"], "long_ttft_s": long_res.timing["ttft_s"],
            "long_prefill_chunks": math.ceil(long_len / chunk)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="arrival rates, requests/s")
    ap.add_argument("--requests", type=int, default=40, help="requests per rate")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=32, help="prefill chunk of the load-test station")
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--long-frac", type=float, default=0.15)
    ap.add_argument("--http", action="store_true", help="also run the load against a station subprocess")
    ap.add_argument("--scenario-chunks", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--scenario-long", type=int, default=512, help="the arriving prompt's length")
    ap.add_argument("--scenario-decoders", type=int, default=4)
    ap.add_argument("--scenario-reps", type=int, default=3)
    ap.add_argument("--no-load", action="store_true")
    ap.add_argument("--no-scenario", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true", help="smoke run: 6 requests/rate, 16 new tokens, chunks 32 128")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.new_tokens, args.scenario_chunks, args.scenario_reps = 6, 16, [32, 128], 1
        args.rates = [2.0, 4.0, 8.0]
    for c in args.scenario_chunks + [args.chunk]:
        if args.max_seq % c or args.max_seq % BLOCK:
            ap.error(f"--max-seq {args.max_seq} must be a multiple of every chunk and of {BLOCK}")

    from jaxstation.model.loader import load_model

    model = load_model(dtype=args.dtype)
    tok = model.tokenizer
    out: dict = {"config": dict(vars(args)), "model": str(model.source)}
    lengths = mixed_lengths(args.requests, args.seed, long_frac=args.long_frac)
    prompts = make_prompts(tok, args.requests, lengths, seed=args.seed)
    out["prompt_lengths"] = percentiles(lengths)
    reuse = None  # the load-test station, reused by the scenario when its chunk matches

    if not args.no_load:
        sched = new_station(model, args.lanes, args.max_seq, args.chunk, args.max_queue)
        load_direct(sched, prompts[:2], [0.0, 0.0], 4)  # warm-up, not measured
        out["direct"] = []
        for ri, rate in enumerate(args.rates):
            r = {"rate": rate, **load_direct(sched, prompts, poisson_arrivals(rate, args.requests, args.seed + ri),
                                             args.new_tokens)}
            out["direct"].append(r)
            print(f"direct rate {rate:5.2f}/s: TTFT p50 {r['ttft_s']['p50']:.3f} p99 {r['ttft_s']['p99']:.3f}s  "
                  f"ITL p50 {1e3 * r['itl_s']['p50']:.0f} p99 {1e3 * r['itl_s']['p99']:.0f}ms  "
                  f"queue p99 {r['queue_s']['p99']:.3f}s  {r['achieved_tokens_per_s']:.1f} tok/s  "
                  f"rejected {r['rejected']}")
        sched.drain(5)
        reuse = sched.engine

    if args.http:
        why = station_available()
        if why:
            out["http"] = {"skipped": why}
        else:
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            log = Path(tempfile.gettempdir()) / f"jaxstation-bench-station-{port}.log"
            cmd = station_cmd(port, args.lanes, args.max_seq, args.chunk, 128, args.max_queue, args.dtype)
            try:
                with server_process(cmd, f"{base}/ready", log=log):
                    load_http(base, prompts[:2], [0.0, 0.0], 4)
                    out["http"] = []
                    for ri, rate in enumerate(args.rates):
                        r = {"rate": rate, **load_http(base, prompts, poisson_arrivals(rate, args.requests,
                                                                                       args.seed + ri),
                                                       args.new_tokens)}
                        out["http"].append(r)
                        print(f"http   rate {rate:5.2f}/s: TTFT p50 {r['ttft_s']['p50']:.3f} "
                              f"p99 {r['ttft_s']['p99']:.3f}s  e2e p99 {r['e2e_s']['p99']:.2f}s  "
                              f"{r['achieved_tokens_per_s']:.1f} tok/s  rejected {r['rejected']}")
            except RuntimeError as e:
                out["http"] = {"skipped": str(e)[:2000]}
                print(f"http: skipped: {e}")

    if not args.no_scenario:
        out["scenario"] = []
        lanes = max(args.lanes, args.scenario_decoders + 1)
        base, tail = (8, 8) if args.quick else (16, 16)
        for chunk in args.scenario_chunks:
            if reuse is not None and reuse.chunk == chunk and reuse.lanes == lanes:
                from jaxstation.engine.scheduler import Scheduler

                sched = Scheduler(reuse, continuous=True, max_queue=args.max_queue, terminal_ids=frozenset())
                sched.start()
            else:
                sched = new_station(model, lanes, args.max_seq, chunk, args.max_queue)
            scenario(sched, chunk, args.scenario_decoders, 64, 4, 2, tok, args.seed)  # warm-up
            reps = [scenario(sched, chunk, args.scenario_decoders, args.scenario_long, base, tail, tok, args.seed)
                    for _ in range(args.scenario_reps)]
            sched.drain(5)
            row = {"chunk": chunk, "reps": reps,
                   "itl_p50_s": med_spread([r["itl_s"]["p50"] for r in reps]),
                   "itl_p99_s": med_spread([r["itl_s"]["p99"] for r in reps]),
                   "p99_over_p50": med_spread([r["p99_over_p50"] for r in reps]),
                   "itl_during_prefill_mean_s": med_spread([r["itl_during_prefill_s"]["mean"] for r in reps
                                                            if r["itl_during_prefill_s"]["n"]]),
                   "long_ttft_s": med_spread([r["long_ttft_s"] for r in reps])}
            out["scenario"].append(row)
            print(f"scenario chunk {chunk:3d}: ITL p50 {1e3 * row['itl_p50_s']['median']:.0f}ms "
                  f"p99 {1e3 * row['itl_p99_s']['median']:.0f}ms (p99/p50 {row['p99_over_p50']['median']:.2f}, "
                  f"target <= 2.5)  long TTFT {row['long_ttft_s']['median']:.2f}s")
    print(f"wrote {write_result('latency', out)}")


if __name__ == "__main__":
    main()
