"""Several processes, one station: multi-controller JAX over `jax.distributed`, every process running the same steps.

A group of P processes (one a machine, or one a GPU) splits one model over every process's devices (model/sharding.py:
`--tensor-parallel` is the group's device count). Multi-controller JAX needs every process to launch the same
compiled programs, with the same inputs, in the same order. So process 0, the leader, serves HTTP and runs the
scheduler, and its engine is a `LeaderEngine`: each call that runs a step (`CALLS`: begin, prefill, decode, pack,
verify, reset) is first sent to every other process, then run; an engine method neither in `CALLS` nor in `LOCAL`
(those that run nothing on the devices) is refused, so a new step method cannot run on the leader alone. The others,
the followers, load the same model, warm up through the same function as the leader's station (`station.warm_up`),
then run each call they receive and nothing else; they answer /health and /ready for their own probes.

The calls travel over one TCP connection a follower opens to the leader (the coordinator's host, its port + 1), as
length-prefixed `group.payload` payloads: the arrays as raw buffers with their dtype and shape, the rest as JSON that
may build only the engine's row types, tuples, frozensets and plain values. Nothing on the wire names a module, so
processes on different NumPy lines read each other. Both ends send a heartbeat every HEARTBEAT_S.
Multi-controller JAX does not survive a lost process, so a peer whose connection closes, or that is silent for
LOST_S, ends the group: the leader fails the requests in flight (503) and exits 1 naming the lost process, a follower
that loses the leader exits 1, and the launcher restarts the group.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from jaxstation.config.coldstart import enable_compile_cache
from jaxstation.config.plan import Plan, load_planned, startup_plan
from jaxstation.config.settings import ConfigError, StationConfig
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, PromptPiece, SamplingParams
from jaxstation.group.payload import PayloadError, decode, encode
from jaxstation.model.loader import LoadedModel
from jaxstation.server.access_log import configure_logging
from jaxstation.server.station import local_engine, warm_up

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # each end says it is alive this often
LOST_S = 10.0  # a peer silent this long is lost
CONNECT_S = 300.0  # how long the leader waits for every follower to connect (they load and compile first)
CALLS = ("begin", "prefill", "prefill_scored", "decode", "verify", "pack", "reset")  # what runs a step
# run no step for a request: each process warms up alone; LoRA adapters (written by write_lora) are refused on a
# model split over devices, so a group never holds one; and the prefix cache's host tier (save_prefix, save_window,
# restore_prefix) is off where the arena is split (engine/prefix_tier.py, tier_refusal)
LOCAL = ("turn_rows", "reuse_floor", "warmup_steps", "warmup", "write_lora", "save_prefix", "save_window",
         "restore_prefix")
_ROWS = {t.__name__: t for t in (DecodeRow, SamplingParams, PromptPiece)}  # what a step call may build


@dataclasses.dataclass(frozen=True)
class Group:
    """Where this process stands in its group: the coordinator's address, how many processes, which one this is."""

    coordinator: str  # host:port of the JAX coordinator, which process 0 runs
    processes: int
    process_id: int

    @property
    def leader(self) -> bool:
        return self.process_id == 0

    @property
    def step_address(self) -> tuple[str, int]:
        """Where the leader takes its followers' connections: the coordinator's host, its port + 1."""
        host, port = self.coordinator.rsplit(":", 1)
        return host, int(port) + 1


