"""Tensor parallelism (model/sharding.py, docs/sharding.md): a model split over 2 and 4 virtual CPU devices computes
the logits of one device within a tolerance and the same greedy tokens, and a request's bits beside 1, 3 and 7 others
equal its bits alone, every family, float32 and int8; the plan and the memory check refuse what cannot split.

The split runs in one process of its own with 4 CPU devices (tests/sharded_run.py): JAX fixes the device count when
it starts, and the rest of the suite keeps one device.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, TESTS
from server_util import free_port
from sharded_run import PROMPT

from jaxstation.config.memory import check_memory, weight_bytes
from jaxstation.config.plan import resolve_plan
from jaxstation.config.settings import ConfigError, GiB, StationConfig, resolve
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, PromptPiece, SamplingParams
from jaxstation.group.payload import PayloadError, encode
from jaxstation.group.process_group import CALLS, LOCAL, Group, LeaderEngine, process_group, receive, send
from jaxstation.model.layers import projection_shapes
from jaxstation.model.loader import checkpoint_config, hf_config
from jaxstation.model.shapes import ARCHITECTURES
from jaxstation.model.sharding import indivisible, kv_replicas, natural_order, replicated_kv, shard_major, split_fused

# every family once, float32 and int8: over 2 devices (the fixtures' 2 KV heads), as a station plans and loads them;
# over 4, a fixture's family with 8 heads and 4 KV heads and seeded random weights, and Gemma 3's 2 KV heads each
# kept twice (fewer KV heads than devices)
CASES = ("tiny-qwen2:int8:2", "tiny-qwen3:float32:2", "tiny-gemma2:int8:2", "tiny-gemma3:float32:2",
         "wide-tiny-llama3:float32:4", "wide-tiny-mistral:int8:4", "tiny-gemma3:float32:4")
STAGE = "stage:tiny-qwen2:int8:2"  # a mesh station split over 2 devices
LOAD = "load:tiny-qwen2:float32:2"  # device 0's bytes while a station loads a model split over 2 devices
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    out = tmp_path_factory.mktemp("sharded") / "runs.npz"
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "4", "PYTHONPATH": str(TESTS.parent)}
    subprocess.run([sys.executable, str(TESTS / "sharded_run.py"), str(out), *CASES, STAGE, LOAD], env=env, check=True,
                   timeout=600)
    with np.load(out) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("case", CASES)
def test_split_logits_match_one_device_and_greedy_tokens_are_equal(sharded: dict, case: str) -> None:
    n = case.rsplit(":", 1)[1]
    one, split = sharded[f"{case}/1:0:logits"], sharded[f"{case}/{n}:0:logits"]
    assert one.shape == split.shape == (7, 256)
    err = float(np.abs(one - split).max())
    assert err <= TOLERANCE, f"{case}: max |logit(N={n}) - logit(N=1)| {err}"
    assert sharded[f"{case}/{n}:0:tokens"].tolist() == sharded[f"{case}/1:0:tokens"].tolist()


@pytest.mark.parametrize("case", CASES)
def test_a_split_request_has_the_same_bits_beside_1_3_and_7_others(sharded: dict, case: str) -> None:
    n = case.rsplit(":", 1)[1]
    alone = sharded[f"{case}/{n}:0:logits"]
    for k in (1, 3, 7):
        beside = sharded[f"{case}/{n}:{k}:logits"]
        assert np.array_equal(alone.view(np.uint32), beside.view(np.uint32)), f"{case}: beside {k} others"
        assert sharded[f"{case}/{n}:{k}:tokens"].tolist() == sharded[f"{case}/{n}:0:tokens"].tolist()


@pytest.mark.parametrize("case", CASES)
def test_the_arena_is_split_by_kv_heads(sharded: dict, case: str) -> None:
    n = case.rsplit(":", 1)[1]
    assert str(sharded[f"{case}/{n}:arena_spec"]) == "P(None, None, None, 'tp')"


def test_a_split_mesh_station_serves_the_same_model_within_the_tolerance(sharded: dict) -> None:
    assert str(sharded[f"{STAGE}/1:fingerprint"]) == str(sharded[f"{STAGE}/2:fingerprint"])
    one, split = sharded[f"{STAGE}/1:residuals"], sharded[f"{STAGE}/2:residuals"]
    assert one.shape == split.shape == (1, 16, 64)
    assert float(np.abs(one - split).max()) <= TOLERANCE
    assert str(sharded[f"{STAGE}/2:arena_spec"]) == "P(None, None, None, 'tp')"


def test_each_device_holds_its_share_of_the_weights_as_the_memory_check_counts(sharded: dict) -> None:
    cfg = dataclasses.replace(hf_config(FIXTURES / "tiny-llama3" / "config.json"), num_heads=8,
                              num_kv_heads=4)
    whole, quarter = (int(sharded[f"wide-tiny-llama3:float32:4/{n}:device_bytes"]) for n in (1, 4))
    assert whole == weight_bytes(cfg, "float32") and quarter == weight_bytes(cfg, "float32", 4)
    assert quarter < 0.26 * whole  # every matrix is split, the embedding and the head too; the norms are whole


def test_a_split_load_never_holds_more_than_a_share_and_one_matrix_on_device_0(sharded: dict) -> None:
    """Each weight goes from host memory straight onto its shards: device 0 never holds the whole model, which
    the memory check (counting 1/N a device) would not have room for."""
    cfg = checkpoint_config(FIXTURES / "tiny-qwen2")
    share = weight_bytes(cfg, "float32", 2)
    matrix = 4 * max(cfg.vocab_size * cfg.hidden_size, *(i * o for i, o in projection_shapes(cfg)))
    assert int(sharded[f"{LOAD}/device_bytes"]) < share + matrix / 8  # its share once loaded (and the qkv biases)
    assert int(sharded[f"{LOAD}/peak"]) <= share + matrix, (int(sharded[f"{LOAD}/peak"]), share, matrix)


def test_fused_columns_laid_out_shard_major_read_back_in_order() -> None:
    sizes, shards = (8, 4, 4), 2
    w = np.arange(3 * 16, dtype=np.float32).reshape(3, 16)  # [in, q | k | v]
    laid = shard_major(w, sizes, shards)
    # each half holds its own q, k and v columns: q[:4] k[:2] v[:2] | q[4:] k[2:] v[2:]
    assert laid[0].tolist() == [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15]
    assert natural_order(laid, sizes, shards).tolist() == w.tolist()
    pieces = split_fused(jnp.asarray(laid), sizes, shards)
    assert [np.asarray(p).tolist() for p in pieces] == [w[:, :8].tolist(), w[:, 8:12].tolist(), w[:, 12:].tolist()]
    assert [np.asarray(p).tolist() for p in split_fused(jnp.asarray(w), sizes, 1)] == [
        np.asarray(p).tolist() for p in pieces]


def test_the_plan_refuses_heads_that_do_not_divide_naming_both_numbers() -> None:
    config = resolve(None, {"MOONSHINE_TENSOR_PARALLEL": "3", "MOONSHINE_MODEL": str(FIXTURES / "tiny-qwen2")})
    with pytest.raises(ConfigError) as e:
        resolve_plan(config, checkpoint_config(config.model))
    assert str(e.value) == "MOONSHINE_TENSOR_PARALLEL=3: the model's attention heads (4) do not divide by 3 devices"


def test_fewer_kv_heads_than_devices_are_kept_once_a_device() -> None:
    cfg = checkpoint_config(FIXTURES / "tiny-qwen2")  # 4 heads, 2 KV heads
    assert [kv_replicas(cfg, n) for n in (1, 2, 4)] == [1, 1, 2]
    assert replicated_kv(cfg, 4).num_kv_heads == 4 and replicated_kv(cfg, 2) == cfg
    assert indivisible(cfg, 4) is None
    assert indivisible(dataclasses.replace(cfg, num_heads=12, num_kv_heads=3), 4) == (
        "the model's KV heads (3) do not divide by 4 devices")


def test_the_plan_refuses_more_devices_than_it_sees() -> None:
    config = StationConfig(model=str(FIXTURES / "tiny-qwen2"), tensor_parallel=2,
                           sources={"tensor_parallel": "--tensor-parallel"})
    with pytest.raises(ConfigError, match=r"^--tensor-parallel=2 needs 2 devices, and 1 cpu device\(s\) are visible "
                                          r"here; on CPU, JAX_NUM_CPU_DEVICES=2"):
        resolve_plan(config, checkpoint_config(config.model))


@pytest.mark.parametrize(("settings", "flag"), [({"matmul": "kernel"}, "MOONSHINE_MATMUL=kernel"),
                                                ({"attention": "kernel"}, "MOONSHINE_ATTENTION=kernel")])
def test_a_split_station_refuses_the_cpu_kernels_and_says_why(monkeypatch, settings: dict, flag: str) -> None:
    monkeypatch.setattr("jax.devices", lambda: [object(), object()])  # the plan counts them; nothing runs on them
    config = StationConfig(model=str(FIXTURES / "tiny-qwen2"), tensor_parallel=2, **settings)
    with pytest.raises(ConfigError) as e:
        resolve_plan(config, checkpoint_config(config.model))
    assert str(e.value).startswith(f"{flag}: MOONSHINE_TENSOR_PARALLEL=2 splits the model over devices with XLA's "
                                   "SPMD partitioner, which cannot split the CPU kernels' custom calls")


def test_auto_settings_of_a_split_station_are_xla_and_full_waves(monkeypatch) -> None:
    monkeypatch.setattr("jax.devices", lambda: [object(), object()])
    config = StationConfig(model=str(FIXTURES / "tiny-qwen2" / "model.gguf"), tensor_parallel=2, lanes=4)
    plan = resolve_plan(config, checkpoint_config(config.model))
    assert (plan.dtype, plan.matmul, plan.attention, plan.wave_widths, plan.prefill_budget, plan.tensor_parallel) == (
        "float32", "xla", "blocked", (4,), 0, 2)
    assert str(plan).endswith(", tensor_parallel 2")


def test_the_memory_check_is_per_device_and_names_the_numbers() -> None:
    cfg = ARCHITECTURES["mistral-7b"]  # bfloat16: 1 MiB of k and v a position and lane, 8 KV heads
    config = StationConfig(lanes=8, max_seq=32768, tensor_parallel=4,
                           sources={"tensor_parallel": "--tensor-parallel"})
    check_memory(cfg, config, "bfloat16", weights_resident=True, available=8 * GiB)  # 32 GiB in all, 8 on each
    with pytest.raises(ConfigError) as e:
        check_memory(cfg, config, "bfloat16", weights_resident=True, available=6 * GiB)
    assert str(e.value) == (
        "the KV arena needs 8.00 GiB on each device (--tensor-parallel=4) (MOONSHINE_BATCH_LANES=8 x "
        "MOONSHINE_MAX_SEQ=32768, 1.00 GiB per lane), but only 6.00 GiB is free on the device. Lower "
        "MOONSHINE_BATCH_LANES (at most 6 lanes fit at this max_seq) or MOONSHINE_MAX_SEQ (at most 24576 positions "
        "fit at 8 lanes)")
    with pytest.raises(ConfigError, match=r"^the KV arena needs 8.00 GiB on each device \(--tensor-parallel=4\) .* "
                                          r"plus 3.38 GiB of weights, but only 11.00 GiB is free on the device"):
        check_memory(cfg, config, "bfloat16", available=11 * GiB)  # 13.5 GiB in all: a quarter of each matrix


# ---- a group of processes -----------------------------------------------------------------------------------------
GROUP_SHAPE = ["--lanes", "8", "--max-seq", "64", "--prefill-chunk", "16", "--kv-block", "16"]  # sharded_run's engine


class GroupProcess:
    """`jaxstation serve` as process `process_id` of a group of two on loopback, one CPU device each."""

    def __init__(self, process_id: int, coordinator: str) -> None:
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
        args = [sys.executable, "-m", "jaxstation", "serve", "--model", str(FIXTURES / "tiny-qwen2"), "--dtype",
                "int8", "--layer-loop", "unroll", *GROUP_SHAPE, "--tensor-parallel", "2", "--coordinator-address",
                coordinator, "--num-processes", "2", "--process-id", str(process_id), "--port", str(self.port)]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=self.log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.stderr()[-2000:]}"
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"not ready within {timeout} s: {self.stderr()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


def free_port_pair() -> int:
    """A port free with the next one too: the coordinator's, and the leader's for its followers (the port + 1), which
    the group binds seconds later. Both lie below the kernel's range of ephemeral ports, so that no connection of the
    run takes one as its local port meanwhile."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768  # Linux's default
    while True:
        port = random.randrange(10000, ephemeral - 1)
        with socket.socket() as first, socket.socket() as second:
            try:
                first.bind(("127.0.0.1", port))
                second.bind(("", port + 1))
            except OSError:  # in use
                continue
            return port


