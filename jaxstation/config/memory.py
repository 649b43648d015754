"""Memory: what the weights and the KV arena take, what the device has free, a start-up check that names the
setting to lower when they do not fit, and the bytes of the prefix cache's host tier."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxstation.config.settings import ConfigError, GiB, MiB, StationConfig
from jaxstation.engine.arena import KVArena, arena_bytes, kv_dtype_of
from jaxstation.engine.prefix_disk import DiskTier
from jaxstation.engine.prefix_files import engine_fingerprint
from jaxstation.model.config import ModelConfig
from jaxstation.model.layers import compute_dtype, projection_shapes

log = logging.getLogger(__name__)

PREFIX_CACHE_RAM_SHARE, PREFIX_CACHE_RAM_CAP = 4, 8 * GiB  # the host tier's default: a quarter of free RAM, <= 8 GiB
PREFIX_CACHE_DISK_DEFAULT = 4 * GiB  # the disk tier's bytes unless set


def weight_bytes(cfg: ModelConfig, dtype: str, shards: int = 1) -> int:
    """Bytes the model's weights take on one device once loaded as `dtype` and split over `shards` devices (int8: one
    byte per projection weight plus a float32 scale per output channel; gguf, gguf-exact: at most Q8_0's 34 bytes
    per 32 weights, the largest block format the kernel reads, the embedding too; norms and another format's untied
    embedding in the compute dtype).
    Split, each device
    holds 1/shards of every projection, of the embedding and of the head (where the vocabulary divides), the whole of
    the norms and (at most) of the int8 scales (model/sharding.py)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    proj_in_out = projection_shapes(cfg)
    float_size = jnp.dtype(compute_dtype(dtype)).itemsize
    weight_size = {"int8": 1, "gguf": 34 / 32, "gguf-exact": 34 / 32}.get(dtype, float_size)
    proj = cfg.num_layers * sum(i * o for i, o in proj_in_out) * weight_size
    head = 0 if cfg.tie_word_embeddings else d * v * weight_size
    scales = 4 * (cfg.num_layers * sum(o for _, o in proj_in_out) + v) if dtype == "int8" else 0
    embed = v * d * (weight_size if cfg.tie_word_embeddings or dtype in ("gguf", "gguf-exact") else float_size)
    norms = (2 * cfg.num_layers + 1) * d * float_size
    vocab_shards = shards if v % shards == 0 else 1
    return int(proj / shards + (head + embed) / vocab_shards + scales + norms)


