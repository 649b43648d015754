"""Station mode: one layer range of the model behind HTTP, for a mesh host to drive (`jaxstation station`).

Routes: `GET /health` (open) says whether the station is up and its epoch; `GET /ready` (open) is 200 only once
the station can serve (a start-up probe); `GET /metrics` gives request counts and step times; `GET /info` tells a
host what the station holds (layers, model fingerprint, lane geometry, dtype); `POST /forward` runs one wave through
the range; `POST /lm_head` (last station only) samples; `POST /score` (last station only) gives a prefill chunk's
prompt logprobs. All but /health and /ready need the mesh token as a bearer token, compared in constant time.
Payloads are `group.payload` binary; a payload that does not fit the station's settings gets a 400 JSON error naming
the field, and an unknown route or method a JSON 404 or 405.

The epoch is a random id chosen when the station starts (and again whenever its arena is rebuilt), sent with every
reply (`X-Mesh-Epoch` and the binary header's meta): a host that sees it change knows the station's KV is gone.
Steps run one at a time on a worker thread; the event loop only moves bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxstation.config.coldstart import enable_compile_cache
from jaxstation.config.memory import check_memory
from jaxstation.config.plan import load_planned, startup_plan
from jaxstation.config.settings import StationConfig
from jaxstation.engine.metrics import MeshStationMetrics
from jaxstation.group.payload import CONTENT_TYPE, MAX_HEADER_BYTES, PayloadError, decode, encode
from jaxstation.mesh.stage import Stage
from jaxstation.model.loader import LoadedModel
from jaxstation.server.access_log import configure_logging
from jaxstation.server.http_common import BodyError, read_body
from jaxstation.server.routes import json_http_error
from jaxstation.server.serve import run_server, uvicorn_config
from jaxstation.server.station import start_failed

log = logging.getLogger(__name__)
EPOCH_HEADER = "X-Mesh-Epoch"


class MeshStation:
    """The station's state: its Stage once loaded, its epoch, and the lock that lets one step run at a time."""

    def __init__(self, config: StationConfig, *, model: LoadedModel | None = None) -> None:
        if config.layer_range is None:
            raise ValueError("a mesh station needs its layer range (MOONSHINE_LAYERS / --layers A:B)")
        self.config = config
        self.model = model
        self.epoch = secrets.token_hex(8)
        self.stage: Stage | None = None
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.on_load_failed: Callable[[], None] | None = None
        self.step_lock = threading.Lock()
        self.metrics = MeshStationMetrics()
        self._loader: threading.Thread | None = None

    def start(self) -> None:
        self._loader = threading.Thread(target=self._load, name="jaxstation-station-load", daemon=True)
        self._loader.start()

    @property
    def loading(self) -> bool:
        """Whether the loading thread is still loading weights or compiling."""
        return self._loader is not None and self._loader.is_alive()

    def _load(self) -> None:
        try:
            c, layers = self.config, self.config.layer_range
            enable_compile_cache(c.compile_cache_dir)
            plan = startup_plan(c, self.model.cfg if self.model is not None else None)
            model = self.model or load_planned(c, plan)
            if layers.stop > model.cfg.num_layers:
                raise ValueError(f"MOONSHINE_LAYERS={layers} reaches past the model's {model.cfg.num_layers} layers")
            check_memory(model.cfg.layers(layers.start, layers.stop), c, plan.dtype, weights_resident=True,
                         kv_dtype=plan.kv_dtype)
            stage = Stage(model, layers, c.lanes, c.max_seq, c.prefill_chunk, c.kv_block, attention=plan.attention,
                          weights=plan.dtype, kv_dtype=plan.kv_dtype)
            self.model = None  # the whole model's weights go; the stage keeps its range
            t0 = time.perf_counter()
            stage.warmup()
            self.stage = stage
            self.ready.set()
            log.info("station %s ready (warm-up %.1f s), epoch %s", layers, time.perf_counter() - t0, self.epoch)
        except Exception as e:
            start_failed(self, e)

    @property
    def max_body_bytes(self) -> int:
        """The largest valid payload: a header plus the biggest residual block (a prefill chunk or a full wave)."""
        s = self.stage
        rows = max(s.lanes, s.chunk)
        return MAX_HEADER_BYTES + rows * (s.cfg.hidden_size * 4 + 64)

    def run(self, step: Callable[[Stage], dict]) -> dict:
        """Run a step alone. A step that raises leaves a fresh arena and a new epoch (the KV is gone)."""
        with self.step_lock:
            try:
                return step(self.stage)
            except Exception:
                self.stage.reset()
                self.epoch = secrets.token_hex(8)
                raise


def _error(status: int, message: str, field: str | None, epoch: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "field": field}, "epoch": epoch}, status,
                        headers={EPOCH_HEADER: epoch, **headers})


def _forward(stage: Stage, meta: dict, args: tuple) -> dict:
    inputs, positions, lane0, n_blocks = args
    return {"x": stage.forward(meta["wave"], inputs, positions, lane0, n_blocks)}


