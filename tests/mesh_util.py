"""Mesh stations as real processes on loopback ports, for the mesh tests and the mesh bench."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from server_util import free_port

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-mesh-token"
# The mesh tests' station shape: the session engine's (conftest.ENGINE_SHAPE), so that the local references run its
# compiled programs, and the in-process stages of the same splits read the stations' programs from the run's cache.
# Every other setting is the station's default. A shape may name a layer_loop (a model of its own).
SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}


class StationProcess:
    """`jaxstation station --layers A:B` in a subprocess that imports this checkout."""

    def __init__(self, layers: str, *, port: int | None = None, token: str | None = TOKEN,
                 extra: tuple[str, ...] = (), shape: dict[str, int] | None = None) -> None:
        self.layers, self.port, self.token, self.extra = layers, port or free_port(), token, extra
        self.shape = shape or SHAPE
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> StationProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "JAX_PLATFORMS": "cpu"}
        env.pop("MOONSHINE_MESH_TOKEN", None)
        if self.token:
            env["MOONSHINE_MESH_TOKEN"] = self.token
        args = [sys.executable, "-m", "jaxstation", "station", "--layers", self.layers, "--port", str(self.port),
                "--lanes", str(self.shape["lanes"]), "--max-seq", str(self.shape["max_seq"]),
                "--prefill-chunk", str(self.shape["prefill_chunk"]), "--kv-block", str(self.shape["kv_block"]),
                *(("--layer-loop", self.shape["layer_loop"]) if "layer_loop" in self.shape else ()), *self.extra]
        self.log = tempfile.TemporaryFile()  # not a pipe: a full pipe would block the station
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        return self

    def stderr_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]

    def wait_ready(self, timeout: float = 300.0) -> StationProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"station {self.layers} exited {self.proc.returncode}: {self.stderr_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"station {self.layers} not ready within {timeout} s")

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc is not None:
            self.log.close()


def start_mesh(splits: list[str], **kwargs) -> list[StationProcess]:
    """Start every station (they load in parallel), then wait for all."""
    stations = [StationProcess(s, **kwargs) for s in splits]
    try:
        for s in stations:
            s.start()
        for s in stations:
            s.wait_ready()
    except BaseException:
        for s in stations:
            s.stop()
        raise
    return stations
