"""Host mode: the scheduler and every HTTP route of a station over a model split across mesh stations, whose engine
is a `MeshEngine` (mesh/host_engine.py). /health also names each station and whether it answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxstation.config.plan import Plan
from jaxstation.config.settings import StationConfig
from jaxstation.mesh.host_engine import MeshEngine
from jaxstation.mesh.stage import fingerprint
from jaxstation.model.loader import LoadedModel
from jaxstation.openai.routes import openai_endpoints
from jaxstation.server.openapi import Endpoint
from jaxstation.server.protocol import ErrorResponse
from jaxstation.server.routes import station_app, station_endpoints
from jaxstation.server.station import Station


# ---- the host app ------------------------------------------------------------------------------------------------
class StationState(BaseModel):
    url: str
    up: bool
    status: str | None
    layers: str | None = None
    epoch: str | None = None


class HostHealthResponse(BaseModel):
    status: str
    stations: list[StationState]
    down: list[str]
    error: str | None = None


def create_host_app(config: StationConfig, *, model: LoadedModel | None = None) -> tuple[Starlette, Station]:
    """The station app (the scheduler, /generate, the OpenAI routes) over a MeshEngine, and its Station. /health also
    names each station and whether it answers."""

    def engine_factory(loaded: LoadedModel, c: StationConfig, plan: Plan) -> MeshEngine:
        model_fp = fingerprint(loaded)
        station.model = dataclasses.replace(loaded, params=None)  # the host needs the config and tokenizer only
        return MeshEngine.connect(c, plan, loaded.cfg, model_fp)

    station = Station(config, model=model, engine_factory=engine_factory)
    probe = httpx.Client(timeout=2.0)

    def stations_state() -> list[dict[str, Any]]:
        out = []
        for url in config.station_urls:
            try:
                r = probe.get(url + "/health")
                body = r.json()
                out.append({"url": url, "up": r.status_code == 200, "status": body.get("status"),
                            "layers": body.get("layers"), "epoch": body.get("epoch")})
            except (httpx.HTTPError, ValueError) as e:
                out.append({"url": url, "up": False, "status": f"unreachable: {type(e).__name__}"})
        return out

    async def health(request: Request) -> Response:
        stations = await asyncio.to_thread(stations_state)
        down = [s["url"] for s in stations if not s["up"]]
        if station.load_error:
            status, code = "failed", 503
        elif station.scheduler is not None and not station.scheduler.alive:
            status, code = "decode thread died", 503
        else:
            status, code = ("degraded" if down else "ok"), 200
        body = {"status": status, "stations": stations, "down": down}
        if station.load_error:
            body["error"] = station.load_error
        return JSONResponse(body, code)

    host_health = Endpoint("/health", "GET", health, "Whether the host is up, and each station", HostHealthResponse,
                           ErrorResponse, statuses=(), ok_statuses=(200, 503))
    endpoints = [host_health] + [e for e in station_endpoints(station) if e.path != "/health"]
    endpoints = [_with_bad_gateway(e) for e in endpoints + openai_endpoints(station)]
    return station_app(station, endpoints, title="jaxstation mesh host"), station


def _with_bad_gateway(e: Endpoint) -> Endpoint:
    """A route that runs steps may also answer 502 on a host: a station stayed down past mesh_recover_s."""
    return dataclasses.replace(e, statuses=e.statuses + (502,)) if 500 in e.statuses else e
