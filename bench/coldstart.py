"""Cold start: process start to /ready 200, with an empty persistent compilation cache and with a warm one.

Each rep starts `python -m jaxstation serve` twice on one fresh cache directory: first empty (everything compiles and
is written), then warm (everything is read back). The clock starts right before the process is spawned and stops at
the first 200 from /ready (polled every 50 ms); the station's own phase gauges (jaxstation_startup_seconds) and its
count of compiled vs cached programs are read from /metrics. Target: warm <= 50% of cold.

Usage:
  python -m bench.coldstart                         # the station's default shape (8 lanes x 2048), 3 reps
  python -m bench.coldstart --reps 1 --lanes 2 --max-seq 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_result
from bench.workload import REPO, free_port

PHASES = ("import", "weight_load", "arena_alloc", "warmup_programs", "ready")


def scrape_startup(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"phases": {}, "programs": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "jaxstation_startup_seconds":
                out["phases"][s.labels["phase"]] = s.value
            elif s.name == "jaxstation_startup_programs":
                out["programs"][s.labels["source"]] = int(s.value)
    return out


def start_to_ready(args, cache: Path, log: Path) -> dict:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "jaxstation", "serve", "--port", str(port), "--lanes", str(args.lanes),
           "--max-seq", str(args.max_seq), "--dtype", args.dtype, "--compile-cache-dir", str(cache)]
    base = f"http://127.0.0.1:{port}"
    with open(log, "ab") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=os.environ.copy())
        try:
            with httpx.Client(timeout=5) as client:
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"the station exited with {proc.returncode}; see {log}")
                    try:
                        if client.get(f"{base}/ready").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.perf_counter() - t0 > args.timeout:
                        raise RuntimeError(f"not ready after {args.timeout} s; see {log}")
                    time.sleep(0.05)
                wall = time.perf_counter() - t0
                startup = scrape_startup(client.get(f"{base}/metrics").text)
        finally:
            proc.terminate()
            proc.wait(60)
    return {"start_to_ready_s": wall, **startup}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()

    runs: dict[str, list[dict]] = {"empty": [], "warm": []}
    log = Path(tempfile.gettempdir()) / "jaxstation-bench-coldstart.log"
    log.write_bytes(b"")
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="jaxstation-cache-") as cache:
            for kind in ("empty", "warm"):
                r = start_to_ready(args, Path(cache), log)
                runs[kind].append(r)
                phases = " ".join(f"{p} {r['phases'].get(p, 0):.2f}" for p in PHASES)
                print(f"rep {rep} {kind:5s}: {r['start_to_ready_s']:6.2f} s to /ready  [{phases}]  "
                      f"programs {r['programs']}", flush=True)
    med = {k: statistics.median(r["start_to_ready_s"] for r in v) for k, v in runs.items()}
    ratio = med["warm"] / med["empty"]
    phase_medians = {k: {p: statistics.median(r["phases"].get(p, 0.0) for r in v) for p in PHASES}
                     for k, v in runs.items()}
    print(f"median process start -> /ready: empty cache {med['empty']:.2f} s, warm cache {med['warm']:.2f} s "
          f"({100 * ratio:.0f}%; target <= 50%)")
    out = {"config": vars(args), "runs": runs, "median_start_to_ready_s": med, "phase_medians_s": phase_medians,
           "targets": {"warm_over_empty": ratio}}
    print(f"wrote {write_result('coldstart', out)}")


if __name__ == "__main__":
    main()