def process_group(config: StationConfig, env: Mapping[str, str] | None = None) -> Group | None:
    """The group `config` asks for, or None for a station of one process. Where the settings leave a field unset,
    the variables of the launchers that start such groups fill it: a GKE LeaderWorkerSet's (LWS_LEADER_ADDRESS,
    LWS_GROUP_SIZE, LWS_WORKER_INDEX) and an Indexed Job's (JOB_COMPLETION_INDEX)."""
    env = os.environ if env is None else env
    processes = config.num_processes or _int(env, "LWS_GROUP_SIZE") or 1
    if processes == 1:
        return None
    process_id = config.process_id
    if process_id is None:
        process_id = _int(env, "LWS_WORKER_INDEX", _int(env, "JOB_COMPLETION_INDEX"))
    coordinator = config.coordinator_address or (f"{env['LWS_LEADER_ADDRESS']}:{DEFAULT_PORT}"
                                                 if env.get("LWS_LEADER_ADDRESS") else None)
    if coordinator is None or process_id is None:
        raise ConfigError(f"a group of {processes} processes needs {config.named('coordinator_address')} and "
                          f"{config.named('process_id')} (or a launcher's LWS_LEADER_ADDRESS and LWS_WORKER_INDEX)")
    if not 0 <= process_id < processes:
        raise ConfigError(f"{config.named('process_id')}={process_id} must lie in [0, {processes})")
    if ":" not in coordinator:
        raise ConfigError(f"{config.named('coordinator_address')}={coordinator!r} must be host:port")
    return Group(coordinator, processes, process_id)


DEFAULT_PORT = 8476  # the coordinator's port where a launcher gives only the leader's host


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def initialize(group: Group, config: StationConfig) -> None:
    """Join the group (`jax.distributed.initialize`, CPU collectives over gloo) and check that the model is split
    over every process's devices."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(group.coordinator, group.processes, group.process_id,
                               heartbeat_timeout_seconds=int(3 * LOST_S))
    devices = len(jax.devices())
    if config.tensor_parallel != devices:
        raise ConfigError(f"{config.named('tensor_parallel')}={config.tensor_parallel}: a group splits the model over "
                          f"every process's devices, here {group.processes} processes with {devices} devices")


# ---- the wire ---------------------------------------------------------------------------------------------------
def _plain(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    """`value` as JSON, its arrays moved to `arrays` (named a0, a1, ...) and referred to by name."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.ndarray):
        name = f"a{len(arrays)}"
        arrays[name] = value
        return {"array": name}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [_plain(v, arrays) for v in value]
    if isinstance(value, tuple | frozenset):
        return {type(value).__name__: [_plain(v, arrays) for v in value]}
    if isinstance(value, dict):
        return {"dict": {k: _plain(v, arrays) for k, v in value.items()}}
    if _ROWS.get(type(value).__name__) is type(value):
        return {"row": type(value).__name__,
                "fields": {f.name: _plain(getattr(value, f.name), arrays) for f in dataclasses.fields(value)}}
    raise PayloadError("call", f"a step call may not hold {type(value).__name__}")


def _value(plain: Any, arrays: dict[str, np.ndarray]) -> Any:
    """The inverse of `_plain`; PayloadError for anything it would not have written."""
    if isinstance(plain, list):
        return [_value(v, arrays) for v in plain]
    if not isinstance(plain, dict):
        return plain
    if len(plain) == 1 and "array" in plain and plain["array"] in arrays:
        return np.array(arrays[plain["array"]])  # a writable copy, off the received bytes
    if len(plain) == 1 and ("tuple" in plain or "frozenset" in plain) and isinstance(items := [*plain.values()][0],
                                                                                    list):
        return (tuple if "tuple" in plain else frozenset)(_value(v, arrays) for v in items)
    if len(plain) == 1 and isinstance(plain.get("dict"), dict):
        return {k: _value(v, arrays) for k, v in plain["dict"].items()}
    if set(plain) == {"row", "fields"} and plain["row"] in _ROWS and isinstance(plain["fields"], dict):
        return _ROWS[plain["row"]](**{k: _value(v, arrays) for k, v in plain["fields"].items()})
    raise PayloadError("call", f"a step call may not hold {json.dumps(plain)[:80]}")


def send(sock: socket.socket, message: object) -> None:
    arrays: dict[str, np.ndarray] = {}
    data = encode({"message": _plain(message, arrays)}, arrays)
    sock.sendall(struct.pack("!I", len(data)) + data)


