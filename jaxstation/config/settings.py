"""Station settings: one frozen `StationConfig`, resolved from CLI flags over environment variables over defaults.

Each setting's flag, variable and help are a row of config/flags.py. A `StationConfig` holds what the user asked for,
each value parsed and checked once, on its own: it reads no backend and builds nothing. What `auto` means on this
machine and for this model is decided once, at start-up, by the station's plan (config/plan.py). `check_memory`
(config/memory.py) runs at start-up too, once the model's config is known, and fails with an error that says how much
the KV arena needs and which setting to lower.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxstation.config.flags import BY_FIELD, SETTINGS, default_name
from jaxstation.config.setting_values import ConfigError, parse_bool, parse_float, parse_int, parse_lora_modules
from jaxstation.engine.choices import ATTENTIONS, KV_DTYPES, KV_WINDOWS
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


@dataclasses.dataclass(frozen=True)
class StationConfig:
    """Every station setting. Build it with `resolve`; `__post_init__` rejects what cannot work."""

    model: str | None = None  # None: the embedded default model
    revision: str | None = None  # a Hub model's branch, tag or commit (model/hub.py)
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
        return self.sources.get(field) or default_name(field)

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
                              f"(or {BY_FIELD['insecure_mesh'].flag} on a trusted network)")

    def reuse_prefix(self, resume: bool) -> bool:
        """Whether a request (with its `resume` flag; False on the OpenAI routes) may start on cached KV."""
        return self.prefix_reuse == "auto" or (self.prefix_reuse == "resume" and resume)

    @property
    def model_is_gguf(self) -> bool:
        """The model is a GGUF file (the embedded default model is one); a link by what it links to, as the loader
        reads it (the image's /opt/jaxstation/model)."""
        return self.model is None or ".gguf" in (Path(self.model).suffix, Path(self.model).resolve().suffix)

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

