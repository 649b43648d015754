"""The CPU kernels (jaxstation/kernels/*.cc, one file per kernel family, and their shared cpu_kernels.h): build them
once into one library, register them with XLA, call them.

XLA's CPU dot has two problems for a decode step. With int8 weights it converts them to float32 in memory before the
dot, so a step moves more bytes than with float32 weights (and it has no GGUF block formats at all). And it picks a
different algorithm for one row than for several, so a row's bits depend on how many rows share the call. The matmul
kernel reads int8 (or float32) weights straight from their buffers, and computes each output with one fixed sequence
of operations whatever the number of rows; GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) are read as
stored, and either multiplied in integers with each activation row rounded to 8 bits per 32 columns from that row
alone (as llama.cpp does, in one fixed order per output, so the rows beside a row still change nothing), or rebuilt in
registers into exactly the float32 weights the gguf package's dequantization gives. The decode
attention kernel reads each row's own lane of the KV arena in place, only the positions the row attends to, with no
per-block loop; a row's result again depends on nothing else. The RMSNorm kernel normalises each row in one call where
XLA needs a handful of fusions for a row-invariant sum: an unrolled 30-layer step then has about half the fusions, and
compiles faster.

It is compiled at first use with the system C++ compiler against the jaxlib headers (`jax.ffi.include_dir()`), for this
machine's CPU (`-march=native`: the AVX-512 variant where the CPU has it, else AVX2), a compiler process a source file
at once, and cached under ~/.cache/jaxstation/kernels keyed by every source and header, flags, compiler, jaxlib and the
CPU; processes that need a library at once build it once, the others waiting on its lock. Without a compiler, or off
x86-64 with AVX2, FMA and F16C, `available()` says why and the station keeps XLA's dot.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent
SOURCES = tuple(sorted(KERNEL_DIR.glob("*.cc")))  # one file per kernel family, compiled into one library
HEADERS = tuple(sorted(KERNEL_DIR.glob("*.h")))  # what the sources share
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
# "avx2" builds the AVX2 variant (integer dot products by maddubs) on a CPU that has AVX-512 and VNNI too, to test or
# compare it; "avx-vnni" the AVX2 variant with AVX-VNNI's vpdpbusd; "avx512" the AVX-512 variant without VNNI;
# "avx512-vnni" the AVX-512 VNNI variant without AMX tiles (on a CPU with AMX); "amx-emulated" the AVX-512 VNNI variant
# with its AMX code path run on tiles emulated in plain loops (amx_tiles.h), on a CPU without AMX. Unset, the CPU
# decides.
ISA_ENV = "JAXSTATION_KERNEL_ISA"
ISA_FLAGS = {"": (), "avx2": ("-mno-avx512f", "-mno-avxvnni"), "avx-vnni": ("-mno-avx512f",),
             "avx512": ("-mno-avx512vnni",), "avx512-vnni": ("-mno-amx-tile", "-mno-amx-int8"),
             "amx-emulated": ("-DJAXSTATION_AMX_EMULATED",)}
# How long, in microseconds, the kernels' own workers spin after each job before they sleep (cpu_kernels.h): the next
# kernel call of a step finds them awake. 0 hands every call's items to XLA's intra-op pool instead.
SPIN_ENV = "JAXSTATION_KERNEL_SPIN_US"
SPIN_US = 0  # XLA's intra-op pool: the spinning workers measured 2-3% slower on a quiet machine
# GGUF block formats the matmul reads as stored: (columns per block, bytes per block)
BLOCK_FORMATS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
                 "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
TARGETS = {"int8": ("jaxstation_rowwise_matmul_s8", "RowwiseMatmulS8"),
           "float32": ("jaxstation_rowwise_matmul_f32", "RowwiseMatmulF32"),
           "attention": ("jaxstation_decode_attention", "DecodeAttention"),
           "rms_norm": ("jaxstation_rms_norm", "RmsNorm"),
           "top_k": ("jaxstation_top_k", "TopK"),
           "row_max": ("jaxstation_row_max", "RowMax"),
           "sample": ("jaxstation_sample", "Sample"),
           "row_bits": ("jaxstation_row_bits", "RowBits"),
           "lora_delta": ("jaxstation_lora_delta", "LoraDelta"),
           **{f"matmul_{f}": (f"jaxstation_rowwise_matmul_{f.lower()}", f"RowwiseMatmul{f}") for f in BLOCK_FORMATS},
           **{f"int_{f}": (f"jaxstation_int_matmul_{f.lower()}", f"IntMatmul{f}") for f in BLOCK_FORMATS},
           **{f"rows_{f}": (f"jaxstation_block_rows_{f.lower()}", f"BlockRows{f}") for f in BLOCK_FORMATS},
           **{f"int_{f}R": (f"jaxstation_int_matmul_{f.lower()}r", f"IntMatmul{f}R") for f in BLOCK_FORMATS},
           **{f"rows_{f}R": (f"jaxstation_block_rows_{f.lower()}r", f"BlockRows{f}R") for f in BLOCK_FORMATS}}
# Block formats repacked at load for the integer products (`packing.pack_blocks`), and the format each was stored in
REPACKED = {"Q8_0R": "Q8_0", "Q4_0R": "Q4_0", "Q4_1R": "Q4_1", "Q5_0R": "Q5_0", "Q5_1R": "Q5_1", "Q4_KR": "Q4_K",
            "Q5_KR": "Q5_K", "Q6_KR": "Q6_K"}
K_MULTIPLE, N_MULTIPLE = 32, 4  # the kernel's shape contract
TILE = 16  # the attention's rows a task on a prefill chunk


class KernelUnavailable(RuntimeError):
    pass


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, feature flags) of this CPU, from /proc/cpuinfo (empty where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "", frozenset()
    field = lambda name: next((ln.partition(":")[2] for ln in lines if ln.startswith(name)), "")  # noqa: E731
    return field("model name").strip(), frozenset(field("flags").split())


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxstation" / "kernels"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"jaxstation-kernels-{os.getuid()}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def _build() -> Path:
    """The shared library for this machine, compiled if the cache does not hold it. Raises KernelUnavailable."""
    model, flags = cpu_info()
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma", "f16c"} <= flags:
        raise KernelUnavailable(f"needs x86-64 with AVX2, FMA and F16C (this is {platform.machine()})")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise KernelUnavailable("no C++ compiler found (set CXX, or install g++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    isa = os.environ.get(ISA_ENV, "")
    if isa not in ISA_FLAGS:
        raise KernelUnavailable(f"{ISA_ENV}={isa!r} must be one of {', '.join(filter(None, ISA_FLAGS))} or unset")
    build_flags = (*FLAGS, *ISA_FLAGS[isa])
    texts = [f"{path.name}\n{path.read_text()}" for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, *build_flags, version, jaxlib.__version__, model,
                                    " ".join(sorted(flags))]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    with _building(target):  # processes that need it meanwhile (mesh stations starting together) wait for this one
        if not target.exists():
            _compile(cxx, version, build_flags, target)
    return target


@contextlib.contextmanager
def _building(target: Path) -> Iterator[None]:
    """Hold `target`'s build lock (an exclusive lock on a file beside it): one process builds a library, and the
    others that need it wait and then read what it built."""
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _compile(cxx: str, version: str, build_flags: tuple[str, ...], target: Path) -> None:
    """Compile the kernels with `build_flags` into `target`, renamed into place whole."""
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    with tempfile.TemporaryDirectory(prefix="jaxstation-kernels-") as objects:
        compile_ = [cxx, *build_flags, "-I", jax.ffi.include_dir(), *_precompiled_header(cxx, version, build_flags,
                                                                                           objects), "-c"]
        steps = [([*compile_, str(src), "-o", f"{objects}/{src.stem}.o"], src.name) for src in SOURCES]
        with ThreadPoolExecutor(min(len(steps), os.cpu_count() or 1)) as pool:  # one compiler process a source
            list(pool.map(lambda step: _run(*step), steps))
        try:
            _run([cxx, *build_flags, *(f"{objects}/{src.stem}.o" for src in SOURCES), "-o", str(tmp)], "the link")
        except KernelUnavailable:
            tmp.unlink(missing_ok=True)
            raise
    os.replace(tmp, target)  # atomic: a process that reads the cache without the lock sees a whole file or none


def _precompiled_header(cxx: str, version: str, build_flags: tuple[str, ...], objects: str) -> list[str]:
    """With GCC, the shared header (and the jaxlib FFI header it includes, about 2 s of each source's compile) parsed
    once into `objects`: the flags that make each source's compile read it from there. Other compilers: none."""
    if "Free Software Foundation" not in version:
        return []
    header = KERNEL_DIR / "cpu_kernels.h"
    _run([cxx, *build_flags, "-I", jax.ffi.include_dir(), "-x", "c++-header", str(header), "-o",
          f"{objects}/{header.name}.gch"], header.name)
    # GCC looks for <name>.gch in each include directory before <name> (the header itself, should GCC refuse the
    # .gch); `-include` reads it first, and the sources' own #include of the header is then empty (its guard is defined)
    return ["-I", objects, "-I", str(KERNEL_DIR), "-include", header.name]


def _run(cmd: list[str], what: str) -> None:
    """One compiler step; raises KernelUnavailable with the compiler's last words if it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise KernelUnavailable(f"compiling {what} failed: {done.stderr.strip()[-2000:]}")


@functools.cache
def _library() -> ctypes.CDLL | str:
    """Build, load and register the kernel once per process. Returns the library, or why it is unavailable."""
    try:
        library = ctypes.cdll.LoadLibrary(str(_build()))
    except (KernelUnavailable, OSError) as e:
        log.warning("CPU kernels unavailable, using XLA's dot, the blocked attention and full-width waves: %s", e)
        return str(e)
    for name, symbol in TARGETS.values():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    library.jaxstation_kernel_spin.argtypes = [ctypes.c_int64]
    spin = os.environ.get(SPIN_ENV, "").strip()
    if spin and not spin.isdigit():
        raise ValueError(f"{SPIN_ENV}={spin!r} must be a whole number of microseconds (0: XLA's intra-op pool)")
    library.jaxstation_kernel_spin(int(spin) if spin else SPIN_US)
    return library


def set_spin_us(us: int) -> None:
    """How long the kernels' workers spin after each job, from now on (0: XLA's intra-op pool runs the items)."""
    require()
    _library().jaxstation_kernel_spin(int(us))


def vector_lanes() -> int:
    """float32 lanes per vector in the built kernels: 16 for the AVX-512 variant, 8 for AVX2."""
    require()
    return int(_library().jaxstation_vector_lanes())


def int_dot_isa() -> str:
    """The instruction set of the built kernels' integer dot products: avx512-vnni, avx512 (maddubs), avx-vnni or avx2
    (maddubs)."""
    require()
    library = _library()
    library.jaxstation_int_dot_isa.restype = ctypes.c_char_p
    return library.jaxstation_int_dot_isa().decode()


def int_amx() -> str:
    """Whether the integer products of 16 rows or more run on AMX tiles: "amx", "amx-emulated", or "off: " and why
    not (no AMX in this build, or Linux refused the tiles' state to this process)."""
    require()
    library = _library()
    library.jaxstation_int_amx.restype = ctypes.c_char_p
    return library.jaxstation_int_amx().decode()


def int_dot() -> str:
    """The integer products' instruction sets, as the plan names them: `int_dot_isa()`, and "+ amx" where tiles take
    16 rows or more (emulated: "+ amx-emulated"); on a CPU that lists AMX but does not use it, why not."""
    amx = int_amx()
    if not amx.startswith("off"):
        return f"{int_dot_isa()} + {amx}"
    return f"{int_dot_isa()} (amx {amx})" if {"amx_tile", "amx_int8"} <= cpu_info()[1] else int_dot_isa()


def int_dot_peak(threads: int | None = None, seconds: float = 0.5) -> float:
    """The integer dot's peak on this machine, in integer operations per second (a multiply and an add each):
    `threads` threads (default: every core) running the kernels' dot instruction on registers alone."""
    require()
    library = _library()
    library.jaxstation_int_dot_peak.restype = ctypes.c_double
    library.jaxstation_int_dot_peak.argtypes = [ctypes.c_int, ctypes.c_int64]
    threads = threads or os.cpu_count() or 1
    iters = 1 << 16
    while (took := library.jaxstation_int_dot_peak(threads, iters)) < seconds / 4:
        iters *= 4
    return threads * iters * 8 * 4 * int_channels() * 2 / took


def int_channels() -> int:
    """Channels a tile of the built kernels' integer products: 16 for the AVX-512 variant, 8 for AVX2."""
    require()
    return int(_library().jaxstation_int_channels())


def library() -> ctypes.CDLL:
    """The built kernel library, for its plain C functions (`packing.pack_blocks`). Raises KernelUnavailable."""
    require()
    return _library()


def available() -> bool:
    """Whether the kernel can run here: the default backend is the CPU and the library builds and loads."""
    try:
        require()
    except KernelUnavailable:
        return False
    return True


def require() -> None:
    """Raise KernelUnavailable, with the reason, unless the kernel can run here."""
    if jax.default_backend() != "cpu":
        raise KernelUnavailable(f"the CPU kernel needs the CPU backend, not {jax.default_backend()}")
    library = _library()
    if isinstance(library, str):
        raise KernelUnavailable(library)


def attention_serves(head_dim: int, group_size: int, dtype: jnp.dtype) -> bool:
    """Whether the decode attention kernel can serve these heads here: float32 activations, head_dim a multiple of 16
    up to 256, at most 8 query heads per kv head, and the kernels built (it reads float32, bfloat16 or int8 KV)."""
    return (dtype == jnp.float32 and head_dim % 16 == 0 and head_dim <= 256 and group_size <= 8
            and available())


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array | int, lanes: jax.Array,
                     positions: jax.Array, window: int | None, scale: float | None = None, ring: int = 0,
                     scratch_pos: int = 0, tile: int | None = None, k_scale: jax.Array | None = None,
                     v_scale: jax.Array | None = None) -> jax.Array:
    """One query per row over its own arena lane: q [rows, heads, hd]; k, v [layers, lanes, seq, kv_heads, hd] float32,
    bfloat16, or int8 with k_scale, v_scale [layers, lanes, seq, kv_heads] float32 (a value is k * k_scale, as
    LayerKV.read widens it: each row's bits are those over the arena's float32 read); lanes, positions [rows] ->
    [rows, heads, hd]. A row attends to positions (positions - window, positions] of its lane (from 0 without a
    window), softmax over exactly those; a row at the scratch position (the one idle rows write: the last slot)
    attends to itself only. Scores are scaled by `scale` (default: head_dim ** -0.5). With a `ring`
    (engine/arena.py: seq = ring + 1), position p lies at slot p mod ring and the scratch position is `scratch_pos`;
    without one, position p at slot p and the scratch position is seq - 1. Rows of one lane at consecutive positions
    (a prefill chunk's) share a task, up to `tile` of them, each key and value read once for all; every row's bits
    are the same whatever the tile (1: a task per row; default TILE)."""
    require()
    if (k.dtype == jnp.int8) != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(f"decode_attention: int8 k and v take k_scale and v_scale, {k.dtype} none")
    unread = jnp.zeros((1,), jnp.float32)  # the scales' place where k and v carry none
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGETS["attention"][0], out)(
        q.astype(jnp.float32), k, v, unread if k_scale is None else k_scale,
        unread if v_scale is None else v_scale, jnp.asarray(layer, jnp.int32), lanes.astype(jnp.int32),
        positions.astype(jnp.int32), window=np.int64(window or 0),
        scale=np.float32(q.shape[-1] ** -0.5 if scale is None else scale), ring=np.int64(ring),
        scratch_pos=np.int64(scratch_pos if ring else k.shape[2] - 1), tile=np.int64(tile or TILE))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF's LlamaRMSNorm of float32 rows, each row alone: x [..., d], weight [d] float32 -> [..., d]."""
    require()
    rows = x.reshape(-1, x.shape[-1])
    out = jax.ShapeDtypeStruct(rows.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGETS["rms_norm"][0], out)(rows, weight, eps=np.float32(eps)).reshape(x.shape)


