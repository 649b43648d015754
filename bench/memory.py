"""A station's resident memory at each start-up phase, and what holds it once it is ready.

Loads and warms up a station as `serve` does (the settings come from the MOONSHINE_* environment and the flags below),
recording /proc/self/status's VmRSS, RssAnon and RssFile as each start-up phase ends; then lists the live device
arrays by dtype, every numpy array over 10 MiB still referenced, the resident memory by mapping; with `--serve N`, the
memory once N requests (half greedy, half top-p sampled, prompts of 64 to 1,024 tokens, 128 new tokens each) have run
through the station's scheduler (every lane busy with MOONSHINE_CONTINUOUS_BATCH=1), with the bytes the prefix cache's
host tier then holds (MOONSHINE_PREFIX_CACHE_RAM bounds it), and once the idle station has handed its steps' freed
memory back; and what dropping the compiled programs (`jax.clear_caches`) would hand back. Memory only: nothing here
is timed. Writes each phase's figures, MiB, to bench/results/memory-<model>.json.

Usage:
  MOONSHINE_CONTINUOUS_BATCH=1 python -m bench.memory --model gemma-3-270m-q4_k_m.gguf --lanes 8 --max-seq 32768 \
      --kv-dtype int8 --serve 32
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import re
import time

import jax
import numpy as np

from bench.common import add_name_arg, model_name, write_result
from jaxstation.config.coldstart import StartupClock
from jaxstation.config.settings import resolve
from jaxstation.engine import host_memory
from jaxstation.engine.jobs import Job
from jaxstation.engine.rows import SamplingParams
from jaxstation.server.station import Station

MiB = 2**20


def status() -> dict[str, float]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}


def show(tag: str, phases: dict[str, dict[str, float]]) -> None:
    """Print the process's memory now and record it in `phases` under `tag`."""
    s = phases[tag] = status()
    print(f"{tag:24s} rss {s['VmRSS']:7.0f} MiB  anon {s['RssAnon']:7.0f}  file {s['RssFile']:6.0f}  "
          f"peak {s['VmHWM']:7.0f}", flush=True)


def mappings() -> collections.Counter:
    """Resident KiB by mapping: the file it maps, [heap], or [anon]."""
    rss: collections.Counter = collections.Counter()
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else "[anon]"
            elif line.startswith("Rss:"):
                rss[name] += int(line.split()[1])
    return rss


def run_requests(station: Station, n: int) -> None:
    """n requests through the station's scheduler at once: prompts of 64 to 1,024 random tokens (fewer where the
    context is shorter), 128 new tokens each, every other one sampled (temperature 0.8, top_p 0.95)."""
    rng = np.random.default_rng(0)
    vocab, longest = station.model.cfg.vocab_size, min(1024, station.config.max_seq - 129)  # prompt + 128 must fit
    jobs = [Job(tokens=rng.integers(3, vocab, int(rng.integers(min(64, longest), longest + 1))).tolist(),
                max_new_tokens=128,
                sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=i) if i % 2 else SamplingParams())
            for i in range(n)]
    for job in jobs:
        station.scheduler.submit(job)
    for job in jobs:
        job.future.result(timeout=1800)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--lanes")
    parser.add_argument("--max-seq")
    parser.add_argument("--kv-dtype")
    parser.add_argument("--serve", type=int, default=0, help="requests to run once ready, then measure again")
    add_name_arg(parser)
    args = parser.parse_args()
    names = {"model": "MOONSHINE_MODEL", "lanes": "MOONSHINE_BATCH_LANES", "max_seq": "MOONSHINE_MAX_SEQ",
             "kv_dtype": "MOONSHINE_KV_DTYPE"}
    env = {**os.environ, **{names[k]: getattr(args, k) for k in names if getattr(args, k) is not None}}
    phases: dict[str, dict[str, float]] = {}
    show("imports", phases)
    clock = StartupClock()
    clock.add_sink(lambda phase, _seconds: show(phase, phases))
    station = Station(resolve(env=env, command="serve"), clock=clock)
    station._load()
    if station.load_error:
        raise SystemExit(station.load_error)
    by_dtype: collections.Counter = collections.Counter()
    for a in jax.live_arrays():
        by_dtype[str(a.dtype)] += a.nbytes
    print("live device arrays, MiB:", {k: round(v / MiB, 1) for k, v in sorted(by_dtype.items())},
          f"total {sum(by_dtype.values()) / MiB:.1f}")
    gc.collect()
    for o in gc.get_objects():
        if isinstance(o, np.ndarray) and o.nbytes > 10 * MiB:
            print(f"numpy array held: {type(o).__name__} {o.shape} {o.dtype} {o.nbytes / MiB:.1f} MiB")
    for name, kib in mappings().most_common(8):
        print(f"mapping {kib / 1024:8.1f} MiB  {name}")
    if args.serve:
        run_requests(station, args.serve)
        show("served", phases)
        host_tier = station.scheduler.prefix_tier.host.nbytes / MiB
        print(f"the prefix cache's host tier holds {host_tier:.1f} MiB")
        time.sleep(host_memory.IDLE_RELEASE_S + 1)  # the decode thread hands the steps' freed memory back
        show("idle", phases)
    station.shutdown(0)
    jax.clear_caches()
    gc.collect()
    host_memory.release_freed_memory()
    show("programs dropped", phases)
    path = write_result("memory", {"config": vars(args), "phases": phases,
                                   "prefix_host_tier_mib": host_tier if args.serve else None},
                        model=model_name(args.model), variant=args.name)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
