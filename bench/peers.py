"""jaxstation beside the engines a user would otherwise pick: same GGUF, same token ids, same workload, one run.

Systems (each skipped with a note when it is not available):
  jaxstation         a station subprocess (`python -m jaxstation serve --continuous-batch`, 8 lanes) over HTTP
                     /generate; falls back to the Scheduler in-process if the server cannot start
  llama-server       llama.cpp's C++ server with -np 8 parallel slots, /completion with token ids, ignore_eos
                     (build it with scripts/build_llama_server.sh; or pass --llama-server PATH)
  llama-cpp-python   `python -m llama_cpp.server` (serializes requests), /v1/completions with the
                     prompts' text (its API takes no token ids; decoding and re-encoding gives the same ids)
  transformers       HF `generate` in-process, float32, greedy: one stream (K=1) and a static batch (K=8)
Workload: throughput at K concurrent requests (default K = 1 and 8; 128 new tokens, greedy, no early stop, the fixed
prompt set of bench.throughput; with --sampled each K also at temperature 0.8 and top_p 0.95, seeded, on the station
and llama-server, whose own top_k and min_p are turned off) and an open-loop Poisson latency run (the mixed prompt
lengths of bench.latency; end-to-end latency, server-side TTFT where the reply says it), and the prefill of each
--prefill-len prompt (default 512) with one new token, alone, in prompt tokens per second of server-side TTFT (a new
prompt each repetition, so no prefix cache helps). Each server's start to ready (the station's with its compilation
cache in the peers cache: with --cold-start first emptied, started once and stopped, then started again warm) and its
resident memory after the runs (VmRSS, and its peak VmHWM) are in the result, and llama-server's build. Each
measurement runs on every system in turn, seconds apart (K = 1 greedy on each, then K = 8 greedy on each, ..., the
first system rotating with the repetition), so that a machine whose speed drifts over minutes slows both sides of a
ratio alike. One side-by-side table is printed and written as JSON. Peers are the optional `peers` extra: pip
install -e '.[peers]'.

Usage:
  scripts/build_llama_server.sh                   # once, ~15 min; cached in ~/.cache/jaxstation-peers
  python -m bench.peers                           # K = 1 8, 128 new tokens, 3 reps, latency at 2 req/s
  python -m bench.peers --quick                   # 16 new tokens, 1 rep, 6 latency requests
  python -m bench.peers --sampled --ks 1 8 32     # each K greedy and sampled (temperature 0.8, top_p 0.95)
  python -m bench.peers --only jaxstation llama-server --llama-server /path/to/llama-server
  python -m bench.peers --shape llama-3.1-8b --only jaxstation llama-server --sampled --ks 1 8 32 --no-latency \
      --prefill-len 512 2048 --cold-start          # a random-weight 8B file (bench.shapes)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import add_name_arg, model_name, planned_model, write_result
from bench.workload import (
    GREEDY,
    SAMPLED,
    concurrent_run,
    first_executable,
    free_port,
    llama_cpp_python_completion,
    llama_server_cmd,
    llama_server_completion,
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

SYSTEMS = ("jaxstation", "llama-server", "llama-cpp-python", "transformers")
CACHE = Path(os.environ.get("JAXSTATION_PEERS_CACHE", Path.home() / ".cache" / "jaxstation-peers"))


class System:
    """A system under test: `run(prompts, new)` sends the prompts concurrently, returns (wall_s, generated)."""

    name = ""
    serves_http = True

    sampling = GREEDY  # what run() sends: GREEDY or SAMPLED

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, int]:
        wall, replies = concurrent_run(self.call, prompts, new)
        return wall, sum(r["n_generated"] for r in replies)

    def call(self, client, tokens: list[int], new: int) -> dict:
        raise NotImplementedError


class Station(System):
    name = "jaxstation"

    def __init__(self, base: str) -> None:
        self.base = base

    def call(self, client, tokens, new):
        r = station_generate(client, self.base, tokens, new, self.sampling)
        r["server_ttft_s"] = r["timing"]["ttft_s"]
        return r


class DirectStation(System):
    """The Scheduler in this process: the fallback when the HTTP station cannot start."""

    name = "jaxstation"
    serves_http = False

    def __init__(self, dtype: str | None, lanes: int, max_seq: int, path: str | None = None) -> None:
        from jaxstation.engine.engine import Engine
        from jaxstation.engine.scheduler import Scheduler
        model = planned_model(dtype=dtype, model=path)[0]
        engine = Engine(model, lanes=lanes, max_seq=max_seq, chunk=32, block=128)
        engine.warmup()
        self.sched = Scheduler(engine, continuous=True, max_queue=256, terminal_ids=frozenset())
        self.sched.start()

    def call(self, client, tokens, new):
        from jaxstation.engine.jobs import Job

        t0 = time.perf_counter()
        r = self.sched.submit(Job(tokens=tokens, max_new_tokens=new, stop_ids=frozenset(), reuse_prefix=False)).result()
        return {"client_s": time.perf_counter() - t0, "n_generated": len(r.generated),
                "server_ttft_s": r.timing["ttft_s"]}


class LlamaServer(System):
    name = "llama-server"

    def __init__(self, base: str) -> None:
        self.base = base

    def call(self, client, tokens, new):
        r = llama_server_completion(client, self.base, tokens, new, self.sampling)
        if r.get("timings") and "prompt_ms" in r["timings"]:
            r["server_ttft_s"] = r["timings"]["prompt_ms"] / 1e3
        return r


class LlamaCppPython(System):
    name = "llama-cpp-python"

    def __init__(self, base: str, tokenizer) -> None:
        self.base, self.tokenizer = base, tokenizer

    def call(self, client, tokens, new):
        # the same ids, decoded: its server re-encodes them with the same GGUF vocabulary
        return llama_cpp_python_completion(client, self.base, self.tokenizer.decode(tokens), new)


class Transformers(System):
    """HF generate in this process; K prompts of equal length run as one static batch (no padding needed)."""

    name = "transformers"
    serves_http = False

    def __init__(self, gguf: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        # transformers' own GGUF reader, dequantized to float32 (from_pretrained(gguf_file=) would need accelerate)
        cfg = dict(load_gguf_checkpoint(str(gguf), return_tensors=False)["config"])
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
        _, unexpected = model.load_state_dict(tensors, strict=False)
        if unexpected:
            raise ValueError(f"unexpected GGUF tensors for {type(model).__name__}: {unexpected[:5]}")
        model.tie_weights()
        self.model = model.eval()

    def run(self, prompts, new):
        lengths = {len(p) for p in prompts}
        if len(lengths) != 1:
            raise ValueError("transformers static batch needs prompts of one length")
        ids = self.torch.tensor(prompts, dtype=self.torch.long)
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=0)
        wall = time.perf_counter() - t0
        return wall, int((out.shape[1] - ids.shape[1]) * out.shape[0])


def find_llama_server(arg: str | None) -> str | None:
    return first_executable(arg, str(CACHE / "llama-server"), shutil.which("llama-server"))


def llama_server_build(binary: str) -> dict:
    """Which llama-server ran: its --version, and the flags scripts/build_llama_server.sh built it with."""
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    flags = Path(binary).resolve().parent.parent / "build-flags.txt"
    if not flags.exists():
        flags = Path(binary).parent / "build-flags.txt"
    return {"binary": binary, "version": (version.stdout + version.stderr).strip().splitlines()[-2:],
            "build": flags.read_text().strip() if flags.exists() else None}


PROGRAMS = re.compile(r"start-up programs: (\d+) compiled, (\d+) read from the persistent compilation cache")


def startup_programs(log: Path) -> dict:
    """The station's count of the programs it compiled and read from its cache, from its log (none for others)."""
    found = PROGRAMS.search(log.read_text(errors="replace")) if log.exists() else None
    return {"compiled": int(found[1]), "from_cache": int(found[2])} if found else {}


