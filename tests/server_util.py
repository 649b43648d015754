"""Run a station app on a real uvicorn (loopback TCP or a Unix socket) in a thread, and talk to it."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from reply_schema import ReplyCheck
from starlette.applications import Starlette


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` in a background thread: on a pre-bound loopback port, or on the Unix socket `uds`.
    Every reply is checked against the app's OpenAPI document (tests/reply_schema.py); a test whose block ends
    cleanly fails on a reply that does not match."""

    def __init__(self, app: Starlette, uds: str | None = None) -> None:
        self.uds = uds
        self.replies = ReplyCheck(app)
        app = self.replies
        self._sock: socket.socket | None = None
        if uds is None:
            self._sock = socket.socket()
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind(("127.0.0.1", 0))
            self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, uds=uds, lifespan="on", log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        sockets = [self._sock] if self._sock else None
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": sockets}, name="test-uvicorn",
                                        daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        wait_for(lambda: self.server.started, 30, "uvicorn did not start")
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        problems = self.replies.problems()
        if kind is None and problems:
            raise AssertionError("replies that do not match the OpenAPI document:\n" + "\n".join(problems[:20]))

    @property
    def address(self) -> tuple[str, int] | str:
        return self.uds if self.uds else ("127.0.0.1", self.port)

    def client(self, timeout: float = 60.0) -> httpx.Client:
        if self.uds:
            return httpx.Client(transport=httpx.HTTPTransport(uds=self.uds), base_url="http://station",
                                timeout=timeout)
        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=timeout)


def wait_for(predicate: Callable[[], object], timeout: float, message: str, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} within {timeout} s")
        time.sleep(interval)


def raw_post(address: tuple[str, int] | str, path: str, body: bytes) -> socket.socket:
    """Send one POST on a fresh socket and return the socket unread (close it to disconnect mid-request)."""
    sock = socket.socket(socket.AF_UNIX if isinstance(address, str) else socket.AF_INET)
    sock.connect(address)
    head = (f"POST {path} HTTP/1.1\r\nHost: station\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


@contextlib.contextmanager
def queue_held_full(station, server: ServerThread) -> Iterator[None]:
    """With a serialize-all station of max_queue=1: hold its lane and its one queue slot with two long raw requests,
    then release both on exit and wait until the station is idle again."""
    long = json.dumps({"tokens": [1, 2, 3], "max_new_tokens": 400}).encode()
    running = raw_post(server.address, "/generate", long)
    wait_for(lambda: station.scheduler.busy_lanes == 1, 10, "the first request did not start")
    queued = raw_post(server.address, "/generate", long)
    try:
        wait_for(lambda: len(station.scheduler.pending) == 1, 10, "the second request was not queued")
        yield
    finally:
        running.close()
        queued.close()
    wait_for(lambda: station.scheduler.busy_lanes == 0 and not station.scheduler.pending, 10, "lanes not freed")


def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample's value from a Prometheus exposition (0.0 if absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels is None or sample.labels == labels):
                return sample.value
    return 0.0


@contextlib.contextmanager
def station_process(cmd: Sequence[str], port: int, log_path: Path, ready_timeout: float, **popen_kw
                    ) -> Iterator[tuple[subprocess.Popen, httpx.Client]]:
    """Start a station process, wait until /ready on `port` answers 200, and yield (process, client). Afterwards the
    process is killed if it still runs and the tail of its log is printed."""
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, **popen_kw)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                def ready() -> bool:
                    assert proc.poll() is None, "the server exited early"
                    try:
                        return client.get("/ready").status_code == 200
                    except httpx.TransportError:
                        return False

                wait_for(ready, ready_timeout, f"the server did not turn ready on port {port}", 0.25)
                yield proc, client
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.seek(0)
            print(log.read()[-3000:])
