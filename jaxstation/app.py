"""The whole HTTP app of a station: its own routes (`server`) with the OpenAI face (`openai`) and Anthropic's
Messages API (`anthropic`) on top, and `/openapi.json` for all. It sits above those packages, so none imports the
app."""

from __future__ import annotations

from starlette.applications import Starlette

from jaxstation.anthropic.routes import anthropic_endpoints
from jaxstation.config.coldstart import StartupClock
from jaxstation.config.settings import StationConfig
from jaxstation.openai.lora_routes import lora_endpoints
from jaxstation.openai.responses import responses_endpoints
from jaxstation.openai.routes import openai_endpoints
from jaxstation.server.routes import station_app, station_endpoints
from jaxstation.server.station import EngineFactory, Station


def create_app(station: Station) -> Starlette:
    """The Starlette app for `station`. Its lifespan starts the station and drains it on shutdown. The runtime LoRA
    routes exist only with --allow-runtime-lora."""
    lora = lora_endpoints(station) if station.config.allow_runtime_lora else []
    return station_app(station, station_endpoints(station) + openai_endpoints(station)
                       + responses_endpoints(station) + anthropic_endpoints(station) + lora)


def station_and_app(config: StationConfig, engine_factory: EngineFactory | None = None) -> tuple[Starlette, Station]:
    """A station of `config`, its start-up timed from process start, and its app (what `serve` runs); its engine built
    by `engine_factory` (default: a local Engine)."""
    station = Station(config, clock=StartupClock.from_process_start(), engine_factory=engine_factory)
    return create_app(station), station