def cold_start(cmd: list[str], ready: str, timeout: float, env: dict, log: Path) -> dict:
    """A station started with its compilation cache empty: seconds to ready and what it compiled; then stopped."""
    t0 = time.perf_counter()
    with server_process(cmd, ready, timeout, log=log, env=env):
        took = time.perf_counter() - t0
    return {"ready_s": took, **startup_programs(log)}


def resident(pid: int) -> dict:
    """A process's resident memory now (VmRSS) and at its peak (VmHWM), in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) // 1024 for key in ("VmRSS", "VmHWM")}


def latency_run(system: System, prompts, arrivals, new: int) -> dict:
    """Open-loop Poisson run: one thread per request, started at its arrival time."""
    import httpx

    results, errors, lock = [], [], threading.Lock()

    def one(i: int) -> None:
        with httpx.Client(timeout=600) as client:
            try:
                r = system.call(client, prompts[i], new)
            except Exception as e:  # counted as rejected/failed
                with lock:
                    errors.append(repr(e)[:200])
                return
            with lock:
                results.append(r)

    wall = open_loop(arrivals, one)
    generated = sum(r["n_generated"] for r in results)
    return {"completed": len(results), "failed": len(errors), "errors": errors[:3], "wall_s": wall,
            "achieved_tokens_per_s": generated / wall, "e2e_s": percentiles([r["client_s"] for r in results]),
            "server_ttft_s": percentiles([r["server_ttft_s"] for r in results if r.get("server_ttft_s") is not None])}


def prefill_run(system: System, prompts: list[list[int]]) -> dict:
    """A prompt's prefill alone, in prompt tokens per second of server-side TTFT (of the client's wall time where
    the reply has none): the first prompt warms up, each other one is new."""
    rates = []
    for i, prompt in enumerate(prompts):
        wall, replies = concurrent_run(system.call, [prompt], 1)
        if i:
            rates.append(len(prompt) / (replies[0].get("server_ttft_s") or wall))
    return med_spread(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--sampled", action="store_true",
                    help="also measure each K sampled (temperature 0.8, top_p 0.95) on the HTTP systems that sample")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, nargs="+", default=[512],
                    help="the prefill runs' prompt lengths (0: no prefill run)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate", type=float, default=2.0, help="latency run: Poisson arrivals, requests/s")
    ap.add_argument("--latency-requests", type=int, default=24)
    ap.add_argument("--latency-new-tokens", type=int, default=64)
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--model", help="a GGUF file both systems serve (default: the default model)")
    ap.add_argument("--shape", help="a random-weight GGUF file at a named model's shape (bench.shapes) instead")
    ap.add_argument("--cold-start", action="store_true",
                    help="start the station once with its compilation cache emptied, then again to measure")
    ap.add_argument("--slots", type=int, default=8, help="llama-server -np and jaxstation --lanes")
    ap.add_argument("--dtype", default=None, help="jaxstation's weights: gguf, gguf-exact, float32 or int8 (default: "
                                                  "the station's, gguf on CPU; llama.cpp reads the GGUF's blocks as "
                                                  "they are)")
    ap.add_argument("--llama-server", help="path of the llama-server binary (default: the build cache, then PATH)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds idle before each throughput run")
    ap.add_argument("--server-timeout", type=float, default=300.0)
    add_name_arg(ap)
    ap.add_argument("--quick", action="store_true", help="16 new tokens, 1 rep, 6 latency requests of 16 tokens")
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.reps, args.latency_requests, args.latency_new_tokens = 16, 1, 6, 16

    from bench.common import copy_bandwidth, read_bandwidth
    from jaxstation.model.default_model import default_model_path
    from jaxstation.model.loader import load_tokenizer

    bandwidth = {"read": read_bandwidth(), "copy": copy_bandwidth()}  # this machine, in this run
    print(f"read bandwidth {bandwidth['read'] / 1e9:.1f} GB/s, copy {bandwidth['copy'] / 1e9:.1f} GB/s", flush=True)
    if args.shape:
        from bench.shapes import ensure

        args.model = str(ensure(args.shape))
    gguf = Path(args.model) if args.model else default_model_path()
    prefill_lens = [n for n in args.prefill_len if n]
    tok = load_tokenizer(gguf)
    prompts = make_prompts(tok, max(args.ks), args.prompt_len, seed=args.seed)  # == bench.throughput's prompts
    lengths = mixed_lengths(args.latency_requests, args.seed)  # == bench.latency's mix
    lat_prompts = make_prompts(tok, args.latency_requests, lengths, seed=args.seed)
    arrivals = poisson_arrivals(args.rate, args.latency_requests, args.seed)
    long_prompts = {n: make_prompts(tok, args.reps + 1, n, seed=args.seed + 1) for n in prefill_lens}
    longest = max(lengths + [args.prompt_len, *prefill_lens])
    ctx = 1024 * -(-(longest + max(args.new_tokens, args.latency_new_tokens) + 1) // 1024)
    tmp = Path(tempfile.gettempdir())
    notes: dict[str, str] = {}
    systems: list[System] = []
    started: dict[str, dict] = {}  # each server's start: its process, seconds to ready, what its log says
    compile_cache = CACHE / "compile-cache" / model_name(args.model)
    station_env = {"MOONSHINE_COMPILE_CACHE_DIR": str(compile_cache)}

    with contextlib.ExitStack() as stack:
        def serve(name: str, cmd: list[str], ready: str, make, env: dict | None = None) -> None:
            try:
                log = tmp / f"peers-{name}.log"
                t0 = time.perf_counter()
                proc = stack.enter_context(server_process(cmd, ready, args.server_timeout, log=log, env=env))
                started[name] = {"proc": proc, "ready_s": time.perf_counter() - t0, **startup_programs(log)}
                systems.append(make())
            except (RuntimeError, OSError) as e:
                notes[name] = f"could not start: {str(e).splitlines()[0]}"

        if "jaxstation" in args.only:
            why = station_available()
            if why is None:
                port = free_port()
                base = f"http://127.0.0.1:{port}"
                cmd = station_cmd(port, args.slots, ctx, dtype=args.dtype, model=args.model)
                if args.cold_start:
                    shutil.rmtree(compile_cache, ignore_errors=True)
                    started["jaxstation cold"] = cold_start(cmd, f"{base}/ready", args.server_timeout, station_env,
                                                            tmp / "peers-jaxstation-cold.log")
                serve("jaxstation", cmd, f"{base}/ready", lambda b=base: Station(b), station_env)
            else:
                notes["jaxstation"] = why
            if not any(s.name == "jaxstation" for s in systems):
                notes["jaxstation"] = notes.get("jaxstation", "") + "; ran the Scheduler in-process instead"
                systems.append(DirectStation(args.dtype, args.slots, ctx, args.model))
        if "llama-server" in args.only:
            binary = find_llama_server(args.llama_server)
            if binary is None:
                notes["llama-server"] = "not built: run scripts/build_llama_server.sh (or pass --llama-server)"
            else:
                port = free_port()
                base = f"http://127.0.0.1:{port}"
                cmd = llama_server_cmd(binary, str(gguf), port, args.slots, ctx * args.slots, args.threads)
                serve("llama-server", cmd, f"{base}/health", lambda b=base: LlamaServer(b))
                if "--no-repack" in cmd:
                    notes["llama-server"] = "--no-repack: its repacked (AMX) weights crash on this machine"
        if "llama-cpp-python" in args.only:
            if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("uvicorn") is None:
                notes["llama-cpp-python"] = "not installed: pip install 'llama-cpp-python[server]'"
            else:
                port = free_port()
                base = f"http://127.0.0.1:{port}"
                cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                       "--port", str(port), "--n_ctx", str(ctx), "--n_threads", str(args.threads)]
                serve("llama-cpp-python", cmd, f"{base}/v1/models", lambda b=base: LlamaCppPython(b, tok))
        if "transformers" in args.only:
            if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
                notes["transformers"] = "not installed: pip install transformers torch"
            else:
                try:
                    systems.append(Transformers(gguf))
                except Exception as e:
                    notes["transformers"] = f"could not load the GGUF: {type(e).__name__}: {str(e)[:300]}"
        for name, note in notes.items():
            print(f"{name}: {note}")

        for s in systems:  # warm-up, not measured
            s.run(prompts[:max(args.ks)], 4)
        modes = {"greedy": GREEDY, **({"sampled": SAMPLED} if args.sampled else {})}
        samplers = {s.name for s in systems if isinstance(s, (Station, LlamaServer))}
        tput: dict[str, dict[str, dict[int, list[float]]]] = {
            s.name: {m: {k: [] for k in args.ks} for m in modes if m == "greedy" or s.name in samplers}
            for s in systems}
        for rep in range(args.reps):
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]  # rotate who goes first
            for mode, k in ((m, k) for m in modes for k in args.ks):
                for s in (s for s in order if mode in tput[s.name]):
                    time.sleep(args.settle)  # the last run's threads (llama.cpp's spin) are asleep again
                    s.sampling = modes[mode]
                    wall, generated = s.run(prompts[:k], args.new_tokens)
                    s.sampling = GREEDY
                    tput[s.name][mode][k].append(generated / wall)
                    print(f"rep {rep} {s.name:17s} {mode} K={k}: {generated / wall:7.1f} tok/s ({generated} tokens)")
        prefill: dict[str, dict[str, dict]] = {s.name: {} for s in systems if long_prompts}
        for n, long in long_prompts.items():
            for s in systems:
                prefill[s.name][str(n)] = prefill_run(s, long)
        latency = {}
        if not args.no_latency:
            for s in systems:
                if not s.serves_http and s.name == "transformers":
                    latency[s.name] = {"skipped": "not a server"}
                    continue
                latency[s.name] = latency_run(s, lat_prompts, arrivals, args.latency_new_tokens)
                print(f"latency {s.name:17s}: e2e p50 {latency[s.name]['e2e_s']['p50']:.2f}s "
                      f"p99 {latency[s.name]['e2e_s']['p99']:.2f}s  {latency[s.name]['achieved_tokens_per_s']:.1f} "
                      f"tok/s  failed {latency[s.name]['failed']}")
        memory = {name: resident(info["proc"].pid) for name, info in started.items() if "proc" in info}
        for s in systems:
            if isinstance(s, DirectStation):
                s.sched.drain(5)

    rows = []
    for name in SYSTEMS:
        row: dict = {"system": name, "note": notes.get(name)}
        if name in tput:
            row["tokens_per_s"] = {str(k): med_spread(v) for k, v in tput[name]["greedy"].items()}
            row["best_tokens_per_s"] = max(med_spread(v)["median"] for v in tput[name]["greedy"].values())
            if "sampled" in tput[name]:
                row["sampled_tokens_per_s"] = {str(k): med_spread(v) for k, v in tput[name]["sampled"].items()}
        if name in prefill:
            row["prefill_tokens_per_s"] = prefill[name]
        if name in latency:
            row["latency"] = latency[name]
        if name in started:
            row["start"] = {k: v for k, v in started[name].items() if k != "proc"} | {"memory_mib": memory.get(name)}
            if f"{name} cold" in started:
                row["cold_start"] = started[f"{name} cold"]
        rows.append(row)
    by = {r["system"]: r for r in rows}
    ratios = {}
    if "best_tokens_per_s" in by["jaxstation"]:
        for name in SYSTEMS[1:]:
            if "best_tokens_per_s" in by[name]:
                ratios[f"jaxstation_best_over_{name}_best"] = by["jaxstation"]["best_tokens_per_s"] / \
                    by[name]["best_tokens_per_s"]
                for field, tag in (("tokens_per_s", ""), ("sampled_tokens_per_s", "_sampled")):
                    for k in map(str, args.ks):
                        pair = [r.get(field, {}).get(k, {}).get("median") for r in (by["jaxstation"], by[name])]
                        if all(pair):
                            ratios[f"jaxstation_k{k}{tag}_over_{name}"] = pair[0] / pair[1]
            for n in (n for n in prefill.get(name, {}) if n in prefill.get("jaxstation", {})):
                ratios[f"jaxstation_prefill{n}_over_{name}"] = (prefill["jaxstation"][n]["median"] /
                                                                prefill[name][n]["median"])

    ks = args.ks
    print("\n| system | " + " | ".join(f"K={k} tok/s" for k in ks) + " | best | latency e2e p50 / p99 s | "
          "latency tok/s | note |")
    print("|---|" + "---:|" * (len(ks) + 3) + "---|")
    for r in rows:
        cells = [f"{r['tokens_per_s'][str(k)]['median']:.1f}" if "tokens_per_s" in r else "-" for k in ks]
        best = f"{r['best_tokens_per_s']:.1f}" if "best_tokens_per_s" in r else "-"
        lat = r.get("latency") or {}
        e2e = f"{lat['e2e_s']['p50']:.2f} / {lat['e2e_s']['p99']:.2f}" if lat.get("e2e_s", {}).get("p50") else "-"
        ltps = f"{lat['achieved_tokens_per_s']:.1f}" if "achieved_tokens_per_s" in lat else "-"
        print(f"| {r['system']} | " + " | ".join(cells) + f" | {best} | {e2e} | {ltps} | {r['note'] or ''} |")
        if "sampled_tokens_per_s" in r:
            cells = [f"{r['sampled_tokens_per_s'][str(k)]['median']:.1f}" for k in ks]
            print(f"| {r['system']} sampled | " + " | ".join(cells) + " | - | - | - | temperature 0.8, top_p 0.95 |")
    for name, rates in prefill.items():
        for n, rate in rates.items():
            print(f"prefill {name:17s}: {n}-token prompt, {rate['median']:.1f} tok/s (median of {rate['n']})")
    for r in rows:
        if "start" in r:
            print(f"{r['system']:17s}: ready in {r['start']['ready_s']:.1f} s"
                  + (f" (cold: {r['cold_start']['ready_s']:.1f} s)" if "cold_start" in r else "")
                  + f", memory {r['start']['memory_mib']} MiB")
    print("ratios:", {k: round(v, 2) for k, v in ratios.items()})
    build = llama_server_build(binary) if "llama-server" in started else None
    path = write_result("peers", {"config": dict(vars(args)), "model": str(gguf), "bandwidth": bandwidth,
                                  "llama_server": build,
                                  "rows": rows, "ratios": ratios},
                        model=model_name(args.model), variant=args.name, read_bandwidth=bandwidth["read"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
