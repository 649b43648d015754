"""The station's plan: what it runs with, every `auto` setting decided, resolved once at start-up and logged once.

`StationConfig` holds what the user asked for. `resolve_plan` is the one place that reads the JAX backend and asks
whether the CPU kernel runs here (which builds it with the system C++ compiler on first use). From those, the
settings and the model's config it decides the weight format, the matmul path, the layer walk, the decode attention,
the decode wave widths and the packed admission budget; checks that they fit together and fit the model, with the
engine's own rules (engine/rules.py); and returns them frozen. A refusal is a `ConfigError` that names the flag or
environment variable that asked for it. A station resolves its plan before it loads the weights (the model's config
is read without its tensors), logs it in one line, and hands it to the loader and the engine: nothing downstream
decides again. Each field keeps the name of its flag, from `--dtype` through the plan to the loader and the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp

from jaxstation.config.memory import available_memory, weight_bytes
from jaxstation.config.settings import ConfigError, StationConfig
from jaxstation.engine import host_memory, rules
from jaxstation.engine.arena import arena_bytes, arena_layout, kv_dtype_of
from jaxstation.engine.engine import Engine
from jaxstation.kernels import cpu_kernel
from jaxstation.model import sharding
from jaxstation.model.choices import GGUF_WEIGHTS
from jaxstation.model.config import ModelConfig
from jaxstation.model.layers import compute_dtype, kernel_takes_every_matmul
from jaxstation.model.loader import LoadedModel, checkpoint_config, checkpoint_weight_bytes, load_model

log = logging.getLogger(__name__)

KERNEL_DTYPES = ("float32", "int8", *GGUF_WEIGHTS)  # the weight formats the CPU kernel multiplies


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a station runs with, every `auto` decided (`resolve_plan`); each field is named as its flag."""

    backend: str  # jax.default_backend(): cpu, gpu or tpu
    dtype: str  # the weight format: gguf, gguf-exact, float32, bfloat16 or int8 (--dtype)
    matmul: str  # how projections multiply: kernel (the CPU kernel) or xla (--matmul)
    layer_loop: str  # the layer walk: scan or unroll (--layer-loop)
    attention: str  # the decode attention: blocked, kernel, xla or cudnn (--attention)
    wave_widths: tuple[int, ...]  # the decode wave widths, the lanes last (--wave-widths)
    prefill_budget: int  # rows per packed admission step; 0: one prefill chunk per turn (--prefill-budget)
    speculative: str = "off"  # off, ngram or draft: drafts verified in one step (--speculative)
    tensor_parallel: int = 1  # the devices the model is split over (--tensor-parallel)
    int_dot: str | None = None  # dtype gguf: the integer dot's instruction sets (avx512-vnni + amx, avx512-vnni, ...)
    max_loras: int = 0  # LoRA adapters resident at once (--max-loras); 0 serves none
    kv_dtype: str = "float32"  # the KV arena's dtype (--kv-dtype)

    def __str__(self) -> str:
        widths = ",".join(map(str, self.wave_widths))
        dtype = f"{self.dtype} (integer dot {self.int_dot})" if self.int_dot else self.dtype
        return (f"backend {self.backend}, dtype {dtype}, matmul {self.matmul}, layer_loop {self.layer_loop}, "
                f"attention {self.attention}, wave_widths {widths}, prefill_budget {self.prefill_budget or 'off'}, "
                f"speculative {self.speculative}, kv_dtype {self.kv_dtype}"
                + (f", tensor_parallel {self.tensor_parallel}" if self.tensor_parallel > 1 else "")
                + (f", max_loras {self.max_loras}" if self.max_loras else ""))


