"""The mesh host's engine: `MeshEngine` is a `Runner` like the local `Engine`, so the scheduler drives it unchanged.
A prefill chunk or a decode wave is one binary `/forward` per station, in layer order (each station's residuals feed
the next), then `/lm_head` on the last station, over keep-alive httpx connections with TCP_NODELAY and a timeout per
hop. One caller thread at a time (the decode thread); a pipelined wave's groups run on a pool of its own.

Start-up (`MeshEngine.connect`) checks that the stations cover every layer exactly once, serve the host's model
(same fingerprint) with the host's lanes, max_seq, chunk, block and dtype, and require the mesh token; otherwise it
refuses, naming the station and the mismatch.

Exact recovery. The engine keeps each lane's history: the prompt chunks it prefilled and the tokens it fed in decode
waves, keyed by position (a write at position p drops what the lane held from p on). When a hop fails (refused,
reset, timed out, a 5xx) or a reply carries a new epoch (the station restarted and lost its KV), the engine waits up
to `mesh_recover_s` for the station to answer again, replays every lane's history through the stations up to the
restarted one with the same step shapes (prompt chunks as prefill waves, generated tokens as decode waves; no
sampling), and re-runs the step it was in. Every write is keyed by (lane, position) and rows never mix, so the
rebuilt KV is bitwise the KV that was lost and the request's tokens do not change. If the station does not return in
time, the step raises `StationDown` (HTTP 502, naming the station) and the scheduler fails the requests in flight.

Pipelining (`mesh_pipeline`). A decode wave's lanes split into as many contiguous groups as there are stations (the
largest divisor of the lane count that is not more), and the groups go through the stations concurrently, so that
station 2 can work on group 1 while station 1 works on group 2. Stations run each group in the full wave's compiled
shape, so pipelining changes timing, never bits.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

import numpy as np

from jaxstation.config.plan import Plan
from jaxstation.config.settings import StationConfig
from jaxstation.engine.prefix_cache import LaneVersions
from jaxstation.engine.rows import DecodeRow, Sample, SamplingParams, read_samples, sampling_arrays
from jaxstation.engine.runner import ChunkPrefill, PromptChunk
from jaxstation.engine.sampling import SampleOut
from jaxstation.mesh.client import MeshError, StationClient, StationLost, check_mesh, describe_field, wait_info
from jaxstation.mesh.stage import SAMPLING_FIELDS
from jaxstation.model.choices import LayerRange
from jaxstation.model.config import ModelConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One write to a lane's KV, as it was made: a prefill chunk (tokens from `pos`) or a decode-fed token."""

    pos: int
    kind: str  # "prefill" | "decode"
    tokens: tuple[int, ...]