@pytest.fixture(scope="module")
def group() -> Iterator[tuple[GroupProcess, GroupProcess]]:
    """Two processes splitting tiny-qwen2 (int8) over their two CPU devices, with jax.distributed and gloo."""
    coordinator = f"127.0.0.1:{free_port_pair()}"
    procs = (GroupProcess(0, coordinator), GroupProcess(1, coordinator))
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


def test_a_group_of_two_processes_gives_the_tokens_of_one_process_split_alike(sharded: dict, group) -> None:
    leader, follower = group
    assert httpx.get(follower.url + "/ready").json() == {"status": "ok", "process_id": 1, "role": "follower"}
    refused = httpx.post(follower.url + "/generate", json={"tokens": PROMPT, "max_new_tokens": 7})
    assert refused.status_code == 404 and refused.json()["error"]["message"] == (
        "process 1 of a group serves only /health and /ready: send requests to process 0")
    reply = httpx.post(leader.url + "/generate", json={"tokens": PROMPT, "max_new_tokens": 7}, timeout=60).json()
    assert reply["generated"] == sharded["tiny-qwen2:int8:2/2:0:tokens"].tolist()


def test_a_lost_process_ends_the_group_and_fails_the_requests_in_flight(group) -> None:
    leader, follower = group
    body = {"tokens": PROMPT, "max_new_tokens": 50}
    with ThreadPoolExecutor(6) as pool:
        replies = [pool.submit(httpx.post, leader.url + "/generate", json=body, timeout=60) for _ in range(6)]
        wait(replies, return_when=FIRST_COMPLETED)  # one has run; the rest wait for the lane (one request at a time)
        follower.proc.kill()
        statuses = sorted(r.result().status_code for r in replies)
    assert leader.proc.wait(timeout=30) == 1  # LOST_S bounds it; a killed peer's connection closes at once
    assert statuses[0] == 200 and statuses[-1] in (500, 502, 503) and set(statuses) <= {200, 500, 502, 503}
    assert "process 1 lost (its connection closed): multi-controller JAX cannot go on without it; exiting" in (
        leader.stderr())