def resolve_plan(config: StationConfig, cfg: ModelConfig) -> Plan:
    """The plan of a station of `config` serving a model of `cfg`. A mesh station or host (`config.layers` or
    `config.stations` set) runs full waves and feeds prompts one chunk at a time. Raises ConfigError naming the
    setting that cannot work here."""
    backend = jax.default_backend()
    shards = _tensor_parallel(config, cfg)
    kernel_error = _sharded_kernel_error(config) if shards > 1 else _kernel_error()
    dtype = _dtype(config, backend, kernel_error)
    matmul = _matmul(config, dtype, kernel_error)
    layer_loop = _layer_loop(config, backend, dtype, matmul)
    attention = _attention(config, cfg, backend, dtype, kernel_error)
    int_dot = cpu_kernel.int_dot() if dtype == "gguf" else None
    kv_dtype = _kv_dtype(config, dtype, attention)
    if config.layers is not None or config.station_urls:
        return Plan(backend, dtype, matmul, layer_loop, attention, (config.lanes,), 0, tensor_parallel=shards,
                    int_dot=int_dot, kv_dtype=kv_dtype)
    row_invariant = matmul == "kernel" and kernel_takes_every_matmul(cfg)
    widths, budget = _waves(config, row_invariant, attention)
    if config.speculative != "off" and len(widths) < 2:
        raise ConfigError(f"{config.named('speculative')}={config.speculative} verifies drafts in narrow waves, which "
                          f"need every matmul on the CPU kernel and its attention (here: matmul {matmul}, attention "
                          f"{attention}, backend {backend}); a verify row's independence of its place in the step is "
                          "checked on the CPU kernels only")
    loras = config.lora_slots
    if loras and shards > 1:
        raise ConfigError(f"{config.named('max_loras')}={loras}: LoRA adapters need the model on one device, and "
                          f"{config.named('tensor_parallel')}={shards}")
    return Plan(backend, dtype, matmul, layer_loop, attention, widths, budget, config.speculative, shards, int_dot,
                loras, kv_dtype)


def _tensor_parallel(config: StationConfig, cfg: ModelConfig) -> int:
    """The devices the model is split over: the setting, if this process sees that many and the model's heads and
    MLP width divide by it."""
    n = config.tensor_parallel
    if n == 1:
        return 1
    if refusal := sharding.indivisible(cfg, n):
        raise ConfigError(f"{config.named('tensor_parallel')}={n}: {refusal}")
    devices = jax.devices()
    if n > len(devices):
        hint = (f"; on CPU, JAX_NUM_CPU_DEVICES={n} (or XLA_FLAGS=--xla_force_host_platform_device_count={n}) "
                "makes that many" if devices[0].platform == "cpu" else "")
        raise ConfigError(f"{config.named('tensor_parallel')}={n} needs {n} devices, and {len(devices)} "
                          f"{devices[0].platform} device(s) are visible here{hint}")
    return n


def _sharded_kernel_error(config: StationConfig) -> str:
    """Why a split station does not run the CPU kernels: XLA's SPMD partitioner cannot split their custom calls."""
    return (f"{config.named('tensor_parallel')}={config.tensor_parallel} splits the model over devices with XLA's "
            "SPMD partitioner, which cannot split the CPU kernels' custom calls (docs/sharding.md)")


def _kernel_error() -> str | None:
    """Why the CPU kernel cannot run here, or None (it needs the CPU backend, and builds on first use)."""
    try:
        cpu_kernel.require()
    except cpu_kernel.KernelUnavailable as e:
        return str(e)
    return None


def _dtype(config: StationConfig, backend: str, kernel_error: str | None) -> str:
    """The weight format: the setting, or the backend's default: on CPU a GGUF model's blocks as stored where the
    kernel runs, multiplied in integers over 8-bit activations (gguf; gguf-exact keeps float32's exact bits), else
    float32; bfloat16 on a GPU."""
    if config.dtype in GGUF_WEIGHTS:
        asked = f"{config.named('dtype')}={config.dtype}"
        if not config.model_is_gguf:
            raise ConfigError(f"{asked} needs a .gguf model, not {config.model}")
        if backend == "gpu" or config.matmul == "xla":
            raise ConfigError(f"{asked} needs the CPU kernel ({config.named('matmul')}=kernel or auto, on CPU)")
        if kernel_error is not None:
            raise ConfigError(f"{asked} needs the CPU kernel: {kernel_error}")
    if config.dtype:
        return config.dtype
    if backend == "gpu":
        return "bfloat16"
    return "gguf" if config.model_is_gguf and config.matmul != "xla" and kernel_error is None else "float32"


