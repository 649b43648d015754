"""The station's HTTP face: Starlette on uvicorn, over TCP or a Unix socket.

`Station` owns the model, the engine, the scheduler, the metrics and the readiness state. Weights load and every
compiled step warms up in a background thread started with the app, so `/health` answers at once and `/ready` turns
200 only when the station can serve. `POST /generate` validates its body, submits one `Job` and awaits its Future;
a client that disconnects meanwhile cancels its job. `serve` runs uvicorn and drains on SIGTERM: new requests get
503 while in-flight ones finish (up to `drain_s`), then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import jax
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxstation.engine.engine import SEED_LIMIT, Engine, SamplingParams
from jaxstation.engine.runner import Runner
from jaxstation.engine.scheduler import Cancelled, Job, QueueFull, Result, Scheduler, ShuttingDown, StepFailed
from jaxstation.model.loader import LoadedModel, load_model
from jaxstation.openai.api import OpenAIError, openai_middleware, openai_routes
from jaxstation.serving.access_log import AccessLogMiddleware, configure_logging
from jaxstation.serving.coldstart import CompileCount, StartupClock, enable_compile_cache
from jaxstation.serving.http_common import RETRY_AFTER_S, BodyError, is_int, is_number, read_json, until_disconnect
from jaxstation.serving.metrics import StationMetrics
from jaxstation.serving.settings import StationConfig, check_memory

log = logging.getLogger(__name__)

_FIELDS = ("tokens", "max_new_tokens", "temperature", "seed", "top_k", "top_p", "stop_token_ids",
           "terminal_prosody", "resume")


class Station:
    """One serving station: config, model, engine, scheduler, metrics, and whether it is ready.

    model: an already loaded model (tests, or a caller that loaded it); None loads `config.model` in `start`.
    engine_factory: builds the engine from the loaded model (default: a local `Engine`; a mesh host passes its own).
    before_warmup: called in the loading thread right before the warm-up compiles (a test hook to observe /ready 503).
    clock: where start-up phase times go (logged, and gauges on /metrics); default: one counting from here.
    """

    def __init__(self, config: StationConfig, *, model: LoadedModel | None = None,
                 before_warmup: Callable[[], None] | None = None, clock: StartupClock | None = None,
                 engine_factory: Callable[[LoadedModel, StationConfig], Runner] | None = None) -> None:
        self.config = config
        self.model = model
        self.metrics = StationMetrics()
        self.clock = clock or StartupClock()  # serve() passes one that counts from process start
        self.clock.add_sink(lambda phase, seconds: self.metrics.startup.labels(phase).set(seconds))
        self.engine: Runner | None = None
        self._engine_factory = engine_factory or local_engine
        self.scheduler: Scheduler | None = None
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.on_load_failed: Callable[[], None] | None = None
        self._before_warmup = before_warmup
        self._draining = False
        self._stopped = False
        self._lock = threading.Lock()
        self._loader: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Load, build and warm up in a background thread; returns at once."""
        self._loader = threading.Thread(target=self._load, name="jaxstation-load", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        """Load, allocate, compile every step shape, start the decode thread; each phase timed on `self.clock`."""
        clock, c = self.clock, self.config
        try:
            enable_compile_cache(c.compile_cache_dir)
            programs = CompileCount()
            if self.model is None:
                with clock.phase("weight_load"):
                    self.model = load_model(c.model, c.weights, c.loop, c.matmul_impl)
                log.info("loaded %s", self.model.source)
            with clock.phase("arena_alloc"):
                self.engine = self._engine_factory(self.model, c)
            if self._before_warmup is not None:
                self._before_warmup()
            for name, run in self.engine.warmup_steps():
                with clock.phase(f"compile_{name}"):
                    run()
                    jax.block_until_ready(self.engine.arena)
            compiled, cached = programs.delta()
            self.metrics.startup_programs.labels("compiled").set(compiled)
            self.metrics.startup_programs.labels("cache").set(cached)
            log.info("start-up programs: %d compiled, %d read from the persistent compilation cache", compiled, cached)
            tok = self.model.tokenizer
            scheduler = Scheduler(self.engine, continuous=c.continuous, max_queue=c.max_queue,
                                  terminal_ids=tok.terminal_ids if tok is not None else frozenset(),
                                  metrics=self.metrics)
            with self._lock:
                if self._stopped:  # shut down while loading
                    return
                scheduler.start()
                self.scheduler = scheduler
            clock.record("ready", clock.since_start())
            self.ready.set()
            log.info("ready: %d lanes x %d positions, continuous=%s", c.lanes, c.max_seq, c.continuous)
        except Exception as e:
            start_failed(self, e)

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """Stop admitting: from now on /generate answers 503 and /ready 503."""
        self._draining = True

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """Stop admitting, let in-flight jobs finish for up to timeout_s (default drain_s), stop the decode thread.

        Idempotent. Returns True if nothing had to be failed.
        """
        self.begin_drain()
        with self._lock:
            self._stopped = True
            scheduler = self.scheduler
        if scheduler is None:
            return True
        return scheduler.drain(self.config.drain_s if timeout_s is None else timeout_s)

    @property
    def eos_ids(self) -> frozenset[int]:
        tok = self.model.tokenizer if self.model is not None else None
        return frozenset(tok.eos_ids) if tok is not None else frozenset()


def local_engine(model: LoadedModel, c: StationConfig) -> Engine:
    """The station's own engine, once its arena is known to fit, with the arena allocated."""
    check_memory(model.cfg, c, weights_resident=True)
    engine = Engine(model, lanes=c.lanes, max_seq=c.max_seq, chunk=c.prefill_chunk, block=c.kv_block,
                    attention=c.attention_for(model.cfg), widths=c.decode_widths)
    jax.block_until_ready(engine.arena)
    return engine


def start_failed(station: Any, error: Exception) -> None:
    """A Station's or MeshStation's loading thread failed: log it, keep the message for /health and /ready, and
    tell the server."""
    log.exception("station failed to start")
    station.load_error = f"{type(error).__name__}: {error}"
    if station.on_load_failed is not None:
        station.on_load_failed()


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field, self.headers = status, message, field, headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "field": self.field}}, self.status,
                            headers=self.headers)