def _lm_head(stage: Stage, meta: dict, args: tuple) -> dict:
    x, sampling, logits = args
    return stage.lm_head(meta["wave"], x, sampling, logits)


def _score(stage: Stage, meta: dict, args: tuple) -> dict:
    return stage.score(*args)


class _StationRoutes:
    """A mesh station's routes: the probes, /metrics and /info, and the binary steps the host calls."""

    def __init__(self, station: MeshStation) -> None:
        self.station = station
        self.token = (station.config.mesh_token or "").encode()

    def refused(self, request: Request) -> Response | None:
        """401 without the mesh token (when the station has one), else None."""
        if self.token:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), self.token):
                return _error(401, "this station needs the mesh token: 'Authorization: Bearer "
                                   "<MOONSHINE_MESH_TOKEN>'", "authorization", self.station.epoch,
                              **{"WWW-Authenticate": "Bearer"})
        return None

    def guarded(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """`handler` behind the mesh token and the station's readiness."""
        station = self.station

        async def route(request: Request) -> Response:
            denied = self.refused(request)
            if denied is not None:
                return denied
            if station.load_error:
                return _error(503, f"the station failed to start: {station.load_error}", None, station.epoch)
            if not station.ready.is_set():
                return _error(503, "the station is loading", None, station.epoch, **{"Retry-After": "1"})
            return await handler(request)
        return route

    def state(self, up: str) -> Response:
        station = self.station
        status = "failed" if station.load_error else (up if station.ready.is_set() else "loading")
        return JSONResponse({"status": status, "epoch": station.epoch, "layers": station.config.layers},
                            200 if status == up else 503, headers={EPOCH_HEADER: station.epoch})

    async def health(self, request: Request) -> Response:
        return self.state("ok")

    async def ready(self, request: Request) -> Response:
        return self.state("ready")

    async def metrics(self, request: Request) -> Response:
        denied = self.refused(request)
        if denied is not None:
            return denied
        return Response(generate_latest(self.station.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def info(self, request: Request) -> Response:
        station = self.station
        return JSONResponse({**station.stage.info(), "epoch": station.epoch, "auth": bool(self.token)},
                            headers={EPOCH_HEADER: station.epoch})

    def binary_step(self, name: str, check: str, run: Callable[[Stage, dict, tuple], dict]
                    ) -> Callable[[Request], Awaitable[Response]]:
        """A route that decodes a wire body, checks it with the stage's `check`, and runs `run` alone."""
        station = self.station
        requests = station.metrics.requests

        async def route(request: Request) -> Response:
            try:
                body = await read_body(request, station.max_body_bytes)
                meta, arrays = decode(body)
                args = getattr(station.stage, check)(meta, arrays)
            except BodyError as e:
                requests.labels(name, "invalid").inc()
                return _error(e.status, e.message, "body", station.epoch)
            except PayloadError as e:
                requests.labels(name, "invalid").inc()
                return _error(400, e.message, e.field, station.epoch)
            t0 = time.perf_counter()
            try:
                out = await asyncio.to_thread(station.run, lambda stage: run(stage, meta, args))
            except Exception as e:  # the arena was rebuilt and the epoch changed: the host will replay
                log.exception("step failed")
                requests.labels(name, "failed").inc()
                return _error(500, f"step failed: {type(e).__name__}: {e}", None, station.epoch)
            seconds = time.perf_counter() - t0
            station.metrics.step.labels(name).observe(seconds)
            requests.labels(name, "ok").inc()
            reply = {"epoch": station.epoch, "compute_ms": seconds * 1e3}
            return Response(encode(reply, out), media_type=CONTENT_TYPE, headers={EPOCH_HEADER: station.epoch})
        return route


def create_station_app(station: MeshStation) -> Starlette:
    r = _StationRoutes(station)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        station.start()
        yield

    return Starlette(exception_handlers={HTTPException: json_http_error}, routes=[
        Route("/health", r.health, methods=["GET"]),
        Route("/ready", r.ready, methods=["GET"]),
        Route("/metrics", r.metrics, methods=["GET"]),
        Route("/info", r.guarded(r.info), methods=["GET"]),
        Route("/forward", r.guarded(r.binary_step("forward", "check_forward", _forward)), methods=["POST"]),
        Route("/lm_head", r.guarded(r.binary_step("lm_head", "check_lm_head", _lm_head)), methods=["POST"]),
        Route("/score", r.guarded(r.binary_step("score", "check_score", _score)), methods=["POST"]),
    ], lifespan=lifespan)


def serve_station(config: StationConfig) -> int:
    """Run a mesh station on uvicorn until SIGTERM/SIGINT. Returns the process exit code."""
    configure_logging(config.log_format)
    station = MeshStation(config)
    return run_server(uvicorn.Server(uvicorn_config(config, create_station_app(station))), station)
