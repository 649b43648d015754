"""Shared bench plumbing: result files (the machine, the commit, the command), the bandwidth probe, timing."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = "runs"  # under the results folder, git-ignored: variants, reruns and probes
DEFAULT_MODEL = "smollm2"  # the default model's name in result files
DEFAULT_FILE = "smollm2-135m-instruct.q4_1"  # the default model's GGUF file (or served name), lower-cased
KERNEL_FLAGS = re.compile(r"avx512\w*|amx\w*|avx_vnni\w*")  # the CPU flags the kernels' paths choose between


def cpu_flags() -> list[str]:
    """The CPU's flags that choose a kernel path (avx512*, amx*, avx_vnni), sorted; empty where /proc has none."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(f for f in line.split(":", 1)[1].split() if KERNEL_FLAGS.fullmatch(f))


def fingerprint(read_bandwidth: float | None = None) -> dict:
    """What machine this ran on: the CPU, its cores and kernel flags, the read bandwidth, jax and its device, and a
    short hash of the CPU, cores, jax and device."""
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    device = jax.devices()[0]
    info = {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device": str(device), "device_kind": device.device_kind}
    info["id"] = hashlib.sha1(json.dumps(info, sort_keys=True).encode()).hexdigest()[:8]
    return {**info, "flags": cpu_flags(), "read_bandwidth": read_bandwidth}


def model_name(model: str | None = None, shape: str | None = None) -> str:
    """A model's name in result files: a --shape's name, a checkpoint's file or directory name (or a served model's
    name) lower-cased and less `.gguf`, or `smollm2` for the default model."""
    if shape:
        return shape
    name = Path(model).name.lower().removesuffix(".gguf") if model else DEFAULT_MODEL
    return DEFAULT_MODEL if name == DEFAULT_FILE else name


def commit() -> str | None:
    """The checked-out commit, short, with `-dirty` when tracked files differ from it; None outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def command() -> str:
    """The command line that ran this process, as `python -m bench.NAME ARGS` for a module."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    head = ["python", "-m", spec.name] if spec and spec.name else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def result_path(bench: str, model: str = DEFAULT_MODEL, variant: str | None = None) -> Path:
    """Where a run's result goes: the canonical `<results>/<bench>-<model>.json`, which the next canonical run
    replaces, or for a `variant` (a bench's --name) `<results>/runs/<variant>-<model>-<time>.json`, which git ignores.
    <results> is bench/results, or $JAXSTATION_BENCH_RESULTS."""
    results = Path(os.environ.get("JAXSTATION_BENCH_RESULTS") or RESULTS)
    if variant is None:
        return results / f"{bench}-{model}.json"
    return results / RUNS / f"{variant}-{model}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"


def write_result(bench: str, payload: dict, *, model: str = DEFAULT_MODEL, variant: str | None = None,
                 read_bandwidth: float | None = None) -> Path:
    """Write a run's result (see `result_path`) with the machine, the commit, the command and the date, and return
    its path. `read_bandwidth` is the bench's own measurement; without one, a short probe runs now."""
    if read_bandwidth is None:
        read_bandwidth = ReadProbe(256 << 20).best(3)
    path = result_path(bench, model, variant)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {"bench": bench, "machine": fingerprint(read_bandwidth), "commit": commit(), "command": command(),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    path.write_text(json.dumps({**head, **payload}, indent=2) + "\n")
    return path


def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Memory copy bandwidth in bytes copied per second (numpy, best of reps)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return nbytes / min(timed(lambda: np.copyto(dst, src)) for _ in range(reps))


class ReadProbe:
    """One pass of a compiled XLA reduction over `nbytes` on all cores: the memory's read bandwidth at the moment it
    runs. The machine's speed drifts over seconds, so a bench that compares a step against the roofline takes a probe
    beside each of its steps."""

    def __init__(self, nbytes: int = 512 << 20) -> None:
        import jax
        import jax.numpy as jnp

        self.nbytes = nbytes
        self._x = jnp.ones((nbytes // 4 // 1024, 1024), jnp.float32)
        self._total = jax.jit(lambda a: jnp.sum(a, axis=0))
        self._total(self._x).block_until_ready()

    def __call__(self) -> float:
        """Bytes read per second, one pass."""
        return self.nbytes / timed(lambda: self._total(self._x).block_until_ready())

    def best(self, reps: int = 5) -> float:
        """Bytes read per second, the best of `reps` passes."""
        return max(self() for _ in range(reps))


def read_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Memory read bandwidth in bytes/s: a compiled XLA reduction over nbytes, on all cores (best of reps)."""
    return ReadProbe(nbytes).best(reps)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summary(samples: list[float]) -> dict:
    """Median and spread of repeated measurements."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def add_model_args(ap) -> None:
    """--shape / --dtype / --layer-loop / --matmul / --attention: which model a bench runs, and how."""
    from jaxstation.model.shapes import ARCHITECTURES

    ap.add_argument("--model", default=None, help="a checkpoint (GGUF file or HF directory) instead of the default")
    ap.add_argument("--shape", default=None,
                    help=f"a named architecture with random weights ({', '.join(ARCHITECTURES)}) instead of the "
                         "default model; needs no checkpoint")
    ap.add_argument("--dtype", default=None,
                    help="gguf, gguf-exact, float32, bfloat16 or int8 (default: the backend's)")
    ap.add_argument("--layer-loop", default="auto", help="scan, unroll or auto (the backend's)")
    ap.add_argument("--matmul", default="auto", help="kernel, xla or auto (the backend's)")
    ap.add_argument("--attention", default="auto", help="blocked, xla, cudnn or auto (the backend's)")


def add_name_arg(ap) -> None:
    """--name NAME: a variant run, whose result goes to bench/results/runs/ (git-ignored) instead of the canonical
    file."""
    ap.add_argument("--name", default=None,
                    help="a variant run: its result goes to bench/results/runs/ under NAME, not to the canonical file")


def add_lane_sweep_args(ap, reps: int) -> None:
    """A decode-step sweep's flags: lane counts, the live position, the arena's positions, repetitions, --name."""
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--live", type=int, default=512)
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=reps)
    add_name_arg(ap)


def keep_freed_memory() -> None:
    """Keep freed memory in this process, as a station does at start-up (jaxstation/engine/host_memory.py)."""
    from jaxstation.engine import host_memory

    host_memory.keep_freed_memory()


def settle_pages() -> None:
    """Wait for the weights to lie on 2 MiB pages, which a station's pager does beside its warm-up, before timing."""
    from jaxstation.engine import host_memory

    host_memory.settle_pages()


def bench_model(args, max_seq: int, tensor_parallel: int = 1):
    """(LoadedModel, Engine keyword arguments) for the model args, as a station with max_seq split over
    `tensor_parallel` devices would plan them, its weights on 2 MiB pages before anything is timed; the process keeps
    freed memory as a station's does."""
    from jaxstation.config.plan import load_planned, resolve_plan
    from jaxstation.config.settings import StationConfig
    from jaxstation.model.loader import checkpoint_config
    from jaxstation.model.shapes import ARCHITECTURES, random_model

    keep_freed_memory()
    station = StationConfig(model=f"random:{args.shape}" if args.shape else args.model,  # random weights: no file
                            dtype=args.dtype, layer_loop=args.layer_loop, matmul=args.matmul, attention=args.attention,
                            max_seq=max_seq, prefill_chunk=1, kv_block=1, tensor_parallel=tensor_parallel)
    plan = resolve_plan(station, ARCHITECTURES[args.shape] if args.shape else checkpoint_config(args.model))
    if args.shape:
        model = random_model(args.shape, plan.dtype, plan.layer_loop, matmul=plan.matmul, shards=tensor_parallel)
    else:
        model = load_planned(station, plan)
        settle_pages()
    args.dtype, args.layer_loop, args.matmul, args.attention = plan.dtype, plan.layer_loop, plan.matmul, plan.attention
    return model, {"attention": args.attention}


def planned_model(**settings):
    """(LoadedModel, Plan): the default model as a station of `settings` on this machine plans and loads it, its
    weights on 2 MiB pages; the process keeps freed memory as a station's does."""
    from jaxstation.config.plan import load_planned, resolve_plan
    from jaxstation.config.settings import StationConfig
    from jaxstation.model.loader import checkpoint_config

    keep_freed_memory()
    station = StationConfig(**settings)
    plan = resolve_plan(station, checkpoint_config(station.model))
    model = load_planned(station, plan)
    settle_pages()
    return model, plan


def wait_ready(proc, base: str, timeout: float) -> None:
    """Wait until the station process `proc` at `base` answers /ready with 200; RuntimeError if it exits first or
    takes longer than `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the station exited {proc.returncode} before it was ready")
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the station was not ready within {timeout} s")