# ---- request parsing ---------------------------------------------------------------------------------------------
def _token_list(body: dict, field: str, vocab: int, *, allow_empty: bool) -> list[int]:
    value = body[field]
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise ApiError(422, f"{field} must be a list of integers", field)
    if not value and not allow_empty:
        raise ApiError(422, f"{field} must not be empty", field)
    for t in value:
        if not 0 <= t < vocab:
            raise ApiError(422, f"{field} holds token id {t}, outside the vocabulary [0, {vocab})", field)
    return value


def parse_generate(body: Any, vocab: int, max_request_tokens: int, eos_ids: frozenset[int],
                   reuse_prefix: Callable[[bool], bool]) -> Job:
    """Validate a /generate body into a Job, or raise ApiError naming the offending field.

    Limits: token ids in [0, vocab); len(tokens) + max_new_tokens <= max_request_tokens (the station's max_seq).
    reuse_prefix: whether a request with this `resume` flag may start on cached KV (`StationConfig.reuse_prefix`).
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", "body")
    for key in body:
        if key not in _FIELDS:
            raise ApiError(422, f"unknown field {key!r}; fields are {', '.join(_FIELDS)}", key)
    for key in ("tokens", "max_new_tokens"):
        if key not in body:
            raise ApiError(422, f"missing required field {key!r}", key)
    tokens = _token_list(body, "tokens", vocab, allow_empty=False)

    max_new = body["max_new_tokens"]
    if not is_int(max_new):
        raise ApiError(422, "max_new_tokens must be an integer", "max_new_tokens")
    if max_new < 1:
        raise ApiError(422, f"max_new_tokens must be >= 1, got {max_new}", "max_new_tokens")
    if len(tokens) + max_new > max_request_tokens:
        raise ApiError(422, f"prompt ({len(tokens)} tokens) + max_new_tokens ({max_new}) exceeds the station's "
                            f"max_seq of {max_request_tokens}", "max_new_tokens")

    temperature = body.get("temperature", 0.0)
    if temperature is None:
        temperature = 0.0
    if not is_number(temperature):
        raise ApiError(422, "temperature must be a finite number", "temperature")
    if temperature < 0:
        raise ApiError(422, f"temperature must be >= 0, got {temperature}", "temperature")

    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbelow(SEED_LIMIT)
    elif not is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise ApiError(422, f"seed must be null or an integer in [0, 2**32), got {seed!r}", "seed")

    top_k = body.get("top_k")
    if top_k is None:
        top_k = 0
    elif not is_int(top_k):
        raise ApiError(422, "top_k must be null or an integer", "top_k")
    elif top_k < 0:
        raise ApiError(422, f"top_k must be >= 0 (0 is off), got {top_k}", "top_k")

    top_p = body.get("top_p")
    if top_p is None:
        top_p = 1.0
    elif not is_number(top_p):
        raise ApiError(422, "top_p must be null or a number", "top_p")
    elif not 0 < top_p <= 1:
        raise ApiError(422, f"top_p must be in (0, 1], got {top_p}", "top_p")

    stop = (_token_list(body, "stop_token_ids", vocab, allow_empty=True)
            if body.get("stop_token_ids") is not None else [])
    for key in ("terminal_prosody", "resume"):
        if not isinstance(body.get(key, False), bool):
            raise ApiError(422, f"{key} must be a boolean", key)
    return Job(tokens=tokens, max_new_tokens=max_new,
               sampling=SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p), seed=seed),
               stop_ids=eos_ids | frozenset(stop), terminal_prosody=body.get("terminal_prosody", False),
               reuse_prefix=reuse_prefix(body.get("resume", False)))


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved: a cancelled job's Cancelled is expected and nobody awaits it


# ---- app ---------------------------------------------------------------------------------------------------------
def create_app(station: Station) -> Starlette:
    """The Starlette app for `station`. Its lifespan starts the station and drains it on shutdown."""
    metrics: StationMetrics = station.metrics

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
            job = parse_generate(body, station.model.cfg.vocab_size, station.config.max_request_tokens,
                                 station.eos_ids, station.config.reuse_prefix)
            future = scheduler.submit(job)
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

    async def metrics_route(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        station.start()
        yield
        await asyncio.to_thread(station.shutdown)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        """Unmatched routes and methods answer in JSON like every other error (OpenAI's shape under /v1)."""
        path, method = request.url.path, request.method
        if exc.status_code == 404:
            message, code = f"no route {method} {path}", "not_found"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message, code = f"{method} is not allowed on {path} (allowed: {allowed})", "method_not_allowed"
        else:
            message, code = exc.detail, None
        if path.startswith("/v1/"):
            return OpenAIError(exc.status_code, message, None, code, headers=exc.headers).response()
        return ApiError(exc.status_code, message, None, headers=exc.headers).response()

    return Starlette(exception_handlers={HTTPException: http_error}, routes=[
        Route("/generate", generate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
    ] + openai_routes(station), lifespan=lifespan,
        middleware=[Middleware(AccessLogMiddleware)] + openai_middleware(station))


# ---- serving -----------------------------------------------------------------------------------------------------
class DrainingServer(uvicorn.Server):
    """uvicorn that drains on SIGTERM/SIGINT: 503 for new requests, in-flight ones finish, then a clean exit 0.

    uvicorn's own handler would stop listening at once and re-raise the signal after shutdown (exit 143); here the
    first signal drains the station (up to drain_s) while the listener answers 503, and only then asks uvicorn to
    stop. A second signal exits at once.
    """

    def __init__(self, config: uvicorn.Config, station: Station) -> None:
        super().__init__(config)
        self.station = station
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drainer is not None:  # second signal: stop now
            self.should_exit = self.force_exit = True
            return
        log.info("received %s: draining for up to %.0f s", signal.Signals(sig).name, self.station.config.drain_s)
        self.station.begin_drain()
        self._drainer = threading.Thread(target=self._drain, name="jaxstation-drain", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        clean = self.station.shutdown()
        log.info("drained %s; stopping", "cleanly" if clean else "with unfinished requests failed")
        self.should_exit = True


def serve(config: StationConfig, app_and_station: tuple[Starlette, Station] | None = None) -> int:
    """Run the station (or a given app and its Station, e.g. a mesh host) on uvicorn until SIGTERM/SIGINT.
    Returns the process exit code."""
    configure_logging(config.log_format)  # before the first line: the start-up clock logs the import phase
    if app_and_station is None:
        station = Station(config, clock=StartupClock.from_process_start())
        app_and_station = create_app(station), station
    app, station = app_and_station
    return run_server(DrainingServer(uvicorn_config(config, app), station), station)


def uvicorn_config(config: StationConfig, app: Starlette) -> uvicorn.Config:
    bind = {"uds": config.uds} if config.uds else {"host": config.host, "port": config.port}
    json_logs = {"log_config": None} if config.log_format == "json" else {}  # uvicorn's lines go to the root logger
    return uvicorn.Config(app, **bind, lifespan="on", log_level="info", timeout_graceful_shutdown=5, access_log=False,
                          **json_logs)


def run_server(server: uvicorn.Server, station: Any) -> int:
    """Serve until told to stop, or until `station` (anything with `on_load_failed` and `load_error`) fails to
    load. Returns the exit code: 0, 1 (failed to load) or 3 (never started, e.g. the port was taken)."""

    def load_failed() -> None:
        server.should_exit = True

    station.on_load_failed = load_failed
    server.run()
    if station.load_error:
        log.error("station failed to start: %s", station.load_error)
        return 1
    return 0 if server.started else 3


def warmup_only(config: StationConfig) -> int:
    """Load and compile every step shape as `serve` would (filling the compilation cache, if set), then exit 0."""
    configure_logging(config.log_format)
    if not config.compile_cache_dir:
        log.warning("no MOONSHINE_COMPILE_CACHE_DIR: the warm-up compiles, but nothing is kept for the next start")
    station = Station(config, clock=StartupClock.from_process_start())
    station._load()
    station.shutdown(0)
    if station.load_error:
        log.error("station failed to start: %s", station.load_error)
        return 1
    return 0
