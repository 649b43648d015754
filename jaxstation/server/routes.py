"""The station's own routes, and the app that serves them with whatever face sits above (the OpenAI API).

`POST /generate` validates its body (`server.protocol`), submits one `Job` and awaits its Future; a client that
disconnects meanwhile cancels its job. `/health` answers at once, `/ready` only when the station can serve,
`/metrics` in Prometheus' text format, and `/station/status` what the lanes and the queue hold now, from the snapshot
the decode thread publishes (so polling it costs the decode thread nothing). With an API key set, every route but
/health and /ready needs it. Errors, 401 and unmatched routes included, answer in OpenAI's shape under `/v1/` and on
vLLM's tokenizer routes, and in the station's elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxstation import __version__
from jaxstation.engine.activity import BUCKET_S, BUCKETS
from jaxstation.engine.jobs import Job, Result
from jaxstation.server.access_log import AccessLogMiddleware
from jaxstation.server.errors import OPENAI_PATHS, StationError, error_response
from jaxstation.server.http_common import read_json, until_disconnect
from jaxstation.server.openapi import OPEN_PATHS, Endpoint, openapi_endpoint, routes
from jaxstation.server.outcomes import OUTCOMES, STATION_INVALID, Disconnected, check_ready, failure, wait_for
from jaxstation.server.protocol import (
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    LaneStatus,
    PrefixCacheStatus,
    ReadyResponse,
    ResetPrefixCacheResponse,
    StationStatusResponse,
    ThroughputStatus,
    parse_generate,
)
from jaxstation.server.station import Station
from jaxstation.server.web.page import is_web_path, web_routes


class ApiKeyMiddleware:
    """Pure ASGI: with the station's api_key set, every HTTP route but OPEN_PATHS and the chat page's files (the
    page itself asks for the key and sends it on its API calls) needs the key, sent as
    `Authorization: Bearer <key>` or (Anthropic's clients) `x-api-key: <key>`."""

    def __init__(self, app: ASGIApp, station: Station) -> None:
        self.app, self.station = app, station

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.station.config.api_key
        if scope["type"] != "http" or not key or self._open(scope["path"]):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        sent = given.strip().encode() if scheme.lower() == "bearer" else headers.get(b"x-api-key", b"").strip()
        if sent and secrets.compare_digest(sent, key.encode()):
            return await self.app(scope, receive, send)
        path = scope["path"]
        field = None if path.startswith(OPENAI_PATHS) else "authorization"  # OpenAI's 401 names no param
        reply = error_response(path, 401, "a valid API key is required: send 'Authorization: Bearer "
                               "<MOONSHINE_API_KEY>'", field, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await reply(scope, receive, send)

    def _open(self, path: str) -> bool:
        return path in OPEN_PATHS or (self.station.config.web and is_web_path(path))


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved: a cancelled job's Cancelled is expected and nobody awaits it


def rejected(station: Station, request: Request, error: Exception, invalid: int) -> Response:
    """The reply to a request refused before it ran (counted as "invalid" or "rejected")."""
    f = failure(error, invalid)
    station.metrics.requests.labels("invalid" if f.status < 500 else "rejected").inc()
    return f.response(request.url.path)


def readiness(station: Station) -> str:
    """What /ready says: ready, loading, draining or failed."""
    scheduler = station.scheduler
    if station.ready.is_set() and not station.draining and scheduler is not None and scheduler.alive:
        return "ready"
    return "draining" if station.draining else ("failed" if station.load_error else "loading")


def station_status(station: Station) -> StationStatusResponse:
    """The station's state from its decode thread's last snapshot; no lanes before the scheduler starts."""
    snap = station.scheduler.activity.snapshot if station.scheduler is not None else None
    if snap is None:
        zeros = [0.0] * BUCKETS
        return StationStatusResponse(
            status=readiness(station), at=None, lanes=[], queued=0, max_queue=station.config.max_queue,
            generated_tokens=0, prompt_tokens=0, prefix_cache=PrefixCacheStatus(lookups=0, hits=0, reused_tokens=0),
            throughput=ThroughputStatus(bucket_s=BUCKET_S, generated=zeros, prefilled=zeros))
    generated, prefilled = snap.rates(time.monotonic())
    return StationStatusResponse(
        status=readiness(station), at=snap.at, lanes=[LaneStatus(**dataclasses.asdict(lane)) for lane in snap.lanes],
        queued=snap.queued, max_queue=station.config.max_queue, generated_tokens=snap.generated_tokens,
        prompt_tokens=snap.prefilled_tokens, throughput=ThroughputStatus(bucket_s=BUCKET_S, generated=generated,
                                                                         prefilled=prefilled),
        prefix_cache=PrefixCacheStatus(lookups=snap.prefix_lookups, hits=snap.prefix_hits,
                                       reused_tokens=snap.prefix_reused_tokens))


def station_endpoints(station: Station) -> list[Endpoint]:
    """/generate, /health, /ready, /reset_prefix_cache, /metrics and /station/status on `station`."""

    async def submit(request: Request) -> tuple[Job, Future]:
        scheduler = check_ready(station)
        body = await read_json(request, station.config.max_body_bytes)
        job, spec = parse_generate(body, station.model.cfg.vocab_size, station.config.max_request_tokens,
                                   station.eos_ids, station.config.reuse_prefix, station.engine.token_controls)
        if (name := body.get("lora")) is not None and not station.use_adapter(job, name):
            loaded = [r.name for r in station.adapters.residents()] if station.adapters else []
            raise StationError(404, f"lora {name!r} is not a loaded adapter (loaded: {', '.join(loaded) or 'none'})",
                               "lora")
        if spec is not None:
            job.constraint = await asyncio.to_thread(station.compile_constraint, spec)
        return job, scheduler.submit(job)

    async def generate(request: Request) -> Response:
        try:
            job, future = await submit(request)
        except OUTCOMES as e:
            return rejected(station, request, e, STATION_INVALID)
        result_fut = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            await wait_for(result_fut, station.scheduler, lambda: [future], gone)
            result: Result = result_fut.result()
        except Disconnected:
            station.scheduler.cancel(job)  # its lane is freed within one wave; nobody reads this reply
            result_fut.add_done_callback(_retrieve)
            return Response(status_code=499)
        except OUTCOMES as e:
            return failure(e, STATION_INVALID).response(request.url.path)
        finally:
            gone.cancel()
        request.state.token_counts = lambda: (result.prompt_tokens, len(result.generated))  # for the access line
        return JSONResponse(GenerateResponse(generated=result.generated, finish_reason=result.finish_reason,
                                             prompt_tokens=result.prompt_tokens, timing=result.timing).model_dump())

    async def health(request: Request) -> Response:
        scheduler = station.scheduler
        if station.load_error:
            reply, status = HealthResponse(status="failed", error=station.load_error), 503
        elif scheduler is not None and not scheduler.alive:
            reply, status = HealthResponse(status="stopped" if station.draining else "decode thread died"), 503
        else:
            reply, status = HealthResponse(status="ok"), 200
        return JSONResponse(reply.model_dump(exclude_none=True), status)

    async def ready(request: Request) -> Response:
        status = readiness(station)
        return JSONResponse(ReadyResponse(status=status).model_dump(), 200 if status == "ready" else 503)

    async def status(request: Request) -> Response:
        return JSONResponse(station_status(station).model_dump())

    async def reset_prefix_cache(request: Request) -> Response:
        try:
            cleared = await asyncio.wrap_future(check_ready(station).reset_prefix_cache())
        except OUTCOMES as e:
            return failure(e, STATION_INVALID).response(request.url.path)
        return JSONResponse(ResetPrefixCacheResponse(cleared=cleared).model_dump())

    async def metrics_route(request: Request) -> Response:
        return Response(generate_latest(station.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return [
        Endpoint("/generate", "POST", generate, "Token ids in, generated token ids out", GenerateResponse,
                 ErrorResponse, request=GenerateRequest, statuses=(400, 404, 413, 422, 500, 503)),
        Endpoint("/health", "GET", health, "Whether the process is up (200 while loading)", HealthResponse,
                 ErrorResponse, statuses=(), ok_statuses=(200, 503)),
        Endpoint("/ready", "GET", ready, "Whether the station can serve (503 while loading or draining)",
                 ReadyResponse, ErrorResponse, statuses=(), ok_statuses=(200, 503)),
        Endpoint("/reset_prefix_cache", "POST", reset_prefix_cache, "vLLM's: forget the cached prefixes of free "
                 "lanes and host memory, so the next requests prefill in full", ResetPrefixCacheResponse, ErrorResponse,
                 statuses=(503,)),
        Endpoint("/metrics", "GET", metrics_route, "Prometheus metrics", None, ErrorResponse, statuses=(),
                 media_type=CONTENT_TYPE_LATEST),
        Endpoint("/station/status", "GET", status, "Each lane's state, the queue, tokens per second, prefix-cache "
                 "hits: the decode thread's last snapshot", StationStatusResponse, ErrorResponse, statuses=()),
    ]


async def json_http_error(request: Request, exc: HTTPException) -> Response:
    """Unmatched routes and methods answer in JSON like every other error, in the shape of the path's API."""
    path, method = request.url.path, request.method
    if exc.status_code == 404:
        message, code = f"no route {method} {path}", "not_found"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message, code = f"{method} is not allowed on {path} (allowed: {allowed})", "method_not_allowed"
    else:
        message, code = exc.detail, None
    return error_response(path, exc.status_code, message, None, code, headers=exc.headers)


def station_app(station: Station, endpoints: Sequence[Endpoint], *, title: str = "jaxstation") -> Starlette:
    """The Starlette app serving `endpoints` (and `GET /openapi.json` for them) on `station`, and the chat page unless
    the config turns it off: access log, API key, JSON 404/405. Its lifespan starts the station and drains it on
    shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        station.start()
        yield
        await asyncio.to_thread(station.shutdown)

    doc, document = openapi_endpoint(endpoints, ErrorResponse, title=title, version=__version__,
                                     api_key=bool(station.config.api_key))
    served: list[Any] = routes([*endpoints, doc]) + (web_routes() if station.config.web else [])
    app = Starlette(exception_handlers={HTTPException: json_http_error}, routes=served, lifespan=lifespan,
                    middleware=[Middleware(AccessLogMiddleware), Middleware(ApiKeyMiddleware, station=station)])
    app.state.openapi = document  # what tests check every reply against
    return app
