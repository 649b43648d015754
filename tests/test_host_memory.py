"""Freed host memory stays in the process (jaxstation/engine/host_memory.py): a large buffer allocated again after it
was freed is not paged in afresh, as a compiled step's temporary buffer is not."""

from __future__ import annotations

import ast
import ctypes
import mmap
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from jaxstation.engine import host_memory
    if sys.argv[1] == "keep":
        assert host_memory.keep_freed_memory()
    def faults() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        a = np.ones(64 << 20, np.uint8)  # 64 MB: above glibc's largest mmap threshold
        del a
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print([faults() for _ in range(3)][1:])  # the first allocation pages in either way
""")


def _faults(mode: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return ast.literal_eval(done.stdout.strip())


def test_a_freed_buffer_is_not_paged_in_again() -> None:
    assert resource.getpagesize() == 4096
    # glibc maps it afresh each time: a fault a page, 16,384 of them, or one per 2 MiB where the kernel backs the
    # mapping with transparent huge pages (numpy asks for them on large arrays), so 32 at the least
    assert min(_faults("default")) >= 32
    assert _faults("keep") == [0, 0]


RELEASE = textwrap.dedent("""
    import numpy as np
    from jaxstation.engine import host_memory
    assert host_memory.keep_freed_memory()
    a = np.ones(64 << 20, np.uint8)
    del a  # kept: still resident
    print(host_memory.release_freed_memory() >> 20)
""")


def test_freed_memory_is_handed_back_on_request() -> None:
    done = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) >= 60  # MiB of the 64 the kept buffer held


EXECUTION = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jaxstation.engine import host_memory
    assert host_memory.keep_freed_memory()
    f = jax.jit(lambda c: jnp.sort(jnp.arange(2 << 20, dtype=jnp.float32) * c)[0])  # 8 MiB of temporary buffer
    jax.block_until_ready([f(jnp.float32(i)) for i in range(16)])  # dispatched together: on XLA's execution threads
    print(host_memory.release_freed_memory() >> 20, host_memory.release_freed_memory(execution_threads=True) >> 20)
""")


