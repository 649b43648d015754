"""A station in this process for offline work: its settings resolved once, as `jaxstation batch`'s (keyword
arguments, or flags, over `MOONSHINE_*` variables over the defaults), its model made local, loaded, warmed up and
batching continuously; no HTTP."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

from jaxstation.config.draft import check_draft
from jaxstation.config.flags import SETTINGS
from jaxstation.config.hub_model import local_model
from jaxstation.config.plan import auto_max_seq, resolve_plan
from jaxstation.config.settings import StationConfig, resolve
from jaxstation.model.loader import checkpoint_config
from jaxstation.model.source import model_source
from jaxstation.server.station import Station

COMMAND = "batch"  # the offline station's settings are those of `jaxstation batch`
OFFLINE_SETTINGS = tuple(s.field for s in SETTINGS if COMMAND in s.commands)


class StationFailed(RuntimeError):
    """The station could not load its model or compile its steps."""


def offline_config(settings: Mapping[str, Any], env: Mapping[str, str] | None = None) -> StationConfig:
    """Keyword `settings` (StationConfig fields, as `LLM(...)` takes them) over the `MOONSHINE_*` variables of
    `env`, validated once; an error names the keyword (`lanes=0 must be >= 1`) or the variable."""
    unknown = sorted(set(settings) - set(OFFLINE_SETTINGS))
    if unknown:
        raise TypeError(f"unknown setting {', '.join(unknown)}; the settings are: {', '.join(OFFLINE_SETTINGS)}")
    from_env = resolve(None, env, command=COMMAND)
    values = {field: getattr(from_env, field) for field in from_env.sources}
    return StationConfig(**{**values, **settings}, sources={**from_env.sources, **{k: k for k in settings}})


def open_station(config: StationConfig) -> Station:
    """A station of `config` (continuous batching on), its model made local, loaded and warmed up as `serve` loads
    it: its context the model's own where no setting chose one, its queue at least twice the lanes where none did
    (offline runs keep the queue full, `runs.run_all`). Raises StationFailed (or the ConfigError or CheckpointError
    that refuses the settings or the model)."""
    queue = config.max_queue if "max_queue" in config.sources else max(config.max_queue, 2 * config.lanes)
    config = dataclasses.replace(local_model(config), continuous=True, max_queue=queue)
    model_source(config.model)
    cfg = checkpoint_config(config.model)
    check_draft(config)
    config = auto_max_seq(config, cfg) if "max_seq" not in config.sources else config
    resolve_plan(config, cfg)  # a plan that refuses the settings does so here, before anything loads
    station = Station(config)
    failed = threading.Event()
    station.on_load_failed = failed.set
    station.start()
    while not station.ready.wait(0.2):
        if failed.is_set():
            raise StationFailed(f"the station failed to start: {station.load_error}")
    return station