class MeshEngine(ChunkPrefill):
    """The scheduler's engine over mesh stations (see the module docstring). One caller thread at a time.

    It keeps no per-lane token state, so the routes refuse penalties, logit_bias, min_tokens and constraints on a mesh
    host."""

    token_controls = False
    prefill_budget = 0  # prompts enter one chunk at a time: the stations take one lane per prefill call
    verify_rows = 0  # no speculation over the mesh

    @property
    def wave_widths(self) -> tuple[int, ...]:
        return (self.lanes,)  # full waves only

    def __init__(self, clients: list[StationClient], *, lanes: int, max_seq: int, chunk: int, block: int,
                 recover_s: float, pipeline: bool) -> None:
        self.clients = clients
        self.lanes, self.max_seq, self.chunk, self.block = lanes, max_seq, chunk, block
        self.scratch_pos = max_seq - 1
        self.arena = None  # the KV arenas live on the stations
        self.recover_s = recover_s
        groups = max(g for g in range(1, len(clients) + 1) if lanes % g == 0) if pipeline else 1
        self.group_size = lanes // groups
        self._pool = ThreadPoolExecutor(groups, thread_name_prefix="jaxstation-mesh") if groups > 1 else None
        self.history: list[list[_Entry]] = [[] for _ in range(lanes)]
        self.lane_versions = LaneVersions(lanes)
        self._stale: int | None = None  # replay through stations [0, _stale] before the next step

    @classmethod
    def connect(cls, config: StationConfig, plan: Plan, cfg: ModelConfig, model_fp: str) -> MeshEngine:
        """Reach every station (waiting up to mesh_recover_s for them to come up), check the mesh against the host's
        plan, order it."""
        config.check_mesh_security()
        urls = config.station_urls
        if not urls:
            raise MeshError("no stations: set MOONSHINE_MESH_STATIONS (--stations URL,URL,...)")
        clients = [StationClient(i, url, config.mesh_token, config.mesh_hop_timeout_s) for i, url in enumerate(urls)]
        deadline = time.monotonic() + config.mesh_recover_s
        for c in clients:
            c.info = wait_info(c, deadline, config.mesh_recover_s)
            c.epoch = c.info["epoch"]
        check_mesh(clients, config, plan, cfg, model_fp)
        clients.sort(key=lambda c: LayerRange.parse(c.info["layers"]).start)
        for i, c in enumerate(clients):
            c.index = i
        return cls(clients, lanes=config.lanes, max_seq=config.max_seq, chunk=config.prefill_chunk,
                   block=config.kv_block, recover_s=config.mesh_recover_s, pipeline=config.mesh_pipeline)

    # ---- the Runner interface ---------------------------------------------------------------------------------
    def begin(self, lane: int, prompt: Sequence[int], sampling: SamplingParams, stop_ids: frozenset[int],
              lora: int = 0) -> None:
        """Nothing to set: a mesh host serves no token controls and no LoRA adapters."""
        if sampling.controls or lora:
            raise ValueError("a mesh host applies no penalties, logit_bias, min_tokens or LoRA adapters")

    def _prefill(self, lane: int, chunk: PromptChunk, sampling: SamplingParams, return_logits: bool, scored: bool,
                 mask: np.ndarray | None) -> tuple[Sample | None, np.ndarray | None, list[Sample]]:
        """`chunk` through the stations into `lane`, then the head on the last (`ChunkPrefill`)."""
        if mask is not None:
            raise ValueError("a mesh host applies no constraint masks")

        def step() -> tuple[Sample | None, np.ndarray | None, list[Sample]]:
            x = self._prefill_forward(lane, chunk.start, chunk.piece, self.clients)
            rows: list[Sample] = []
            if scored:
                rows = read_samples(_sample_out(self.clients[-1].post("/score", {"wave": "prefill"},
                                                                   {"x": x[0], "targets": chunk.targets})))
            if not chunk.last:
                return None, None, rows[:len(chunk.following)]
            samples, logits = self._head("prefill", x[0, len(chunk.piece) - 1][None], [(sampling, 0)], return_logits)
            return samples[0], logits, rows[:len(chunk.following)]

        self.lane_versions.touch([lane])
        out = self._step(step)
        self._record(lane, _Entry(chunk.start, "prefill", chunk.piece))
        return out

    def decode(self, rows: Sequence[DecodeRow | None], return_logits: bool = False
               ) -> tuple[list[Sample | None], np.ndarray | None]:
        if len(rows) != self.lanes:
            raise ValueError(f"decode needs one row per lane ({self.lanes}), got {len(rows)}")
        if all(r is None for r in rows):
            return [None] * self.lanes, None
        if any(r is not None and r.mask is not None for r in rows):
            raise ValueError("a mesh host applies no constraint masks")
        fed = [(r.token, r.position) if r else None for r in rows]
        sampling = [(r.sampling, r.counter) if r else None for r in rows]
        self.lane_versions.touch([i for i, r in enumerate(rows) if r is not None])
        samples, logits = self._step(lambda: self._decode_wave(fed, sampling, self.clients, return_logits))
        for i, r in enumerate(rows):
            if r is not None:
                self._record(i, _Entry(r.position, "decode", (r.token,)))
        return [s if r is not None else None for s, r in zip(samples, rows, strict=True)], logits

    def reuse_floor(self, lane: int) -> int:
        """Any: a station's arena keeps every position of every layer."""
        return 0

    def reset(self) -> None:
        """The lanes' requests were failed: forget their histories (a station's KV is overwritten before use)."""
        self.history = [[] for _ in range(self.lanes)]
        self.lane_versions.touch(range(self.lanes))

    def warmup_steps(self) -> list[tuple[str, Callable[[], object]]]:
        """The warm-up as one named step (the stations compiled their own shapes when they started)."""
        return [("mesh", self.warmup)]

    def warmup(self) -> None:
        """One prefill and one decode wave (greedy and sampled) through the mesh on lane 0, then forget them."""
        prompt = [0] * (self.chunk + 1)
        for start in (0, self.chunk):
            self.prefill(0, prompt, start, SamplingParams())
        for sampling in (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams()):
            self.decode([DecodeRow(0, len(prompt), sampling, 0)] + [None] * (self.lanes - 1))
        self.reset()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        for c in self.clients:
            c.close()

    # ---- waves ------------------------------------------------------------------------------------------------
    def _forward(self, stations: Sequence[StationClient], meta: dict[str, Any], lanes: np.ndarray,
                 positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        x = tokens
        for c in stations:
            x = c.post("/forward", meta, {"lanes": lanes, "positions": positions,
                                          ("tokens" if c is self.clients[0] else "x"): x})["x"]
        return x

    def _prefill_forward(self, lane: int, start: int, piece: tuple[int, ...],
                         stations: Sequence[StationClient]) -> np.ndarray:
        tokens = np.zeros((1, self.chunk), np.int32)
        tokens[0, :len(piece)] = piece
        positions = (start + np.arange(self.chunk, dtype=np.int32))[None]
        n_blocks = (start + len(piece) + self.block - 1) // self.block
        return self._forward(stations, {"wave": "prefill", "n_blocks": n_blocks}, np.array([lane], np.int32),
                             positions, tokens)

    def _head(self, wave: str, x: np.ndarray, sampling: list[tuple[SamplingParams, int] | None],
              return_logits: bool) -> tuple[list[Sample], np.ndarray | None]:
        s = sampling_arrays(sampling)
        out = self.clients[-1].post("/lm_head", {"wave": wave, "logits": return_logits},
                                    {"x": x, **{f: getattr(s, f) for f in SAMPLING_FIELDS}})
        return read_samples(_sample_out(out)), out.get("logits")

    def _decode_wave(self, fed: list[tuple[int, int] | None], sampling: list[tuple[SamplingParams, int] | None] | None,
                     stations: Sequence[StationClient], return_logits: bool = False
                     ) -> tuple[list[Sample | None], np.ndarray | None]:
        """Feed (token, position) per lane through `stations`, one group of lanes at a time (concurrently when
        pipelining), and sample when `sampling` is given. Groups with no live lane are skipped."""
        k = self.group_size
        groups = [g for g in range(0, self.lanes, k) if any(fed[g:g + k])]

        def run(g: int) -> tuple[list[Sample], np.ndarray | None] | None:
            rows = fed[g:g + k]
            live = [r[1] for r in rows if r is not None]
            tokens = np.array([[r[0] if r else 0] for r in rows], np.int32)
            positions = np.array([[r[1] if r else self.scratch_pos] for r in rows], np.int32)
            meta = {"wave": "decode", "n_blocks": max(live) // self.block + 1}
            x = self._forward(stations, meta, np.arange(g, g + k, dtype=np.int32), positions, tokens)
            return None if sampling is None else self._head("decode", x[:, 0], sampling[g:g + k], return_logits)

        if self._pool is not None and len(groups) > 1:
            futures = [self._pool.submit(run, g) for g in groups]
            wait(futures)  # every group's hops are over before a failure is handled
            results = [f.result() for f in futures]
        else:
            results = [run(g) for g in groups]
        samples: list[Sample | None] = [None] * self.lanes
        logits = None
        for g, result in zip(groups, results, strict=True):
            if result is None:
                continue
            samples[g:g + k] = result[0]
            if result[1] is not None:
                if logits is None:
                    logits = np.zeros((self.lanes, result[1].shape[1]), np.float32)
                logits[g:g + k] = result[1]
        return samples, logits

    # ---- history and recovery ---------------------------------------------------------------------------------
    def _record(self, lane: int, entry: _Entry) -> None:
        hist = self.history[lane]
        while hist and hist[-1].pos >= entry.pos:  # a write at p supersedes what the lane held from p on
            hist.pop()
        hist.append(entry)

    def _step(self, step: Callable[[], T]) -> T:
        """Run a step; on a lost station wait for it, rebuild the KV it lost, and run the step again."""
        deadline = None
        while True:
            try:
                if self._stale is not None:
                    self._replay(self.clients[:self._stale + 1])
                    self._stale = None
                return step()
            except StationLost as e:
                if deadline is None:
                    deadline = time.monotonic() + self.recover_s
                self._await(e, deadline)

    def _await(self, lost: StationLost, deadline: float) -> None:
        c = lost.station
        log.warning("%s lost (%s); waiting up to %.0f s for it", c.name, lost.reason, self.recover_s)
        info = wait_info(c, deadline, self.recover_s)
        for key in ("layers", "fingerprint", "lanes", "max_seq", "chunk", "block", "dtype", "weights", "layer_loop",
                    "attention", "auth"):
            if info.get(key) != c.info.get(key):
                raise MeshError(f"{c.name} came back with {describe_field(info, key)}, "
                                f"it had {describe_field(c.info, key)}")
        if info["epoch"] != c.epoch:
            log.warning("%s restarted (epoch %s -> %s): replaying %d lanes' history", c.name, c.epoch,
                        info["epoch"], sum(bool(h) for h in self.history))
            c.epoch = info["epoch"]
            self._stale = max(self._stale or 0, c.index)

    def _replay(self, stations: Sequence[StationClient]) -> None:
        """Rewrite every lane's KV on `stations` from its history, each entry in the shape that first wrote it:
        round j replays each lane's j-th entry, prefill chunks one by one and decode tokens as one wave."""
        t0 = time.perf_counter()
        rounds = max((len(h) for h in self.history), default=0)
        for j in range(rounds):
            fed: list[tuple[int, int] | None] = [None] * self.lanes
            for lane, hist in enumerate(self.history):
                if j >= len(hist):
                    continue
                e = hist[j]
                if e.kind == "prefill":
                    self._prefill_forward(lane, e.pos, e.tokens, stations)
                else:
                    fed[lane] = (e.tokens[0], e.pos)
            if any(fed):
                self._decode_wave(fed, None, stations)
        log.info("replayed %d rounds through %d stations in %.2f s", rounds, len(stations), time.perf_counter() - t0)


def _sample_out(arrays: dict[str, np.ndarray]) -> SampleOut:
    return SampleOut.of(arrays["tokens"], arrays["logprob"], arrays["top_ids"], arrays["top_logprobs"])
