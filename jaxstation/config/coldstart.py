"""Cold start: how long each start-up phase takes, and the persistent compilation cache that makes it short.

A station scaled from zero (Cloud Run) pays for the Python imports, the weight load, the KV arena allocation and the
compilation of every step shape before /ready turns 200. `StartupClock` logs each phase as it ends and hands it to
/metrics. `enable_compile_cache` turns on JAX's persistent compilation cache with both thresholds at zero, so every
program the start-up compiles (the steps, and the small ones that loading and allocation run) is written once and read
back on the next start. `CompileCount` counts XLA compilations and persistent-cache hits from JAX's monitoring events:
a start on a warm cache compiles nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxstation.config.settings import ConfigError

log = logging.getLogger(__name__)

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # every compile request, hit or not
_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def process_start_time() -> float:
    """When this process started, as time.time() (Linux /proc, 10 ms resolution); now where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


class StartupClock:
    """Start-up phases in seconds, in the order they ended. `t0` (time.time()) is where "ready" counts from."""

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = time.time() if t0 is None else t0
        self.phases: dict[str, float] = {}
        self._sinks: list[Callable[[str, float], None]] = []

    @classmethod
    def from_process_start(cls) -> StartupClock:
        """A clock from process start, with the time until now recorded as the "import" phase."""
        clock = cls(process_start_time())
        clock.record("import", clock.since_start())
        return clock

    def since_start(self) -> float:
        return time.time() - self.t0

    def add_sink(self, sink: Callable[[str, float], None]) -> None:
        """Call sink(phase, seconds) for every phase recorded so far and from now on."""
        self._sinks.append(sink)
        for name, seconds in self.phases.items():
            sink(name, seconds)

    def record(self, name: str, seconds: float) -> None:
        self.phases[name] = seconds
        log.info("start-up phase %s: %.2f s", name, seconds)
        for sink in self._sinks:
            sink(name, seconds)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        yield
        self.record(name, time.perf_counter() - t)


class CompileCount:
    """XLA compile requests and persistent-cache hits in this process since `__init__` (all threads)."""

    _lock = threading.Lock()
    _requests = 0
    _hits = 0
    _installed = False

    def __init__(self) -> None:
        self._install()
        self._start = self._totals()

    @classmethod
    def _install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            cls._installed = True
        jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
        jax.monitoring.register_event_listener(cls._on_event)

    @classmethod
    def _on_duration(cls, event: str, duration: float, **kwargs: object) -> None:
        if event == _COMPILE_EVENT:
            with cls._lock:
                cls._requests += 1

    @classmethod
    def _on_event(cls, event: str, **kwargs: object) -> None:
        if event == _HIT_EVENT:
            with cls._lock:
                cls._hits += 1

    @classmethod
    def _totals(cls) -> tuple[int, int]:
        with cls._lock:
            return cls._requests, cls._hits

    def delta(self) -> tuple[int, int]:
        """(programs XLA compiled, programs read from the persistent cache) since this counter was made."""
        requests, hits = (now - then for now, then in zip(self._totals(), self._start, strict=True))
        return requests - hits, hits


def is_local(path: str) -> bool:
    """Whether a cache path is on this machine's file system (a plain path, or file://)."""
    return "://" not in path or path.startswith("file://")


def enable_compile_cache(path: str | None) -> None:
    """Turn on JAX's persistent compilation cache at `path` (local, a mounted volume, or gs://); None leaves it off.

    Both thresholds go to zero so that every program is cached, however small or quick to compile. Process-wide.
    """
    if not path:
        return
    if not is_local(path):
        try:
            import etils.epath  # noqa: F401  (JAX reads and writes non-local caches through it)
        except ImportError:
            raise ConfigError(f"MOONSHINE_COMPILE_CACHE_DIR={path!r} is not a local path: install the `gcs` extra "
                              "(etils[epath] and gcsfs) to use it") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()  # a process that already compiled without a cache looks again
    log.info("persistent compilation cache at %s", path)
