"""The host memory under the engine's steps, as the process's malloc and the kernel's pages hold it: freed memory kept
in the process while steps run, handed back when they do not, and the weights on 2 MiB pages.

XLA's CPU runtime allocates a temporary buffer each time a compiled step runs and frees it after; glibc would map a
large one afresh and unmap it on free, so every step would fault each of its pages in again. `keep_freed_memory` has
glibc keep freed memory instead; it sets a process-wide policy, so the station sets it once, at start-up
(server/station.py), never an engine as it is built. Start-up frees much more than a step reuses, so the warm-up and a
decode thread idle for IDLE_RELEASE_S hand what is free back (`release_freed_memory`, `IdleRelease`). A step reads
every weight once, and the TLB holds 2 MiB pages of them whole (`keep_on_huge_pages`). Making them costs the kernel
seconds for an 8B model's weights (a copy of every page, and the compaction that frees 2 MiB blocks), so a thread of
their own does it (`_pager`) once the start-up is done (`paging_deferred`: it would take a core from the compiles
and fault the arena's pages in slower) and while the station serves, the weights read from 4 KB pages until their
range moves. Where the C library is not glibc, or the kernel cannot, each does nothing (docs/cpu.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import queue
import resource
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # glibc's mallopt parameters
MADV_COLLAPSE = 25  # Linux 6.1+: back a range with transparent huge pages now
PAGE, HUGE_PAGE = 4096, 1 << 21
RESIDENT_SHARE = 15 / 16  # a 2 MiB range is collapsed only where this share of its pages is resident already
IDLE_RELEASE_S = 2.0  # seconds a thread waits without work after a step before it hands the freed memory back
KEEP = 1 << 30  # bytes a heap keeps free: past a thread arena's whole heap (64 MiB), so none is unmapped
SCRATCH_BYTES = 1 << 17  # a chunk this large, freed, trims its arena (glibc: 64 KiB and up)
SCRATCH_RUNS = 4  # runs of the scratch program a core: a run goes to whichever execution thread is free


def _libc(name: str) -> Callable | None:
    """The C library's function `name`, or None where it has none (it is not glibc)."""
    try:
        return getattr(_c_library(), name)
    except (OSError, AttributeError):
        return None


@functools.cache
def _c_library() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


@functools.cache
def keep_freed_memory() -> bool:
    """Ask glibc to serve large allocations from its heaps and keep freed memory (once a process, on a CPU backend:
    elsewhere the steps' buffers are the device's). Returns whether it took effect.

    With mmap off for allocations (`M_MMAP_MAX` 0) glibc serves them from its heaps; a trim threshold and a top pad of
    KEEP bytes keep what is freed, the pad also stopping a thread's arena from unmapping a whole 64 MiB heap the
    buffer had to itself. The cost is that the process does not hand freed memory back to the system until a release
    (`release_freed_memory`)."""
    if jax.default_backend() != "cpu" or (mallopt := _libc("mallopt")) is None:
        return False
    done = all(mallopt(param, value) for param, value in
               ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEEP), (M_TOP_PAD, KEEP)))
    if not done:
        log.warning("glibc's mallopt refused: steps keep paging their buffers in")
    return done


def release_freed_memory(execution_threads: bool = False) -> int:
    """Hand the pages malloc holds free back to the system (glibc's `malloc_trim`, every arena, and with
    `execution_threads` the free tops of XLA's CPU execution threads' arenas, where steps ran) despite the trim
    threshold `keep_freed_memory` set. Returns the resident bytes this freed (0 where the C library is not glibc)."""
    if (trim := _libc("malloc_trim")) is None:
        return 0
    before = resident_bytes()
    trim(0)
    if execution_threads:
        _trim_execution_threads()
    _pager().put(array_spans([a for r in _kept_huge if (a := r()) is not None]))
    return max(0, before - resident_bytes())