def _matmul(config: StationConfig, dtype: str, kernel_error: str | None) -> str:
    """How projections multiply: the setting, or the CPU kernel for float32, int8 and GGUF weights where it runs."""
    if config.matmul == "kernel":
        if dtype not in KERNEL_DTYPES:
            raise ConfigError(f"{config.named('matmul')}=kernel takes {', '.join(KERNEL_DTYPES)} weights, not {dtype}")
        if kernel_error is not None:
            raise ConfigError(f"{config.named('matmul')}=kernel: {kernel_error}")
        return "kernel"
    return "kernel" if config.matmul == "auto" and dtype in KERNEL_DTYPES and kernel_error is None else "xla"


def _layer_loop(config: StationConfig, backend: str, dtype: str, matmul: str) -> str:
    """The layer walk: the setting, or unroll, except for int8 on CPU with XLA's dot, whose per-layer int8 -> float32
    converts XLA's CPU backend materializes outside a loop: several times slower unrolled (`bench.step
    --layer-loop`)."""
    if config.layer_loop != "auto":
        return config.layer_loop
    return "scan" if dtype == "int8" and backend != "gpu" and matmul == "xla" else "unroll"


def _attention(config: StationConfig, cfg: ModelConfig, backend: str, dtype: str, kernel_error: str | None) -> str:
    """The decode attention: the setting, if it serves the model, or cuDNN on a GPU for bfloat16 activations
    (cuDNN's flash attention has no float32; float32 keeps the blocked walk at highest precision) unless the model's
    sliding window would be cut; on CPU the decode attention kernel for float32 activations (over a float32,
    bfloat16 or int8 arena) when it builds and fits the heads. Scores with a soft cap (Gemma 2) take the blocked walk:
    neither the kernel nor cuDNN caps them."""
    activations = compute_dtype(dtype)
    kv = kv_dtype_of(config.kv_dtype, activations)
    if config.attention == "kernel" and kernel_error is not None:
        raise ConfigError(f"{config.named('attention')}=kernel: {kernel_error}")
    if config.attention != "auto":
        if refusal := rules.attention_refusal(cfg, config.attention, activations, config.max_seq, kv):
            raise ConfigError(f"{config.named('attention')}={config.attention!r} {refusal}")
        return config.attention
    if cfg.attn_softcap is not None:
        return "blocked"
    if backend == "gpu":
        windowed = cfg.sliding_window is not None and config.max_seq > cfg.sliding_window
        return "cudnn" if activations == jnp.bfloat16 and not windowed else "blocked"
    serves = (kernel_error is None and kv in rules.KERNEL_KV_DTYPES
              and cpu_kernel.attention_serves(cfg.head_dim, cfg.group_size, activations))
    return "kernel" if serves else "blocked"


def _kv_dtype(config: StationConfig, dtype: str, attention: str) -> str:
    """The arena's dtype: the setting, or bfloat16 for the integer products (gguf) where the CPU attention kernel reads
    it in place (half float32's bytes; a GGUF model's values are already rounded), else the activations' dtype (float32
    and gguf-exact weights keep float32's exact bits)."""
    if config.kv_dtype != "auto":
        return config.kv_dtype
    if dtype == "gguf" and attention == "kernel":
        return "bfloat16"
    return jnp.dtype(compute_dtype(dtype)).name


def _waves(config: StationConfig, row_invariant: bool, attention: str) -> tuple[tuple[int, ...], int]:
    """The decode wave widths and the packed admission budget (0: off): the settings, or the engine's defaults."""
    narrow, lanes = rules.narrow_waves(row_invariant, attention), config.lanes
    widths = rules.default_wave_widths(lanes, narrow) if config.wave_widths == "auto" else config.wave_widths
    budget = rules.default_prefill_budget(lanes, narrow) if config.prefill_budget == "auto" else config.prefill_budget
    asked = {"wave_widths": (f"waves of {','.join(map(str, widths))} rows",
                             rules.widths_refusal(widths, lanes, row_invariant, attention)),
             "prefill_budget": (f"packed steps of {budget} rows",
                                rules.budget_refusal(budget, lanes, row_invariant, attention))}
    for field, (what, refusal) in asked.items():
        if refusal:
            raise ConfigError(f"{config.named(field)} asks for {what}: {refusal}")
    return widths, budget


def startup_plan(config: StationConfig, cfg: ModelConfig | None = None) -> Plan:
    """Resolve the plan of a station of `config` and log it, in one line: on `cfg`, or on the config the checkpoint
    `config.model` declares (read without its tensors)."""
    plan = resolve_plan(config, cfg if cfg is not None else checkpoint_config(config.model))
    log.info("plan: %s", plan)
    return plan


