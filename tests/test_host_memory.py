"""Freed host memory stays in the process (jaxstation/kernels/host_memory.py): a large buffer allocated again after it
was freed is not paged in afresh, as a compiled step's temporary buffer is not."""

from __future__ import annotations

import ast
import resource
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from jaxstation.kernels import host_memory
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
    from jaxstation.kernels import host_memory
    assert host_memory.keep_freed_memory()
    a = np.ones(64 << 20, np.uint8)
    del a  # kept: still resident
    print(host_memory.release_freed_memory() >> 20)
""")


def test_freed_memory_is_handed_back_on_request() -> None:
    done = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) >= 60  # MiB of the 64 the kept buffer held
