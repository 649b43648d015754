"""Serving a station's app on uvicorn, over TCP or a Unix socket, draining on SIGTERM.

`serve` runs uvicorn until SIGTERM/SIGINT: the first signal drains the station (new requests get 503 while in-flight
ones finish, up to `drain_s`), then the process exits 0. `warmup_only` loads and compiles as `serve` would, then exits.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette

from jaxstation.config.coldstart import StartupClock
from jaxstation.config.settings import StationConfig
from jaxstation.server.access_log import configure_logging
from jaxstation.server.station import Station

log = logging.getLogger(__name__)


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


def serve(config: StationConfig, make_app: Callable[[StationConfig], tuple[Starlette, Station]]) -> int:
    """Run the app and Station that `make_app` builds (a station's, or a mesh host's) on uvicorn until SIGTERM/SIGINT.
    Returns the process exit code."""
    configure_logging(config.log_format)  # before the first line: the start-up clock logs the import phase
    app, station = make_app(config)
    return run_server(DrainingServer(uvicorn_config(config, app), station), station)


def uvicorn_config(config: StationConfig, app: Starlette) -> uvicorn.Config:
    bind = {"uds": config.uds} if config.uds else {"host": config.host, "port": config.port}
    json_logs = {"log_config": None} if config.log_format == "json" else {}  # uvicorn's lines go to the root logger
    return uvicorn.Config(app, **bind, lifespan="on", log_level="info", timeout_graceful_shutdown=5, access_log=False,
                          **json_logs)


def run_server(server: uvicorn.Server, station: Any) -> int:
    """Serve until told to stop, or until `station` (anything with `on_load_failed`, `load_error` and `loading`)
    fails to load. Returns the exit code: 0, 1 (failed to load) or 3 (never started, e.g. the port was taken).

    Stopped while the station still loads, the process exits at once with that code: the loading thread may be
    inside XLA's compiler, which cannot be interrupted, and letting the interpreter finalize around it aborts."""

    def load_failed() -> None:
        server.should_exit = True

    station.on_load_failed = load_failed
    server.run()
    if station.load_error:
        log.error("station failed to start: %s", station.load_error)
        code = 1
    else:
        code = 0 if server.started else 3
    if station.loading:
        log.info("stopped while loading; exiting %d", code)
        logging.shutdown()  # flush every handler and stream: os._exit skips the interpreter's own shutdown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


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