def huge_pages(spans: Iterable[tuple[int, int]]) -> int:
    """Back the memory of `spans` ((address, bytes) each) with 2 MiB pages (MADV_COLLAPSE, Linux 6.1+): every 2 MiB
    range a span touches whose 4 KB pages are at least RESIDENT_SHARE resident (so at most a 16th of it is paged in).
    Returns the bytes now on 2 MiB pages (0 where the kernel or the C library cannot: not Linux on 4 KB pages, before
    Linux 6.1, transparent huge pages off)."""
    mincore, madvise = _libc("mincore"), _libc("madvise")
    if not sys.platform.startswith("linux") or resource.getpagesize() != PAGE or mincore is None or madvise is None:
        return 0
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    starts = sorted({r for at, n in spans for r in range(at // HUGE_PAGE * HUGE_PAGE, at + n, HUGE_PAGE)})
    pages = (ctypes.c_ubyte * (HUGE_PAGE // PAGE))()
    done = 0
    for start in starts:
        if mincore(start, HUGE_PAGE, pages) != 0:  # partly unmapped
            continue
        if sum(b & 1 for b in pages) >= RESIDENT_SHARE * len(pages) and madvise(start, HUGE_PAGE, MADV_COLLAPSE) == 0:
            done += HUGE_PAGE
    return done


def array_spans(tree: object) -> list[tuple[int, int]]:
    """(address, bytes) of each array of `tree` that one CPU device holds whole."""
    return [(a.unsafe_buffer_pointer(), a.nbytes) for a in _cpu_arrays(tree)]


def _cpu_arrays(tree: object) -> list[jax.Array]:
    return [a for a in jax.tree_util.tree_leaves(tree)
            if isinstance(a, jax.Array) and len(a.devices()) == 1 and next(iter(a.devices())).platform == "cpu"]


_kept_huge: list[weakref.ref] = []  # arrays kept on 2 MiB pages, while they live
_deferrals = threading.Condition()  # guards _deferred: while it is above 0, the pager starts no span list
_deferred = 0


@contextlib.contextmanager
def paging_deferred() -> Iterator[None]:
    """Within it, the pager thread starts no new span list (those asked for wait until the last such block ends)."""
    global _deferred
    with _deferrals:
        _deferred += 1
    try:
        yield
    finally:
        with _deferrals:
            _deferred -= 1
            _deferrals.notify_all()


def keep_on_huge_pages(tree: object) -> int:
    """Have the CPU arrays of `tree` (a model's weights) put on 2 MiB pages (`huge_pages`) by the pager thread, from
    now on and again after every `release_freed_memory`: trimming a freed chunk beside a weight splits the 2 MiB page
    they share. Returns the bytes of the arrays."""
    arrays = _cpu_arrays(tree)
    _kept_huge[:] = [r for r in _kept_huge if r() is not None] + [weakref.ref(a) for a in arrays]
    _pager().put(array_spans(arrays))
    return sum(a.nbytes for a in arrays)


@functools.cache
def _pager() -> queue.Queue:
    """The queue of span lists a daemon thread puts on 2 MiB pages, in turn (one thread a process, started at first
    use). Spans of memory freed before their turn are skipped: `huge_pages` leaves unmapped ranges alone."""
    work: queue.Queue = queue.Queue()

    def run() -> None:
        while True:
            spans = work.get()
            try:
                with _deferrals:
                    _deferrals.wait_for(lambda: _deferred == 0)
                t0 = time.perf_counter()
                done = huge_pages(spans)
                log.debug("%d MiB of weights on 2 MiB pages in %.1f s", done >> 20, time.perf_counter() - t0)
            finally:
                work.task_done()

    threading.Thread(target=run, name="jaxstation-pager", daemon=True).start()
    return work


def settle_pages() -> None:
    """Wait until the pager thread has put every span asked for so far on 2 MiB pages (or found it cannot)."""
    _pager().join()


def _trim_execution_threads() -> None:
    """Hand back the free tops of the malloc arenas of XLA's CPU execution threads, where a step's temporary buffer
    lives: `malloc_trim` trims no thread arena's top, but glibc trims an arena whenever a large chunk of it is freed. So
    with the trim threshold and pad lowered, a small program runs SCRATCH_RUNS times a core, its runs dispatched
    together so that every execution thread takes some (each run allocates its temporary buffer on the thread that runs
    it and frees it there); then the threshold and pad go back to what `keep_freed_memory` set."""
    mallopt = _libc("mallopt")
    cpu = jax.local_devices(backend="cpu")[0]
    mallopt(M_TRIM_THRESHOLD, SCRATCH_BYTES // 2)
    mallopt(M_TOP_PAD, 0)
    try:
        jax.block_until_ready([_scratch_program()(jax.device_put(np.float32(i), cpu))
                               for i in range(SCRATCH_RUNS * (os.cpu_count() or 1))])
    finally:
        mallopt(M_TRIM_THRESHOLD, KEEP)
        mallopt(M_TOP_PAD, KEEP)


@functools.cache
def _scratch_program() -> Callable:
    """A program whose temporary buffer is SCRATCH_BYTES: a sort of that many bytes of float32, a few milliseconds
    long, so that every execution thread takes runs before the first thread is done with them all."""
    return jax.jit(lambda c: jnp.sort(jnp.arange(SCRATCH_BYTES // 4, dtype=jnp.float32) * c)[0])


def resident_bytes() -> int:
    """The process's resident set (VmRSS) in bytes, 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


class IdleRelease:
    """A thread's waits for work, which hand the freed memory back once it has waited IDLE_RELEASE_S since a step."""

    def __init__(self) -> None:
        self._released_at = 0  # the caller's step count when it last handed memory back

    def wait(self, cond: threading.Condition, steps: int) -> None:
        """One wait on `cond`, which the caller holds once; past IDLE_RELEASE_S, the first since step `steps`, hand the
        freed memory back, with `cond` released meanwhile."""
        if self._released_at == steps:
            cond.wait()
        elif not cond.wait(IDLE_RELEASE_S):
            self._released_at = steps
            cond.release()
            try:
                freed = release_freed_memory(execution_threads=jax.default_backend() == "cpu")
            finally:
                cond.acquire()
            log.debug("idle: handed %d MiB of freed memory back", freed >> 20)