def load_planned(config: StationConfig, plan: Plan) -> LoadedModel:
    """The model `config` names, loaded as `plan` says."""
    model = load_model(config.model, plan.dtype, plan.layer_loop, plan.matmul, plan.tensor_parallel)
    if plan.tensor_parallel == 1:
        if total := host_memory.keep_on_huge_pages(model.params):
            log.info("weights (%.0f MiB) going onto 2 MiB pages", total / 2**20)
        return model
    mesh = sharding.make_mesh(plan.tensor_parallel)
    return dataclasses.replace(model, params=sharding.shard_params(model.params, mesh))


def planned_arena(cfg: ModelConfig, config: StationConfig, plan: Plan) -> tuple[int, tuple[bool, ...]]:
    """(ring, windowed) of the arena the planned engine allocates (engine/arena.py), known before it loads: what the
    memory check counts. A step of the plan writes at most max(chunk, budget, verify rows) positions of a lane."""
    verify_rows = config.lanes if plan.speculative != "off" and len(plan.wave_widths) > 1 else 0
    return arena_layout(cfg, config.max_seq, config.kv_block, config.kv_windows, plan.layer_loop,
                        chunk=config.prefill_chunk, budget=plan.prefill_budget, verify_rows=verify_rows)


AUTO_MEMORY_SHARE = 3 / 4  # max_seq "auto" gives the weights and the arena at most 3/4 of the free memory


def auto_max_seq(config: StationConfig, cfg: ModelConfig, available: int | None = None) -> StationConfig:
    """`config` with max_seq chosen for `cfg` (the `serve` default, where no flag or variable sets it): the model's
    own context length, rounded down to the chunk and the block, or the longest whose arena (its rings counted) and
    weights (a GGUF file's as its tensors hold them) take at most AUTO_MEMORY_SHARE of the free memory (`available`,
    default measured), leaving the rest to the steps' temporaries and the prefix cache. Logs what it chose and why."""
    step = math.lcm(config.prefill_chunk, config.kv_block)
    want = dataclasses.replace(config, max_seq=max(step, cfg.max_position // step * step))
    plan = resolve_plan(want, cfg)
    if available is None:
        available, where = available_memory(plan.tensor_parallel)
        if available is None:
            log.info("max_seq %d: cannot measure free memory on %s, so the station's fixed default", config.max_seq,
                     where)
            return config
    loaded = sharding.replicated_kv(cfg, plan.tensor_parallel)  # as the loader builds it
    weights = checkpoint_weight_bytes(config.model, plan.dtype) if plan.tensor_parallel == 1 else None
    room = int(available * AUTO_MEMORY_SHARE) - (weights or weight_bytes(loaded, plan.dtype, plan.tensor_parallel))

    def arena(n: int) -> int:
        layout = planned_arena(cfg, dataclasses.replace(config, max_seq=n), plan)
        return arena_bytes(loaded, config.lanes, n, jnp.dtype(plan.kv_dtype), *layout) // plan.tensor_parallel

    n = want.max_seq
    while n > step and arena(n) > room:
        n -= step
    why = ("the model's context length" if n == want.max_seq else
           f"the longest whose arena fits {AUTO_MEMORY_SHARE:.0%} of the free memory beside the weights (the model's "
           f"context is {cfg.max_position})")
    log.info("max_seq %d: %s; its arena at %d lanes takes %d bytes (set %s to choose)", n, why, config.lanes,
             arena(n), config.named("max_seq"))
    return dataclasses.replace(config, max_seq=n)


def planned_engine(model: LoadedModel, config: StationConfig, plan: Plan) -> Engine:
    """The local engine of a station of `config` on `model`, as `plan` says."""
    return Engine(model, lanes=config.lanes, max_seq=config.max_seq, chunk=config.prefill_chunk, block=config.kv_block,
                  attention=plan.attention, wave_widths=plan.wave_widths, prefill_budget=plan.prefill_budget,
                  speculative=plan.speculative != "off", kv_windows=config.kv_windows, kv_dtype=plan.kv_dtype,
                  max_loras=plan.max_loras, max_lora_rank=config.max_lora_rank)