def test_the_execution_threads_hand_back_their_steps_buffers() -> None:
    # the buffers lie at the tops of XLA's execution threads' malloc arenas, which malloc_trim leaves
    done = subprocess.run([sys.executable, "-c", EXECUTION], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    trimmed, from_the_threads = (int(x) for x in done.stdout.split())
    assert from_the_threads >= 7, (trimmed, from_the_threads)  # MiB: at least one thread's 8


def _smaps_of(address: int) -> dict[str, int]:
    """The kB fields of /proc/self/smaps for the mapping holding `address`."""
    fields: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.split()[-1] == "kB":
                fields[head.rstrip(":")] = int(line.split()[1])
    return fields


def _kernel_collapses() -> bool:
    """Whether this kernel backs a written 2 MiB range with a 2 MiB page on request."""
    from jaxstation.engine import host_memory

    region = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.write(b"\1" * (4 << 20))
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    start = -(-base // host_memory.HUGE_PAGE) * host_memory.HUGE_PAGE
    return host_memory.huge_pages([(start, host_memory.HUGE_PAGE)]) > 0


def test_resident_memory_goes_onto_2_mib_pages_and_nothing_is_paged_in() -> None:
    """An 8 MiB mapping with its first 5 MiB written: the two whole 2 MiB ranges in them go onto 2 MiB pages; the
    range half written and the one never written stay as they are."""
    from jaxstation.engine import host_memory

    region = mmap.mmap(-1, 10 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    start = -(-base // host_memory.HUGE_PAGE) * host_memory.HUGE_PAGE  # the first 2 MiB boundary in it
    libc = ctypes.CDLL(None)
    libc.madvise(ctypes.c_void_p(base), ctypes.c_size_t(10 << 20), 15)  # MADV_NOHUGEPAGE: 4 KB pages when written
    offset = start - base
    region[offset:offset + (5 << 20)] = b"\1" * (5 << 20)
    libc.madvise(ctypes.c_void_p(base), ctypes.c_size_t(10 << 20), 14)  # MADV_HUGEPAGE: eligible again, as the heap is
    if not _kernel_collapses():
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux 6.1+) or transparent huge pages are off")
    before = _smaps_of(start)
    done = host_memory.huge_pages([(start, 8 << 20)])
    after = _smaps_of(start)
    assert done == 4 << 20
    assert after["AnonHugePages"] - before["AnonHugePages"] == 4 << 10  # kB
    assert after["Rss"] == before["Rss"] == 5 << 10  # nothing paged in
    region.close()


HEAD = textwrap.dedent("""
    import sys
    import jax
    sys.path.insert(0, sys.argv[1])
    from test_host_memory import _huge_kb_over
    from jaxstation.config.plan import load_planned, resolve_plan
    from jaxstation.config.settings import StationConfig
    from jaxstation.engine import host_memory
    from jaxstation.model.loader import checkpoint_config
    config = StationConfig()
    model = load_planned(config, resolve_plan(config, checkpoint_config(config.model)))
    host_memory.settle_pages()
    head = max(jax.tree_util.tree_leaves(model.params), key=lambda a: a.nbytes)
    print([head.nbytes, _huge_kb_over(head.unsafe_buffer_pointer(), head.nbytes) << 10])
""")


def _huge_kb_over(address: int, size: int) -> int:
    """AnonHugePages (kB) of the mappings that hold any of [address, address + size)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < address + size and address < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


def test_a_loaded_models_head_lies_on_2_mib_pages() -> None:
    """The default model loaded as a station plans it, in a process of its own: its tied embedding and head (30 MB of
    Q8_0 blocks), read whole every step, on 2 MiB pages but for the partial ranges at its two ends."""
    if not _kernel_collapses():
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux 6.1+) or transparent huge pages are off")
    done = subprocess.run([sys.executable, "-c", HEAD, str(Path(__file__).parent)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    size, huge = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert size > 30e6
    assert huge >= size - 2 * (2 << 20)


def test_a_cpu_arrays_span_is_its_buffer() -> None:
    import jax.numpy as jnp
    import numpy as np

    from jaxstation.engine import host_memory

    a = jnp.arange(1 << 20, dtype=jnp.float32)
    ((address, size),) = host_memory.array_spans({"a": a, "b": None})
    assert size == 4 << 20 and address == a.unsafe_buffer_pointer()
    assert np.array_equal(np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_float)), (1 << 20,)),
                          np.arange(1 << 20, dtype=np.float32))


SPLIT = textwrap.dedent("""
    import ctypes, sys
    import jax.numpy as jnp
    sys.path.insert(0, sys.argv[1])
    from test_host_memory import _smaps_of
    from jaxstation.engine import host_memory
    a = jnp.ones(4 << 20, jnp.float32)  # 16 MiB
    total = host_memory.keep_on_huge_pages({"w": a, "scale": None})
    host_memory.settle_pages()
    inside = -(-a.unsafe_buffer_pointer() // host_memory.HUGE_PAGE) * host_memory.HUGE_PAGE
    whole = _smaps_of(inside)["AnonHugePages"]
    huge = whole << 10
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(inside, 4096, 1) == 0 and libc.mprotect(inside, 4096, 3) == 0  # PROT_READ, then | WRITE
    split = _smaps_of(inside)["AnonHugePages"]
    host_memory.release_freed_memory()
    host_memory.settle_pages()
    print([huge >> 20, total >> 20, whole >> 10, split >> 10, _smaps_of(inside)["AnonHugePages"] >> 10,
           float(a.sum()) == 4 << 20])
""")


def test_kept_arrays_go_back_onto_2_mib_pages_after_a_release() -> None:
    """In a process of its own, a 16 MiB array kept on 2 MiB pages, one of whose pages is then split (a 4 KB piece's
    protection changed and restored, as a trim beside it splits it): on 2 MiB pages again once freed memory is handed
    back, its values unchanged."""
    if not _kernel_collapses():
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux 6.1+) or transparent huge pages are off")
    done = subprocess.run([sys.executable, "-c", SPLIT, str(Path(__file__).parent)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    huge, total, whole, split, again, same = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert total == 16 and huge >= 14 and whole >= 14  # MiB
    assert split == whole - 2
    assert again == whole and same


DEFERRED = textwrap.dedent("""
    import sys, time
    import jax.numpy as jnp
    sys.path.insert(0, sys.argv[1])
    from test_host_memory import _smaps_of
    from jaxstation.engine import host_memory
    a = jnp.ones(4 << 20, jnp.float32)  # 16 MiB
    inside = -(-a.unsafe_buffer_pointer() // host_memory.HUGE_PAGE) * host_memory.HUGE_PAGE
    with host_memory.paging_deferred():
        host_memory.keep_on_huge_pages({"w": a})
        time.sleep(1.0)  # the pager collapses 16 MiB in milliseconds where it may start
        held = _smaps_of(inside)["AnonHugePages"]
    host_memory.settle_pages()
    print([held >> 10, _smaps_of(inside)["AnonHugePages"] >> 10])
""")


def test_the_pager_waits_while_paging_is_deferred() -> None:
    """In a process of its own, a 16 MiB array kept on 2 MiB pages while paging is deferred (as a station's start-up
    does): on 4 KB pages until the deferral ends, then on 2 MiB pages."""
    if not _kernel_collapses():
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux 6.1+) or transparent huge pages are off")
    done = subprocess.run([sys.executable, "-c", DEFERRED, str(Path(__file__).parent)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    held, after = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert held == 0 and after >= 14  # MiB
