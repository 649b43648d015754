"""Shared bench plumbing: machine fingerprint, result files, bandwidth probe, timing."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def fingerprint() -> dict:
    """What machine this ran on, and a short hash of it for file names."""
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device": str(jax.devices()[0])}
    info["id"] = hashlib.sha1(json.dumps(info, sort_keys=True).encode()).hexdigest()[:8]
    return info


def write_result(name: str, payload: dict) -> Path:
    """Write bench/results/<name>-<date>-<machine>.json (or under $JAXSTATION_BENCH_RESULTS) and return its path."""
    fp = fingerprint()
    results = Path(os.environ.get("JAXSTATION_BENCH_RESULTS") or RESULTS)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}-{dt.date.today().isoformat()}-{fp['id']}.json"
    path.write_text(json.dumps({"bench": name, "machine": fp, "when": dt.datetime.now().isoformat(timespec="seconds"),
                                **payload}, indent=2))
    return path


def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Memory copy bandwidth in bytes copied per second (numpy, best of reps)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return nbytes / min(timed(lambda: np.copyto(dst, src)) for _ in range(reps))


def read_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Memory read bandwidth in bytes/s: a compiled XLA reduction over nbytes, on all cores (best of reps)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4 // 1024, 1024), jnp.float32)
    total = jax.jit(lambda a: jnp.sum(a, axis=0))
    total(x).block_until_ready()
    return nbytes / min(timed(lambda: total(x).block_until_ready()) for _ in range(reps))


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summary(samples: list[float]) -> dict:
    """Median and spread of repeated measurements."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}