def test_a_group_reads_its_place_from_the_settings_or_its_launcher() -> None:
    lws = {"LWS_LEADER_ADDRESS": "jaxstation-0.jaxstation", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    group = process_group(StationConfig(tensor_parallel=8), lws)
    assert group == Group("jaxstation-0.jaxstation:8476", 2, 1) and not group.leader
    assert group.step_address == ("jaxstation-0.jaxstation", 8477)
    indexed = resolve(None, {"MOONSHINE_NUM_PROCESSES": "3", "MOONSHINE_COORDINATOR_ADDRESS": "10.0.0.2:9000"})
    assert process_group(indexed, {"JOB_COMPLETION_INDEX": "2"}) == Group("10.0.0.2:9000", 3, 2)
    assert process_group(StationConfig(), {}) is None
    with pytest.raises(ConfigError) as e:
        process_group(StationConfig(num_processes=2, process_id=0), {})
    assert str(e.value) == ("a group of 2 processes needs MOONSHINE_COORDINATOR_ADDRESS and MOONSHINE_PROCESS_ID (or a "
                            "launcher's LWS_LEADER_ADDRESS and LWS_WORKER_INDEX)")
    with pytest.raises(ConfigError, match=r"^MOONSHINE_PROCESS_ID=2 must lie in \[0, 2\)$"):
        process_group(StationConfig(num_processes=2, process_id=2, coordinator_address="h:1"), {})


def test_step_calls_cross_the_wire_whole_and_nothing_else_is_decoded() -> None:
    row = DecodeRow(7, 12, SamplingParams(temperature=0.5, seed=3, logit_bias=((4, 1.5),)), 2,
                    mask=np.array([1, 0, 3], np.uint32))
    a, b = socket.socketpair()
    with a, b:
        send(a, ("decode", ([row, None],), {"return_logits": False}))
        name, args, kwargs = receive(b)
        assert (name, kwargs) == ("decode", {"return_logits": False})
        got = args[0][0]
        assert dataclasses.replace(got, mask=None) == dataclasses.replace(row, mask=None) and args[0][1] is None
        assert got.mask.tolist() == [1, 0, 3] and got.mask.dtype == np.uint32
        a.sendall(struct.pack("!I", len(evil := pickle.dumps(os.system))) + evil)
        with pytest.raises(PayloadError, match="header"):
            receive(b)
        a.sendall(struct.pack("!I", len(evil := encode({"message": {"row": "Popen", "fields": {}}}, {}))) + evil)
        with pytest.raises(PayloadError, match="a step call may not hold"):
            receive(b)


def test_a_step_call_crosses_the_wire_as_json_and_raw_buffers() -> None:
    """No pickle and no module path on the wire (a leader and its followers may run different NumPy lines): the
    arrays travel as raw buffers with their dtype and shape, the rest as JSON."""
    piece = PromptPiece(1, [5, 6, 7], 0, 3, SamplingParams(temperature=0.25, allowed_token_ids=(3, 4)), mask=None)
    row = DecodeRow(7, 12, SamplingParams(seed=3), 2, mask=np.array([1, 0, 3], np.uint32), drafts=(4, 5))
    call = ("pack", ([piece], [row, None]), {"sampled": 2})
    a, b = socket.socketpair()
    with a, b:
        send(a, call)
        frame = b.recv(1 << 20)
        assert b"numpy" not in frame and frame[4:5] == b"{", frame[:80]
        a.sendall(frame)
        name, (pieces, rows), kwargs = receive(b)
    assert (name, kwargs, pieces, rows[1]) == ("pack", {"sampled": 2}, [piece], None)
    assert dataclasses.replace(rows[0], mask=None) == dataclasses.replace(row, mask=None)
    assert rows[0].mask.tolist() == [1, 0, 3] and rows[0].mask.dtype == np.uint32


class _Grown:
    """An engine with a step method the group does not know yet."""

    lanes = 4

    def decode(self, rows: list) -> str:
        return "decoded"

    def new_step(self) -> str:
        return "ran on the leader alone"


def test_a_leader_engine_refuses_a_method_it_does_not_know() -> None:
    """A method neither forwarded to the followers nor known to run no step would desync the group: refused."""
    sent = []
    leader = types.SimpleNamespace(call=lambda name, args, kwargs: sent.append(name))
    engine = LeaderEngine(_Grown(), leader)
    assert engine.lanes == 4 and engine.decode([]) == "decoded" and sent == ["decode"]
    with pytest.raises(AttributeError, match="new_step"):
        engine.new_step()


def test_every_engine_method_is_a_step_call_or_runs_no_step() -> None:
    """Each public method of the Engine, its own or inherited, is listed once: forwarded to the followers (CALLS) or
    run on the leader alone (LOCAL). A new method fails here until it is listed."""
    methods = {n for cls in Engine.__mro__[:-1] for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
    assert methods == set(CALLS) | set(LOCAL) and not set(CALLS) & set(LOCAL)
