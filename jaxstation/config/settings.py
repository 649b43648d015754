"""Station settings: one frozen `StationConfig`, resolved from CLI flags over environment variables over defaults.

Every environment variable has a mirroring CLI flag (`MOONSHINE_BATCH_LANES` <-> `--lanes`, ...). `PORT` is honoured
because Cloud Run sets it. A `StationConfig` holds what the user asked for, each value parsed and checked once, on its
own: it reads no backend and builds nothing. What `auto` means on this machine and for this model is decided once, at
start-up, by the station's plan (config/plan.py). `check_memory` (config/memory.py) runs at start-up too, once the
model's config is known, and fails with an error that says how much the KV arena needs and which setting to lower.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jaxstation.config.setting_values import (
    ConfigError,
    parse_bool,
    parse_float,
    parse_int,
    parse_lora_modules,
    parse_names,
    parse_str,
)
from jaxstation.engine.choices import ATTENTIONS, KV_DTYPES, KV_WINDOWS, PACK_BUDGET_AUTO
from jaxstation.model.chat_template import read_template
from jaxstation.model.choices import LAYER_LOOPS, MATMULS, WEIGHT_DTYPES, LayerRange

MiB = 1 << 20
GiB = 1 << 30
DTYPES = WEIGHT_DTYPES
ATTENTION_CHOICES = ("auto", *ATTENTIONS)
LAYER_LOOP_CHOICES = ("auto", *LAYER_LOOPS)
MATMUL_CHOICES = ("auto", *MATMULS)
PREFIX_REUSE = ("auto", "resume", "off")
SPECULATIVE = ("off", "ngram", "draft")
REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1", "none")
LOG_FORMATS = ("text", "json")  # how log lines are written (server/access_log.py)
COMMANDS = ("serve", "station", "host")
_ALL = frozenset(COMMANDS)
_FRONT = frozenset({"serve", "host"})  # the commands that serve the API: a station or a mesh host
_MESH = frozenset({"station", "host"})
_SERVE = frozenset({"serve"})  # one station process, on one device (LoRA adapters)


@dataclasses.dataclass(frozen=True)
class _Setting:
    field: str
    env: str | None
    flag: str
    parse: Callable[[str, str], Any]
    help: str
    commands: frozenset[str] = _ALL  # the commands that use it: only they take its flag and read its variable


# One row per setting: the StationConfig field, its environment variable, its CLI flag.
SETTINGS: tuple[_Setting, ...] = (
    _Setting("model", "MOONSHINE_MODEL", "--model", parse_str,
             "HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct GGUF)"),
    _Setting("dtype", "MOONSHINE_DTYPE", "--dtype", parse_str,
             "weight dtype: gguf (a GGUF model's matrices in their stored blocks, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, "
             "Q5_K or Q6_K, on the CPU kernel, multiplied in integers over activations rounded to 8 bits per block, "
             "as llama.cpp does), gguf-exact (the same blocks, float32's exact bits over the dequantized weights), "
             "float32, bfloat16 or int8 "
             "(weight-only, per output channel; activations and the KV arena stay float32 on CPU, bfloat16 on a GPU) "
             "(default: gguf on CPU for a GGUF model where the CPU kernel builds, else float32; bfloat16 on a "
             "GPU)"),
    _Setting("attention", "MOONSHINE_ATTENTION", "--attention", parse_str,
             "decode attention: blocked (online softmax over KV blocks), kernel (the CPU decode attention kernel), xla "
             "or cudnn (jax.nn.dot_product_attention with per-lane lengths); auto is cudnn on a GPU for bfloat16, "
             "kernel on CPU for float32 activations when it builds, else blocked"),
    _Setting("layer_loop", "MOONSHINE_LAYER_LOOP", "--layer-loop", parse_str,
             "scan (stacked layer weights in one loop) or unroll (one weight buffer per layer); auto is unroll, "
             "except scan for int8 on CPU with XLA's dot"),
    _Setting("matmul", "MOONSHINE_MATMUL", "--matmul", parse_str,
             "projections: kernel (the CPU kernel: int8 read as int8, rows independent of the wave's width, built with "
             "the system C++ compiler at first use), xla (XLA's dot); auto is kernel on CPU for float32 and int8 "
             "when it builds, else xla"),
    _Setting("tensor_parallel", "MOONSHINE_TENSOR_PARALLEL", "--tensor-parallel", parse_int,
             "devices one model is split over (heads, KV heads and the MLP's width; docs/sharding.md); above 1 it runs "
             "XLA's dot and full waves", commands=frozenset({"serve", "station"})),
    _Setting("coordinator_address", "MOONSHINE_COORDINATOR_ADDRESS", "--coordinator-address", parse_str,
             "a group of processes: host:port of the JAX coordinator, which process 0 runs (its port + 1 carries the "
             "step calls)", commands=frozenset({"serve"})),
    _Setting("num_processes", "MOONSHINE_NUM_PROCESSES", "--num-processes", parse_int,
             "a group of processes: how many (default: LWS_GROUP_SIZE, else 1)", commands=frozenset({"serve"})),
    _Setting("process_id", "MOONSHINE_PROCESS_ID", "--process-id", parse_int,
             "a group of processes: this one's index, 0 serving HTTP (default: LWS_WORKER_INDEX or "
             "JOB_COMPLETION_INDEX)", commands=frozenset({"serve"})),
    _Setting("host", "MOONSHINE_HOST", "--host", parse_str, "TCP bind address"),
    _Setting("port", "PORT", "--port", parse_int, "TCP port (PORT is honoured, as Cloud Run sets it)"),
    _Setting("uds", "MOONSHINE_UDS", "--uds", parse_str, "listen on this Unix socket instead of TCP"),
    _Setting("lanes", "MOONSHINE_BATCH_LANES", "--lanes", parse_int, "decode lanes, i.e. max concurrent requests"),
    _Setting("wave_widths", "MOONSHINE_WAVE_WIDTHS", "--wave-widths", parse_str,
             "decode wave widths: auto (1, 2, 4, ... up to the lanes when every matmul runs on the CPU kernel, else "
             "only the lanes), full (every wave runs all lanes) or a list such as 1,4,16 (the lanes are added); a wave "
             "runs at the narrowest width that holds its live lanes, and each width is one more compiled program",
             commands=frozenset({"serve"})),
    _Setting("prefill_budget", "MOONSHINE_PREFILL_BUDGET", "--prefill-budget", parse_str,
             "packed admission: rows per step holding prompt tokens from every prefilling lane and the decode tokens "
             f"riding with them; auto ({PACK_BUDGET_AUTO} where waves may run narrow, i.e. every matmul on the CPU "
             "kernel, else off), off (one prefill chunk per turn, decode in its own wave) or a number of rows, at "
             "least the lanes", commands=frozenset({"serve"})),
    _Setting("max_seq", "MOONSHINE_MAX_SEQ", "--max-seq", parse_int,
             "positions per lane: prompt + max_new_tokens <= max_seq (serve, one process: by default the model's "
             "context length, or the longest whose arena and weights take half the free memory; else 2048)"),
    _Setting("prefill_chunk", "MOONSHINE_PREFILL_CHUNK", "--prefill-chunk", parse_int,
             "prompt tokens per prefill step"),
    _Setting("kv_block", "MOONSHINE_KV_BLOCK", "--kv-block", parse_int, "positions per attention KV block"),
    _Setting("kv_windows", "MOONSHINE_KV_WINDOWS", "--kv-windows", parse_str,
             "sliding-window layers: ring (keep only their window, rounded up to the KV block; the tokens are the "
             "same) or full (every position, as global layers; llama.cpp's --swa-full)", commands=frozenset({"serve"})),
    _Setting("kv_dtype", "MOONSHINE_KV_DTYPE", "--kv-dtype", parse_str,
             "the KV arena's dtype: auto (the activations': float32 on CPU), float32, bfloat16 (half the bytes) or "
             "int8 (with a float32 scale per position and head: about a quarter); k and v are rounded when written "
             "and read as the activations' dtype; on CPU the decode attention then takes the blocked walk",
             commands=frozenset({"serve"})),
    _Setting("continuous", "MOONSHINE_CONTINUOUS_BATCH", "--continuous-batch", parse_bool,
             "continuous batching: on batches concurrent requests into each decode wave; off serves one request at a "
             "time", commands=_FRONT),
    _Setting("prefix_reuse", "MOONSHINE_PREFIX_REUSE", "--prefix-reuse", parse_str,
             "reuse cached prompt KV: auto (every request), resume (only /generate with resume: true) or off",
             commands=_FRONT),
    _Setting("prefix_cache_ram", "MOONSHINE_PREFIX_CACHE_RAM", "--prefix-cache-ram", parse_int,
             "MiB of host memory for cached prompt KV beyond the lanes, least recently used evicted (default: a "
             "quarter of the available RAM, at most 8 GiB; 0: off)", commands=_SERVE),
    _Setting("prefix_cache_dir", "MOONSHINE_PREFIX_CACHE_DIR", "--prefix-cache-dir", parse_str,
             "directory for the prefix cache's disk tier: the host tier's entries are written there and a station "
             "restarted over it reuses them (default: none)", commands=_SERVE),
    _Setting("prefix_cache_disk_mb", "MOONSHINE_PREFIX_CACHE_DISK_MB", "--prefix-cache-disk-mb", parse_int,
             "MiB of files in --prefix-cache-dir, least recently used deleted (default: 4096)", commands=_SERVE),
    _Setting("speculative", "MOONSHINE_SPECULATIVE", "--speculative", parse_str,
             "speculative decoding: off, ngram (prompt-lookup drafts) or draft (a draft model's; --draft-model), "
             "verified in one step; the tokens are the same", commands=frozenset({"serve"})),
    _Setting("draft_model", "MOONSHINE_DRAFT_MODEL", "--draft-model", parse_str,
             "speculative decoding with a draft model: its HF directory or .gguf file, with the model's vocabulary",
             commands=frozenset({"serve"})),
    _Setting("draft_tokens", "MOONSHINE_DRAFT_TOKENS", "--draft-tokens", parse_int,
             "speculative decoding: the most tokens a request drafts a step", commands=frozenset({"serve"})),
    _Setting("lora_modules", "MOONSHINE_LORA_MODULES", "--lora-modules", parse_lora_modules,
             "LoRA adapters served beside the model, as name=path (a PEFT directory or a GGUF LoRA file), several "
             "separated by spaces or commas; a request names one in `model` (docs/lora.md)",
             commands=_SERVE),
    _Setting("max_loras", "MOONSHINE_MAX_LORAS", "--max-loras", parse_int,
             "LoRA adapters resident at once (default: the --lora-modules given, at least 1 with "
             "--allow-runtime-lora)", commands=_SERVE),
    _Setting("max_lora_rank", "MOONSHINE_MAX_LORA_RANK", "--max-lora-rank", parse_int,
             "the highest LoRA rank a station holds (adapters above it are refused)", commands=_SERVE),
    _Setting("allow_runtime_lora", "MOONSHINE_ALLOW_RUNTIME_LORA", "--allow-runtime-lora", parse_bool,
             "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off: both answer 404)",
             commands=_SERVE),
    _Setting("max_queue", "MOONSHINE_MAX_QUEUE", "--max-queue", parse_int,
             "jobs waiting for a lane before new ones get 503", commands=_FRONT),
    _Setting("drain_s", "MOONSHINE_DRAIN_S", "--drain-s", parse_float,
             "seconds in-flight requests get to finish after SIGTERM", commands=_FRONT),
    _Setting("max_body_bytes", "MOONSHINE_MAX_BODY_BYTES", "--max-body-bytes", parse_int,
             "largest request body accepted (413 past it)", commands=_FRONT),
    _Setting("api_key", "MOONSHINE_API_KEY", "--api-key", parse_str,
             "API key: with it set, every route except /health and /ready needs 'Authorization: Bearer <key>' "
             "(or 'x-api-key: <key>')",
             commands=_FRONT),
    _Setting("web", "MOONSHINE_WEB", "--web", parse_bool,
             "the chat page at / (static files in the package; off: / answers 404)", commands=_FRONT),
    _Setting("chat_template", "MOONSHINE_CHAT_TEMPLATE", "--chat-template", parse_str,
             "the chat template, in place of the checkpoint's (or for a checkpoint without one): a Jinja file, or the "
             "template itself", commands=_FRONT),
    _Setting("served_model_name", "MOONSHINE_SERVED_MODEL_NAME", "--served-model-name", parse_names,
             "the model's name in /v1/models and in replies, or several comma-separated (replies carry the first); "
             "default: the checkpoint's file or directory name. Requests may name any model", commands=_FRONT),
    _Setting("reasoning_parser", "MOONSHINE_REASONING_PARSER", "--reasoning-parser", parse_str,
             "split <think>...</think> from the answer: qwen3, deepseek_r1 (the output starts in the thinking), none, "
             "or auto (qwen3 when the chat template writes </think>, else none)", commands=_FRONT),
    _Setting("responses_store_size", "MOONSHINE_RESPONSES_STORE_SIZE", "--responses-store-size", parse_int,
             "/v1/responses: stored responses kept in memory (oldest evicted first; lost on restart)",
             commands=_FRONT),
    _Setting("responses_store_age_s", "MOONSHINE_RESPONSES_STORE_AGE_S", "--responses-store-age-s", parse_float,
             "/v1/responses: seconds a stored response is kept", commands=_FRONT),
    _Setting("log_format", "MOONSHINE_LOG_FORMAT", "--log-format", parse_str,
             "log lines as plain text or as one JSON object per line (Cloud Run's structured logging): text or json"),
    _Setting("compile_cache_dir", "MOONSHINE_COMPILE_CACHE_DIR", "--compile-cache-dir", parse_str,
             "JAX persistent compilation cache: a local path, a mounted volume or gs://bucket/dir (default off)"),
    _Setting("layers", "MOONSHINE_LAYERS", "--layers", parse_str, "mesh station: the layer range A:B it holds",
             commands=frozenset({"station"})),
    _Setting("stations", "MOONSHINE_MESH_STATIONS", "--stations", parse_str,
             "mesh host: the stations' base URLs, comma-separated",
             commands=frozenset({"host"})),
    _Setting("mesh_token", "MOONSHINE_MESH_TOKEN", "--mesh-token", parse_str,
             "the bearer token stations require on /forward, /lm_head and /info (keep it secret)",
             commands=_MESH),
    _Setting("insecure_mesh", "MOONSHINE_INSECURE_MESH", "--insecure-mesh", parse_bool,
             "allow a mesh without a token (a trusted network only)",
             commands=_MESH),
    _Setting("mesh_recover_s", "MOONSHINE_MESH_RECOVER_S", "--mesh-recover-s", parse_float,
             "mesh host: seconds to wait for a lost station before failing the requests in flight",
             commands=frozenset({"host"})),
    _Setting("mesh_hop_timeout_s", "MOONSHINE_MESH_HOP_TIMEOUT_S", "--mesh-hop-timeout-s", parse_float,
             "mesh host: timeout of one request to one station",
             commands=frozenset({"host"})),
    _Setting("mesh_pipeline", "MOONSHINE_MESH_PIPELINE", "--mesh-pipeline", parse_bool,
             "mesh host: split the lanes into one group per station and overlap the groups' waves",
             commands=frozenset({"host"})),
)
_BY_FIELD = {s.field: s for s in SETTINGS}


def _name(field: str) -> str:
    """How an error names a setting nobody set: its environment variable (the flag is in --help)."""
    s = _BY_FIELD[field]
    return s.env or s.flag


@dataclasses.dataclass(frozen=True)
class StationConfig:
    """Every station setting. Build it with `resolve`; `__post_init__` rejects what cannot work."""

    model: str | None = None  # None: the embedded default model
    dtype: str | None = None  # None: the backend's default, decided by the plan (config/plan.py)
    attention: str = "auto"
    layer_loop: str = "auto"
    matmul: str = "auto"
    tensor_parallel: int = 1
    coordinator_address: str | None = None  # a group of processes (group/process_group.py); None: one process
    num_processes: int | None = None
    process_id: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None
    lanes: int = 8
    wave_widths: str | tuple[int, ...] = "auto"  # "auto", or the widths with the lanes (given as full, or 1,4,16)
    prefill_budget: str | int = "auto"  # "auto", or the rows (given as off: 0, or a number)
    max_seq: int = 2048
    prefill_chunk: int = 32
    kv_block: int = 128
    kv_windows: str = "ring"
    kv_dtype: str = "auto"
    continuous: bool = False
    prefix_reuse: str = "auto"
    prefix_cache_ram: int | None = None  # MiB; None: a quarter of the available RAM, at most 8 GiB
    prefix_cache_dir: str | None = None  # the disk tier's directory; None: no disk tier
    prefix_cache_disk_mb: int | None = None  # MiB; None: PREFIX_CACHE_DISK_DEFAULT
    speculative: str = "off"
    draft_model: str | None = None  # speculative=draft: the draft model's checkpoint
    draft_tokens: int = 3
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) of each adapter loaded at start-up
    max_loras: int | None = None  # None: as many as lora_modules, at least 1 with allow_runtime_lora
    max_lora_rank: int = 16
    allow_runtime_lora: bool = False
    max_queue: int = 64
    drain_s: float = 30.0
    max_body_bytes: int = 1 * MiB
    api_key: str | None = dataclasses.field(default=None, repr=False)
    web: bool = True
    chat_template: str | None = dataclasses.field(default=None, repr=False)  # the template's text, once read
    served_model_name: tuple[str, ...] = ()
    reasoning_parser: str = "auto"
    responses_store_size: int = 256
    responses_store_age_s: float = 3600.0
    log_format: str = "text"
    compile_cache_dir: str | None = None  # None: no persistent compilation cache
    layers: str | None = None  # station mode: "A:B"
    stations: str | None = None  # host mode: "URL,URL,..."
    mesh_token: str | None = dataclasses.field(default=None, repr=False)
    insecure_mesh: bool = False
    mesh_recover_s: float = 60.0
    mesh_hop_timeout_s: float = 30.0
    mesh_pipeline: bool = False
    # field -> what the user typed to set it ("--lanes" or "MOONSHINE_BATCH_LANES"), so that errors name that
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def named(self, field: str) -> str:
        """How an error names a setting: the flag or variable that set it, else its environment variable."""
        return self.sources.get(field) or _name(field)

    def __post_init__(self) -> None:
        for field, choices in (("dtype", DTYPES), ("attention", ATTENTION_CHOICES),
                               ("layer_loop", LAYER_LOOP_CHOICES), ("matmul", MATMUL_CHOICES),
                               ("reasoning_parser", REASONING_PARSERS), ("kv_windows", KV_WINDOWS),
                               ("kv_dtype", KV_DTYPES), ("speculative", SPECULATIVE), ("prefix_reuse", PREFIX_REUSE)):
            value = getattr(self, field)
            if value is not None and value not in choices:
                raise ConfigError(f"{self.named(field)}={value!r} must be one of {', '.join(choices)}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ConfigError(f"{self.named('speculative')}=draft and {self.named('draft_model')} go together (here: "
                              f"{self.speculative} and {self.draft_model or 'no draft model'})")
        if self.max_lora_rank < 1 or (self.max_loras is not None and self.max_loras < 0):
            raise ConfigError(f"{self.named('max_lora_rank')}={self.max_lora_rank} must be >= 1 and "
                              f"{self.named('max_loras')}={self.max_loras} >= 0")
        if self.max_loras is not None and len(self.lora_modules) > self.max_loras:
            raise ConfigError(f"{self.named('lora_modules')} names {len(self.lora_modules)} adapters, more than "
                              f"{self.named('max_loras')}={self.max_loras} resident at once")
        if self.responses_store_age_s <= 0:
            raise ConfigError(f"{self.named('responses_store_age_s')}={self.responses_store_age_s} must be > 0")
        if self.prefix_cache_ram is not None and self.prefix_cache_ram < 0:
            raise ConfigError(f"{self.named('prefix_cache_ram')}={self.prefix_cache_ram} must be >= 0 MiB (0: off)")
        if self.prefix_cache_disk_mb is not None and self.prefix_cache_disk_mb < 1:
            raise ConfigError(f"{self.named('prefix_cache_disk_mb')}={self.prefix_cache_disk_mb} must be >= 1 MiB")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"{self.named('port')}={self.port} must be a TCP port in [0, 65535]")
        for field in ("lanes", "max_seq", "prefill_chunk", "kv_block", "max_queue", "max_body_bytes",
                      "responses_store_size", "draft_tokens", "tensor_parallel"):
            if getattr(self, field) < 1:
                raise ConfigError(f"{self.named(field)}={getattr(self, field)} must be >= 1")
        object.__setattr__(self, "wave_widths", self._parse_wave_widths())
        object.__setattr__(self, "prefill_budget", self._parse_prefill_budget())
        for field in ("prefill_chunk", "kv_block"):
            if self.max_seq % getattr(self, field):
                raise ConfigError(f"{self.named('max_seq')}={self.max_seq} must be a multiple of "
                                  f"{self.named(field)}={getattr(self, field)}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"{self.named('log_format')}={self.log_format!r} must be one of {', '.join(LOG_FORMATS)}")
        if not self.drain_s >= 0:
            raise ConfigError(f"{self.named('drain_s')}={self.drain_s} must be >= 0 seconds")
        if not self.mesh_recover_s >= 0:
            raise ConfigError(f"{self.named('mesh_recover_s')}={self.mesh_recover_s} must be >= 0 seconds")
        if not self.mesh_hop_timeout_s > 0:
            raise ConfigError(f"{self.named('mesh_hop_timeout_s')}={self.mesh_hop_timeout_s} must be > 0 seconds")
        if self.chat_template is not None:
            try:
                object.__setattr__(self, "chat_template", read_template(self.chat_template)[0])
            except ValueError as e:
                raise ConfigError(f"{self.named('chat_template')}: {e}") from None
        if self.layers is not None:
            try:
                LayerRange.parse(self.layers)
            except ValueError as e:
                raise ConfigError(f"{self.named('layers')}={self.layers!r}: {e}") from None
        for url in self.station_urls:
            if not url.startswith(("http://", "https://")) or url.count("://") != 1:
                raise ConfigError(f"{self.named('stations')} holds {url!r}, which is not an http(s):// URL")

    def _parse_wave_widths(self) -> str | tuple[int, ...]:
        """wave_widths as given (auto, full, "1,4,16" or already parsed) -> "auto" or the sorted widths with the
        lanes."""
        given = self.wave_widths
        if given in ("auto", "full"):
            return given if given == "auto" else (self.lanes,)
        try:
            widths = set(given) if isinstance(given, tuple) else {int(w) for w in given.split(",")}
        except ValueError:
            raise ConfigError(f"{self.named('wave_widths')}={given!r} must be auto, full or a comma-separated list of "
                              "widths such as 1,4,16") from None
        if not all(1 <= w <= self.lanes for w in widths):
            raise ConfigError(f"{self.named('wave_widths')}={given!r}: every width must lie in [1, "
                              f"{self.named('lanes')}={self.lanes}]")
        return tuple(sorted(widths | {self.lanes}))

    def _parse_prefill_budget(self) -> str | int:
        """prefill_budget as given (auto, off, a number of rows, or already parsed) -> "auto" or the rows (0: off)."""
        given = self.prefill_budget
        if given in ("auto", "off"):
            return given if given == "auto" else 0
        if isinstance(given, int) and given == 0:  # off, parsed already
            return 0
        try:
            budget = int(given)
        except ValueError:
            budget = 0
        if budget < self.lanes:
            raise ConfigError(f"{self.named('prefill_budget')}={given!r} must be auto, off or a number of rows of "
                              f"at least {self.named('lanes')}={self.lanes}")
        return budget

    @property
    def layer_range(self) -> LayerRange | None:
        return LayerRange.parse(self.layers) if self.layers is not None else None

    @property
    def station_urls(self) -> list[str]:
        """The mesh host's stations, in the order given, without trailing slashes."""
        return [u.strip().rstrip("/") for u in (self.stations or "").split(",") if u.strip()]

    def check_mesh_security(self) -> None:
        """A mesh station or host needs the shared token, unless told the network is trusted."""
        if not self.mesh_token and not self.insecure_mesh:
            raise ConfigError(f"{self.named('mesh_token')} is not set: stations and host need the shared mesh token "
                              f"(or {_BY_FIELD['insecure_mesh'].flag} on a trusted network)")

    def reuse_prefix(self, resume: bool) -> bool:
        """Whether a request (with its `resume` flag; False on the OpenAI routes) may start on cached KV."""
        return self.prefix_reuse == "auto" or (self.prefix_reuse == "resume" and resume)

    @property
    def model_is_gguf(self) -> bool:
        """The model is a GGUF file (the embedded default model is one); a link by what it links to, as the loader
        reads it (the image's /opt/jaxstation/model)."""
        return self.model is None or Path(self.model).resolve().suffix == ".gguf"

    @property
    def lora_slots(self) -> int:
        """The LoRA adapters a station holds at once (`max_loras`, or its default)."""
        if self.max_loras is not None:
            return self.max_loras
        return max(len(self.lora_modules), 1) if self.allow_runtime_lora else len(self.lora_modules)

    @property
    def max_request_tokens(self) -> int:
        """The most prompt + max_new_tokens one request may ask for (the last generated token is never fed)."""
        return self.max_seq


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Register one flag per setting that `command` uses. Every default is None so that `resolve` can tell a flag from
    its absence."""
    defaults = StationConfig()
    for s in SETTINGS:
        if command not in s.commands:
            continue
        default = getattr(defaults, s.field)
        if isinstance(default, bool):
            default = "on" if default else "off"
        shown = "" if default in (None, ()) or s.field == "api_key" else f" (default: {default})"
        help_ = f"{s.help}{shown} [env {s.env}]" if s.env else f"{s.help}{shown}"
        if s.parse is parse_bool:
            parser.add_argument(s.flag, dest=s.field, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif s.parse is parse_int:
            parser.add_argument(s.flag, dest=s.field, type=int, default=None, help=help_)
        elif s.parse is parse_float:
            parser.add_argument(s.flag, dest=s.field, type=float, default=None, help=help_)
        elif s.parse is parse_lora_modules:
            parser.add_argument(s.flag, dest=s.field, nargs="+", default=None, help=help_)
        else:
            parser.add_argument(s.flag, dest=s.field, default=None, help=help_)


def resolve(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None,
            command: str | None = None) -> StationConfig:
    """CLI flags override environment variables, which override the defaults; with `command`, only the settings it
    uses are read. Raises ConfigError naming the flag or variable that holds the bad value."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in SETTINGS:
        if command is not None and command not in s.commands:
            continue
        flag_value = getattr(args, s.field, None) if args is not None else None
        if flag_value is not None:  # argparse typed the numbers and booleans; the rest is parsed here
            flag_value = " ".join(flag_value) if isinstance(flag_value, list) else flag_value
            values[s.field] = s.parse(s.flag, flag_value) if isinstance(flag_value, str) else flag_value
            sources[s.field] = s.flag
        elif s.env and env.get(s.env, "").strip():
            values[s.field], sources[s.field] = s.parse(s.env, env[s.env]), s.env
    return StationConfig(**values, sources=sources)

