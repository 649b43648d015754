"""The station's own routes, and the app that serves them with whatever face sits above (the OpenAI API).

`POST /generate` validates its body (`serving.protocol`), submits one `Job` and awaits its Future; a client that
disconnects meanwhile cancels its job. `/health` answers at once, `/ready` only when the station can serve, and
`/metrics` in Prometheus' text format. With an API key set, every route but /health and /ready needs it.
Errors, 401 and unmatched routes included, answer in OpenAI's shape under `/v1/` and on vLLM's tokenizer routes,
and in the station's elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxstation import __version__
from jaxstation.engine.constraints import ConstraintError, ConstraintFailed
from jaxstation.engine.jobs import Cancelled, QueueFull, Result, ShuttingDown, StepFailed
from jaxstation.serving.access_log import AccessLogMiddleware
from jaxstation.serving.errors import OPENAI_PATHS, ApiError, error_response
from jaxstation.serving.http_common import RETRY_AFTER_S, BodyError, read_json, until_disconnect
from jaxstation.serving.openapi import Endpoint, openapi_endpoint
from jaxstation.serving.protocol import (
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    ReadyResponse,
    ResetPrefixCacheResponse,
    parse_generate,
)
from jaxstation.serving.station import Station

OPEN_PATHS = frozenset({"/health", "/ready"})  # never need the API key


class ApiKeyMiddleware:
    """Pure ASGI: with the station's api_key set, every HTTP route but /health and /ready needs the bearer key."""

    def __init__(self, app: ASGIApp, station: Station) -> None:
        self.app, self.station = app, station

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.station.config.api_key
        if scope["type"] != "http" or not key or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), key.encode()):
            return await self.app(scope, receive, send)
        path = scope["path"]
        field = None if path.startswith(OPENAI_PATHS) else "authorization"  # OpenAI's 401 names no param
        reply = error_response(path, 401, "a valid API key is required: send 'Authorization: Bearer "
                               "<MOONSHINE_API_KEY>'", field, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await reply(scope, receive, send)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved: a cancelled job's Cancelled is expected and nobody awaits it


def station_endpoints(station: Station) -> list[Endpoint]:
    """/generate, /health, /ready, /reset_prefix_cache and /metrics on `station`."""
    metrics = station.metrics

    def rejected(err: ApiError) -> JSONResponse:
        metrics.requests.labels("invalid" if err.status < 500 else "rejected").inc()
        return err.response()

    async def generate(request: Request) -> Response:
        if station.draining:
            return rejected(ApiError(503, "the station is shutting down"))
        scheduler = station.scheduler
        if scheduler is None or not station.ready.is_set():
            msg = f"the station failed to start: {station.load_error}" if station.load_error else "not ready yet"
            return rejected(ApiError(503, msg, headers={"Retry-After": str(RETRY_AFTER_S)}))
        try:
            try:
                body = await read_json(request, station.config.max_body_bytes)
            except BodyError as e:
                raise ApiError(e.status, e.message, "body") from None
            job, spec = parse_generate(body, station.model.cfg.vocab_size, station.config.max_request_tokens,
                                       station.eos_ids, station.config.reuse_prefix, station.engine.token_controls)
            if spec is not None:
                job.constraint = await asyncio.to_thread(station.compile_constraint, spec)
            future = scheduler.submit(job)
        except ConstraintError as e:
            return rejected(ApiError(422, e.message, "structured_outputs"))
        except ApiError as e:
            return rejected(e)
        except QueueFull as e:
            return rejected(ApiError(503, str(e), headers={"Retry-After": str(RETRY_AFTER_S)}))
        except ShuttingDown as e:
            return rejected(ApiError(503, str(e)))

        result_fut = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            while True:
                done, _ = await asyncio.wait({result_fut, gone}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if result_fut in done:
                    break
                if gone in done:
                    scheduler.cancel(job)  # its lane is freed within one wave; nobody reads this reply
                    result_fut.add_done_callback(_retrieve)
                    return Response(status_code=499)
                if not scheduler.alive and not future.done():  # the thread answers every Future before it ends
                    return ApiError(500, "the decode thread has died").response()
        finally:
            gone.cancel()
        try:
            result: Result = result_fut.result()
        except StepFailed as e:
            return ApiError(e.status, str(e)).response()
        except ShuttingDown as e:
            return ApiError(503, str(e)).response()
        except Cancelled as e:
            return ApiError(500, str(e)).response()
        except ConstraintFailed as e:
            return ApiError(422, str(e), "structured_outputs").response()
        request.state.token_counts = lambda: (result.prompt_tokens, len(result.generated))  # for the access line
        return JSONResponse({"generated": result.generated, "finish_reason": result.finish_reason,
                             "prompt_tokens": result.prompt_tokens, "timing": result.timing})

    async def health(request: Request) -> Response:
        if station.load_error:
            return JSONResponse({"status": "failed", "error": station.load_error}, 503)
        scheduler = station.scheduler
        if scheduler is not None and not scheduler.alive:
            return JSONResponse({"status": "stopped" if station.draining else "decode thread died"}, 503)
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        scheduler = station.scheduler
        if station.ready.is_set() and not station.draining and scheduler is not None and scheduler.alive:
            return JSONResponse({"status": "ready"})
        status = "draining" if station.draining else ("failed" if station.load_error else "loading")
        return JSONResponse({"status": status}, 503)

    async def reset_prefix_cache(request: Request) -> Response:
        scheduler = station.scheduler
        if scheduler is None or not station.ready.is_set():
            return ApiError(503, "not ready yet", headers={"Retry-After": str(RETRY_AFTER_S)}).response()
        return JSONResponse({"cleared": scheduler.reset_prefix_cache()})

    async def metrics_route(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return [
        Endpoint("/generate", "POST", generate, "Token ids in, generated token ids out", GenerateResponse,
                 ErrorResponse, request=GenerateRequest, statuses=(400, 413, 422, 500, 503)),
        Endpoint("/health", "GET", health, "Whether the process is up (200 while loading)", HealthResponse,
                 ErrorResponse, statuses=(), ok_statuses=(200, 503)),
        Endpoint("/ready", "GET", ready, "Whether the station can serve (503 while loading or draining)",
                 ReadyResponse, ErrorResponse, statuses=(), ok_statuses=(200, 503)),
        Endpoint("/reset_prefix_cache", "POST", reset_prefix_cache, "vLLM's: forget the cached prefixes of free "
                 "lanes, so the next requests prefill in full", ResetPrefixCacheResponse, ErrorResponse,
                 statuses=(503,)),
        Endpoint("/metrics", "GET", metrics_route, "Prometheus metrics", None, ErrorResponse, statuses=(),
                 media_type=CONTENT_TYPE_LATEST),
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
    """The Starlette app serving `endpoints` (and `GET /openapi.json` for them) on `station`: access log, API key,
    JSON 404/405. Its lifespan starts the station and drains it on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        station.start()
        yield
        await asyncio.to_thread(station.shutdown)

    doc = openapi_endpoint(endpoints, ErrorResponse, title=title, version=__version__,
                           api_key=bool(station.config.api_key))
    routes: list[Any] = [e.route() for e in [*endpoints, doc]]
    return Starlette(exception_handlers={HTTPException: json_http_error}, routes=routes, lifespan=lifespan,
                     middleware=[Middleware(AccessLogMiddleware), Middleware(ApiKeyMiddleware, station=station)])