def receive(sock: socket.socket) -> object:
    """The next message; ConnectionError when the peer closed, TimeoutError when it was silent for the timeout,
    PayloadError for a payload that is not a step call, a heartbeat or a process id."""
    (n,) = struct.unpack("!I", _exactly(sock, 4))
    meta, arrays = decode(_exactly(sock, n))
    if set(meta) != {"message"}:
        raise PayloadError("meta", "must hold exactly 'message'")
    try:
        return _value(meta["message"], arrays)
    except TypeError as e:  # a row's fields that do not fit it
        raise PayloadError("call", str(e)) from None


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the connection closed")
        buf += chunk
    return bytes(buf)


def _why(error: Exception) -> str:
    """What a failed receive says of its peer."""
    if isinstance(error, TimeoutError):
        return f"silent for {LOST_S:.0f} s"
    if isinstance(error, ConnectionError):
        return "its connection closed"
    return f"{type(error).__name__}: {error}"


def lost(who: str, reason: str) -> None:
    """A peer is gone: say which, and end this process (its collectives would wait for the peer forever)."""
    log.error("%s lost (%s): multi-controller JAX cannot go on without it; exiting", who, reason)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(1)


def _beat(sock: socket.socket, lock: threading.Lock, on_fail: Callable[[str], None]) -> None:
    """Send a heartbeat every HEARTBEAT_S until the connection fails; then `on_fail(why)`."""
    while True:
        time.sleep(HEARTBEAT_S)
        try:
            with lock:
                send(sock, "beat")
        except OSError as e:
            return on_fail(_why(e))


# ---- the leader -------------------------------------------------------------------------------------------------
class Leader:
    """Process 0's end: takes every follower's connection, watches each, and sends each step call to all."""

    def __init__(self, group: Group, on_lost: Callable[[], None] | None = None) -> None:
        self.group = group
        self.on_lost = on_lost  # fails the requests in flight before the process exits
        self.followers: dict[int, socket.socket] = {}
        self.lock = threading.Lock()
        self.connected = threading.Event()
        self.failing = threading.Lock()  # held by the thread that ends the group
        self.server = socket.create_server(("", group.step_address[1]))  # every interface, as the coordinator
        threading.Thread(target=self._accept, name="jaxstation-group-accept", daemon=True).start()

    def _accept(self) -> None:
        while len(self.followers) < self.group.processes - 1:
            conn, peer = self.server.accept()
            conn.settimeout(LOST_S)
            try:
                process_id = receive(conn)
            except (OSError, PayloadError, struct.error) as e:
                process_id = f"nothing readable ({_why(e)})"
            expected = set(range(1, self.group.processes)) - set(self.followers)
            if not isinstance(process_id, int) or process_id not in expected:
                log.warning("group: %s:%d said it is process %s; closing that connection", *peer[:2], process_id)
                conn.close()
                continue
            with self.lock:
                self.followers[process_id] = conn
            log.info("group: process %d connected", process_id)
            threading.Thread(target=self._watch, args=(process_id, conn), daemon=True).start()
            on_fail = functools.partial(self.fail, f"process {process_id}")
            threading.Thread(target=_beat, args=(conn, self.lock, on_fail), daemon=True).start()
        self.connected.set()

    def _watch(self, process_id: int, conn: socket.socket) -> None:
        try:
            while True:
                receive(conn)  # heartbeats
        except (OSError, PayloadError, struct.error) as e:
            self.fail(f"process {process_id}", _why(e))

    def fail(self, who: str, reason: str) -> None:
        """A follower is lost: fail the requests in flight, say which process, exit. The first to notice does it."""
        if not self.failing.acquire(blocking=False):
            return
        log.error("%s lost (%s): failing the requests in flight", who, reason)
        if self.on_lost is not None:
            self.on_lost()
            time.sleep(0.5)  # the failed requests' answers go out
        lost(who, reason)

    def engine_factory(self, model: LoadedModel, config: StationConfig, plan: Plan) -> LeaderEngine:
        """The leader station's engine: the local one, its step calls sent to every follower too."""
        return LeaderEngine(local_engine(model, config, plan), self)

    def call(self, name: str, args: tuple, kwargs: dict) -> None:
        if not self.connected.wait(CONNECT_S):
            missing = sorted(set(range(1, self.group.processes)) - set(self.followers))
            self.fail(f"process {missing[0]}", f"not connected within {CONNECT_S:.0f} s")
        with self.lock:
            for process_id, conn in self.followers.items():
                try:
                    send(conn, (name, args, kwargs))
                except OSError as e:
                    threading.Thread(target=self.fail, args=(f"process {process_id}", _why(e))).start()