def lora_delta(x: jax.Array, a: jax.Array, b: tuple[jax.Array, ...], slots: jax.Array) -> jax.Array:
    """Each row's LoRA delta from its own slot (lora.cc; `lora.add_delta`'s sums without XLA's FMAs): x [rows, Q, d]
    float32, a [slots, d, parts * rank], b one [slots, rank, out_j] per part, slots [rows] int32 -> [rows, Q, sum out_j]
    float32."""
    require()
    out = jax.ShapeDtypeStruct((*x.shape[:2], sum(part.shape[-1] for part in b)), jnp.float32)
    return jax.ffi.ffi_call(TARGETS["lora_delta"][0], out)(x, a, slots.astype(jnp.int32), *b)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` of float32 rows x [..., n], in one pass a row: (values, indices int32) [..., k], descending in
    float32's total order, equal values by ascending index."""
    require()
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    out = (jax.ShapeDtypeStruct((rows.shape[0], k), jnp.float32), jax.ShapeDtypeStruct((rows.shape[0], k), jnp.int32))
    values, ids = jax.ffi.ffi_call(TARGETS["top_k"][0], out)(rows)
    return values.reshape(*x.shape[:-1], k), ids.reshape(*x.shape[:-1], k)


def row_max(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's maximum and the first index that holds it, over the last axis of float32 x [..., n] in one call:
    (max [...], index [...] int32): a row with a NaN has the maximum NaN and the index n - 1."""
    require()
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    out = (jax.ShapeDtypeStruct(rows.shape[:1], jnp.float32), jax.ShapeDtypeStruct(rows.shape[:1], jnp.int32))
    top, at = jax.ffi.ffi_call(TARGETS["row_max"][0], out)(rows)
    return top.reshape(x.shape[:-1]), at.reshape(x.shape[:-1])


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
           bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token per row of logits [rows, vocab] float32 (sample.cc): temperature, top-k, top-p and min-p, then an
    inverse-CDF draw with the uniform the row's bits [rows, 2] uint32 give. temperature, top_p, min_p: [rows] float32,
    top_k: [rows] int32. -> (tokens [rows] int32, cuts [rows] float32: the row kept logits / temperature >= cut); a
    row with temperature <= 0 gets token 0."""
    require()
    out = (jax.ShapeDtypeStruct(temperature.shape, jnp.int32), jax.ShapeDtypeStruct(temperature.shape, jnp.float32))
    return jax.ffi.ffi_call(TARGETS["sample"][0], out)(
        logits.astype(jnp.float32), temperature.astype(jnp.float32), top_k.astype(jnp.int32),
        top_p.astype(jnp.float32), min_p.astype(jnp.float32), bits.astype(jnp.uint32))


def row_bits(seed: jax.Array, counter: jax.Array) -> jax.Array:
    """`sampling.row_bits` in one call (sample.cc): each row's 64 random bits from its seed [rows] uint32 and
    generated-token count [rows] int32 -> [rows, 2] uint32, JAX's Threefry bits."""
    require()
    out = jax.ShapeDtypeStruct((*seed.shape, 2), jnp.uint32)
    return jax.ffi.ffi_call(TARGETS["row_bits"][0], out)(seed.astype(jnp.uint32), counter.astype(jnp.int32))


def fits(in_features: int, out_features: int) -> bool:
    return in_features % K_MULTIPLE == 0 and out_features % N_MULTIPLE == 0


def repacked_format(fmt: str, out_features: int) -> str | None:
    """The repacked format the integer products read a matrix stored in `fmt` as, if any: every block format, where
    its channels fill the kernel's tiles (a looked-up table's rows too: `block_rows` lays a lane back out)."""
    packed = f"{fmt}R"
    return packed if REPACKED.get(packed) == fmt and out_features % int_channels() == 0 else None


def fits_blocks(fmt: str, in_features: int, out_features: int) -> bool:
    """Whether the kernel reads this GGUF block format at this shape."""
    return fmt in BLOCK_FORMATS and in_features % BLOCK_FORMATS[fmt][0] == 0 and out_features % N_MULTIPLE == 0


def rowwise_matmul(x: jax.Array, w: jax.Array, scale: jax.Array | None, blocks: str | None = None,
                   integer: bool = False) -> jax.Array:
    """x [..., K] float32 times w [N, K] (int8 with scale [N], or float32 without), or w uint8 [N, K / block * block
    bytes] in the GGUF block format `blocks` -> [..., N] float32: with `integer`, each row rounded to 8 bits per block
    and multiplied in integers; else exactly over the dequantized weights."""
    require()
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    rows = x.reshape(-1, k).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32)
    if blocks is not None:
        y = jax.ffi.ffi_call(TARGETS[f"{'int' if integer else 'matmul'}_{blocks}"][0], out)(rows, w)
    elif scale is None:
        y = jax.ffi.ffi_call(TARGETS["float32"][0], out)(rows, w)
    else:
        y = jax.ffi.ffi_call(TARGETS["int8"][0], out)(rows, w, scale)
    return y.reshape(*lead, n)


def block_rows(w: jax.Array, ids: jax.Array, blocks: str) -> jax.Array:
    """Rows `ids` [...] of GGUF block weights w [N, K / block * block bytes] as float32 [..., K]: the weights the
    matmul rebuilds from the same blocks."""
    require()
    per_block, block_bytes = BLOCK_FORMATS[REPACKED.get(blocks, blocks)]
    k = w.shape[1] // block_bytes * per_block
    flat = ids.reshape(-1).astype(jnp.int32)
    out = jax.ShapeDtypeStruct((flat.shape[0], k), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[f"rows_{blocks}"][0], out)(w, flat).reshape(*ids.shape, k)