def free_ram() -> int | None:
    """Bytes of host memory a new process can take now: Linux's MemAvailable (free pages plus the page cache and
    slab it can reclaim; MemFree alone counts a recently read file as taken), or, in a container, its cgroup's
    limit less what it uses (less the page cache it can reclaim), where that is smaller. None where the system says
    neither."""
    available = _meminfo_available()
    if (room := _cgroup_room()) is not None:
        available = room if available is None else min(available, room)
    return available


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _cgroup_room(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """This process's memory cgroup's limit less its usage, plus the inactive page cache it can reclaim (what
    `docker stats` counts as free), from cgroup v2 or v1; None without a limit."""
    try:
        groups = [line.split(":", 2) for line in membership.read_text().splitlines()]
        v1 = next((path for _, names, path in groups if "memory" in names.split(",")), None)
        if v1 is not None:
            where, files = root / "memory" / v1.lstrip("/"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
            inactive = "total_inactive_file"
        else:
            where = root / next(path for _, names, path in groups if names == "").lstrip("/")
            files, inactive = ("memory.max", "memory.current"), "inactive_file"
        limit, usage = ((where / f).read_text().strip() for f in files)
        if not limit.isdigit() or int(limit) >= 1 << 60:  # "max", or v1's "no limit"
            return None
        stat = dict(line.split() for line in (where / "memory.stat").read_text().splitlines() if line.strip())
        return max(0, int(limit) - int(usage) + int(stat.get(inactive, 0)))
    except (OSError, StopIteration, ValueError):
        return None


def prefix_cache_ram(station: StationConfig, available: int | None = None) -> int:
    """Bytes of the prefix cache's host tier, logged once: the setting's MiB, or by default 1/PREFIX_CACHE_RAM_SHARE of
    the `available` host RAM (default: measured now), at most PREFIX_CACHE_RAM_CAP; 0 where prefix reuse is off."""
    if station.prefix_reuse == "off":
        n, why = 0, f"{station.named('prefix_reuse')}=off"
    elif station.prefix_cache_ram is not None:
        n, why = station.prefix_cache_ram * MiB, f"{station.named('prefix_cache_ram')}={station.prefix_cache_ram}"
    else:
        available = free_ram() if available is None else available
        n = min((available or 0) // PREFIX_CACHE_RAM_SHARE, PREFIX_CACHE_RAM_CAP)
        why = (f"1/{PREFIX_CACHE_RAM_SHARE} of the {_gib(available or 0)} of free RAM, at most "
               f"{_gib(PREFIX_CACHE_RAM_CAP)}; set {station.named('prefix_cache_ram')} (MiB) to choose")
    log.info("prefix cache in host memory: %d MiB (%s)", n // MiB, why)
    return n


def prefix_cache_disk(station: StationConfig, engine: Any) -> Callable[[], DiskTier] | None:
    """How to open the prefix cache's disk tier in `station.prefix_cache_dir` (None: none set). The host tier opens it
    where it is on (engine/prefix_tier.py decides): then its bytes are logged and the weights' fingerprint is read,
    once."""
    if not station.prefix_cache_dir:
        return None
    if station.prefix_cache_disk_mb is not None:
        n = station.prefix_cache_disk_mb * MiB
        why = f"{station.named('prefix_cache_disk_mb')}={station.prefix_cache_disk_mb}"
    else:
        n = PREFIX_CACHE_DISK_DEFAULT
        why = f"the default; set {station.named('prefix_cache_disk_mb')} (MiB) to choose"

    def open_disk() -> DiskTier:
        log.info("prefix cache on disk: %d MiB in %s (%s)", n // MiB, station.prefix_cache_dir, why)
        return DiskTier(station.prefix_cache_dir, n, engine_fingerprint(engine))

    return open_disk


def available_memory(shards: int = 1) -> tuple[int | None, str]:
    """(bytes free for the arena on each of `shards` devices, where): free host RAM on CPU, shared by this process's
    devices; the allocator's headroom on an accelerator, the least of this process's devices (of a group's, its
    share)."""
    devices = jax.local_devices()[:shards]
    if devices[0].platform == "cpu":
        if (free := free_ram()) is None:
            return None, "cpu"
        n = len(devices)
        return free // n, "cpu (free RAM)" if n == 1 else f"each of {n} cpu devices (free RAM / {n})"
    stats = [d.memory_stats() or {} for d in devices]
    if any("bytes_limit" not in s for s in stats):
        return None, devices[0].device_kind
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    each = "" if shards == 1 else f"each of {shards} "
    return (min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats),
            f"{each}{devices[0].device_kind} (JAX's pool of {_gib(stats[0]['bytes_limit'])}, "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction})")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def arena_summary(arena: KVArena, windowed: tuple[bool, ...]) -> str:
    """The start-up log's account of an allocated arena: its bytes, and each layer kind's share."""
    full = sum(a.nbytes for a in jax.tree_util.tree_leaves(arena.full))
    rings = arena.nbytes - full
    kinds = f"{arena.k.shape[0]} global layers x {arena.max_seq} positions: {_gib(full)}"
    if rings:
        kinds += f"; {sum(windowed)} windowed layers x a ring of {arena.ring} positions: {_gib(rings)}"
    return f"{full + rings} bytes ({_gib(full + rings)}; {arena.lanes} lanes; {kinds}) in {arena.k.dtype}"


def check_memory(cfg: ModelConfig, station: StationConfig, dtype: str, *, weights_resident: bool = False,
                 available: int | None = None, layout: tuple[int, tuple[bool, ...]] = (0, ()),
                 kv_dtype: str | None = None) -> None:
    """Fail at start-up, with the setting to lower, if max_seq exceeds the model or the arena cannot fit.

    dtype: the weight format the plan chose (config/plan.py).

    weights_resident: the weights are already loaded, so the free figure has them taken off already.
    available: bytes free on each device (default: measured by `available_memory`).
    layout: (ring, windowed) of the arena (config/plan.py's `planned_arena`); default every position of every layer.
    kv_dtype: the arena's dtype as the plan resolved it (default: the setting, "auto" the activations').
    Split over `station.tensor_parallel` devices, each holds 1/N of the arena and its share of the weights: the check
    is per device.
    """
    if station.max_seq > cfg.max_position:
        raise ConfigError(f"{station.named('max_seq')}={station.max_seq} exceeds the model's max_position "
                          f"({cfg.max_position}); lower {station.named('max_seq')}")
    where = "the device"
    shards = station.tensor_parallel
    if available is None:
        available, where = available_memory(shards)
    if available is None:
        log.warning("cannot measure free memory on %s; skipping the arena memory check", where)
        return
    arena_dtype = kv_dtype_of(kv_dtype or station.kv_dtype, compute_dtype(dtype))
    arena = arena_bytes(cfg, station.lanes, station.max_seq, arena_dtype, *layout) // shards
    weights = 0 if weights_resident else weight_bytes(cfg, dtype, shards)
    if arena + weights <= available:
        return
    per_lane = arena // station.lanes
    fit_lanes = max(0, (available - weights) // per_lane)
    rings = arena_bytes(cfg, station.lanes, 0, arena_dtype, *layout) // shards  # the windowed layers' rings
    per_block = arena_bytes(cfg, station.lanes, station.kv_block, arena_dtype, *layout) // shards - rings
    fit_seq = max(0, (available - weights - rings) // max(per_block, 1)) * station.kv_block
    lanes, max_seq = station.named("lanes"), station.named("max_seq")
    split = "" if shards == 1 else f" on each device ({station.named('tensor_parallel')}={shards})"
    raise ConfigError(
        f"the KV arena needs {_gib(arena)}{split} ({lanes}={station.lanes} x {max_seq}={station.max_seq}, "
        f"{_gib(per_lane)} per lane)" + (f" plus {_gib(weights)} of weights" if weights else "")
        + f", but only {_gib(available)} is free on {where}. Lower {lanes} (at most {fit_lanes} lanes fit at "
        f"this max_seq) or {max_seq} (at most {fit_seq} positions fit at {station.lanes} lanes)"
    )