class LeaderEngine:
    """An Engine whose step calls also run on every follower: sent first, then run here."""

    def __init__(self, engine: Engine, leader: Leader) -> None:
        self._engine, self._leader = engine, leader

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engine, name)
        if name not in CALLS:
            if callable(attr) and name not in LOCAL:
                raise AttributeError(f"{name!r} is neither a step call the followers run too (CALLS) nor a method "
                                     "that runs no step (LOCAL): list it in one of them")
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._leader.call(name, args, kwargs)
            return attr(*args, **kwargs)

        return call


# ---- a follower -------------------------------------------------------------------------------------------------
def serve_follower(config: StationConfig, group: Group) -> int:
    """A follower process: plan, load and build the engine as the leader's station does, answer probes, follow."""
    configure_logging(config.log_format)
    enable_compile_cache(config.compile_cache_dir)
    ready = threading.Event()
    probes(config, group, ready)
    plan = startup_plan(config)
    engine = local_engine(load_planned(config, plan), config, plan)
    follow(engine, group, ready)
    return 1


def follow(engine: Engine, group: Group, ready: threading.Event) -> None:
    """Warm up as the leader's station does, connect to the leader, then run each call it sends, until it is lost."""
    warm_up(engine)
    conn = _connect(group)
    lock = threading.Lock()
    with lock:
        send(conn, group.process_id)
    on_fail = functools.partial(lost, "process 0 (the leader)")
    threading.Thread(target=_beat, args=(conn, lock, on_fail), daemon=True).start()
    ready.set()
    log.info("group: process %d ready, following process 0", group.process_id)
    while True:
        try:
            message = receive(conn)
        except (OSError, PayloadError, struct.error) as e:
            lost("process 0 (the leader)", _why(e))
        if message != "beat":
            name, args, kwargs = message
            if name not in CALLS:
                lost("process 0 (the leader)", f"it sent an unknown call {name!r}")
            getattr(engine, name)(*args, **kwargs)


def _connect(group: Group) -> socket.socket:
    deadline = time.monotonic() + CONNECT_S
    while True:
        try:
            conn = socket.create_connection(group.step_address, timeout=LOST_S)
            conn.settimeout(LOST_S)
            return conn
        except OSError as e:
            if time.monotonic() > deadline:
                lost("process 0 (the leader)", f"cannot connect to {group.step_address}: {e}")
            time.sleep(0.2)


def probes(config: StationConfig, group: Group, ready: threading.Event) -> ThreadingHTTPServer:
    """A follower's /health (200 while it runs) and /ready (200 once it follows the leader) on its own port."""

    class Probe(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            status = {"/health": 200, "/ready": 200 if ready.is_set() else 503}.get(self.path.split("?")[0])
            if status is None:
                return self.do_POST()
            self.answer(status, {"status": "ok" if status == 200 else "not ready", "process_id": group.process_id,
                                 "role": "follower"})

        def do_POST(self) -> None:  # noqa: N802
            self.answer(404, {"error": {"message": f"process {group.process_id} of a group serves only /health and "
                                                   "/ready: send requests to process 0", "type": "not_found"}})

        def answer(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((config.host, config.port), Probe)
    threading.Thread(target=server.serve_forever, name="jaxstation-probes", daemon=True).start()
    return server
