"""The host's side of the mesh wire: one keep-alive client per station, the check that a set of stations serves the
host's model exactly (layers covered once, same fingerprint, lanes and dtype), and the errors a host raises."""

from __future__ import annotations

import collections
import dataclasses
import socket
import time
from collections.abc import Sequence
from typing import Any

import httpx
import jax.numpy as jnp
import numpy as np

from jaxstation.config.plan import Plan
from jaxstation.config.settings import StationConfig
from jaxstation.engine.jobs import UpstreamFailed
from jaxstation.group.payload import CONTENT_TYPE, PayloadError, decode, encode
from jaxstation.model.choices import LayerRange
from jaxstation.model.config import ModelConfig
from jaxstation.model.layers import compute_dtype

RETRY_S = 0.25  # between probes of a lost station


class MeshError(UpstreamFailed):
    """The mesh cannot serve as configured; the message names the station. Answered as 502 Bad Gateway."""


class StationDown(MeshError):
    """A station stopped answering and did not come back within mesh_recover_s."""


class StationLost(Exception):
    """A hop failed in a way a restart of the station can fix (refused, reset, timed out, 5xx, new epoch)."""

    def __init__(self, station: StationClient, reason: str) -> None:
        super().__init__(f"{station.name}: {reason}")
        self.station, self.reason = station, reason


@dataclasses.dataclass(frozen=True)
class Hop:
    """One request to one station, as the bench reads them."""

    station: int
    path: str
    wave: str  # "prefill" | "decode"
    ms: float  # wall time at the host
    compute_ms: float  # the station's own time in the step
    sent: int  # body bytes each way
    received: int


class StationClient:
    """One station: a keep-alive httpx client with TCP_NODELAY, the station's /info and the epoch last seen."""

    def __init__(self, index: int, url: str, token: str | None, timeout_s: float) -> None:
        self.index, self.url = index, url
        transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url, transport=transport, timeout=timeout_s, headers=headers)
        self.info: dict[str, Any] = {}
        self.epoch: str | None = None
        self.hops: collections.deque[Hop] = collections.deque(maxlen=100_000)

    @property
    def name(self) -> str:
        layers = self.info.get("layers")
        return f"station {self.url}" + (f" (layers {layers})" if layers else "")

    def _check(self, r: httpx.Response, what: str) -> None:
        if r.status_code == 200:
            return
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        if r.status_code >= 500:
            raise StationLost(self, f"{what}: HTTP {r.status_code}: {message}")
        raise MeshError(f"{self.name} refused {what}: HTTP {r.status_code}: {message}")

    def get_info(self) -> dict[str, Any]:
        try:
            r = self.http.get("/info")
        except httpx.TransportError as e:
            raise StationLost(self, f"unreachable: {type(e).__name__}: {e}") from None
        self._check(r, "/info")
        return r.json()

    def post(self, path: str, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        body = encode(meta, arrays)
        t0 = time.perf_counter()
        try:
            r = self.http.post(path, content=body, headers={"Content-Type": CONTENT_TYPE})
        except httpx.TransportError as e:
            raise StationLost(self, f"{path}: {type(e).__name__}: {e}") from None
        self._check(r, path)
        ms = (time.perf_counter() - t0) * 1e3
        try:
            reply, out = decode(r.content)
        except PayloadError as e:
            raise MeshError(f"{self.name} sent an unreadable {path} reply: {e}") from None
        if reply.get("epoch") != self.epoch:
            raise StationLost(self, "restarted (its epoch changed), so its KV is gone")
        self.hops.append(Hop(self.index, path, meta["wave"], ms, float(reply.get("compute_ms", 0.0)), len(body),
                             len(r.content)))
        return out

    def close(self) -> None:
        self.http.close()


def describe_field(info: dict[str, Any], name: str) -> str:
    return f"{name}={info.get(name)!r}"


def check_mesh(clients: Sequence[StationClient], config: StationConfig, plan: Plan, cfg: ModelConfig,
               model_fp: str) -> None:
    """Refuse a mesh that cannot serve the host's model, as the host's plan runs it, exactly: raises MeshError naming
    the station."""
    want = {"lanes": config.lanes, "max_seq": config.max_seq, "chunk": config.prefill_chunk,
            "block": config.kv_block, "dtype": jnp.dtype(compute_dtype(plan.dtype)).name, "weights": plan.dtype,
            "layer_loop": plan.layer_loop, "attention": plan.attention, "total_layers": cfg.num_layers}
    for c in clients:
        if not c.info.get("auth") and not config.insecure_mesh:
            raise MeshError(f"{c.name} takes requests without a token; give it MOONSHINE_MESH_TOKEN, or start the "
                            f"host with --insecure-mesh on a trusted network")
        if c.info.get("fingerprint") != model_fp:
            raise MeshError(f"{c.name} serves a different model: fingerprint {c.info.get('fingerprint')}, the "
                            f"host's model is {model_fp}")
        for key, value in want.items():
            if c.info.get(key) != value:
                raise MeshError(f"{c.name} has {describe_field(c.info, key)} but the host has {key}={value!r}")
    covered = 0
    for c in sorted(clients, key=lambda c: LayerRange.parse(c.info["layers"]).start):
        r = LayerRange.parse(c.info["layers"])
        if r.start > covered:
            raise MeshError(f"layer gap: no station holds layers {covered}:{r.start} (the next is {c.name})")
        if r.start < covered:
            raise MeshError(f"layer overlap: {c.name} holds layers {r.start}:{min(covered, r.stop)} again")
        covered = r.stop
    if covered < cfg.num_layers:
        raise MeshError(f"layer gap: no station holds layers {covered}:{cfg.num_layers}")


def wait_info(c: StationClient, deadline: float, budget_s: float) -> dict[str, Any]:
    """The station's /info once it answers, polling until `deadline`; StationDown past it, MeshError on a 4xx."""
    while True:
        try:
            return c.get_info()
        except StationLost as e:
            if time.monotonic() >= deadline:
                raise StationDown(f"{c.name} is down ({e.reason}) and did not come back within {budget_s:g} s "
                                  f"(MOONSHINE_MESH_RECOVER_S)") from None
        time.sleep(RETRY_S)
