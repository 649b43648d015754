"""One station's share of a mesh: a contiguous range of the model's layers, its KV arena and its two compiled steps.

`forward` runs the range's layers over K contiguous lanes (a decode wave, Q = 1) or one lane's prefill chunk
(K = 1, Q = chunk) and returns the residual stream; the first station embeds token ids, later ones take the previous
station's residuals. `lm_head` (last station only) applies the final norm and the head and samples each row with its
own settings. Both reuse the local engine's pieces (`steps.run_layers`, `model.lm_logits`, `sampling.sample`) on a
`Params` cut down to the range by `slice_params`, so a split model computes what the whole one does, bit for bit.

Every input is checked against the station's settings before it reaches the device (`check_forward`,
`check_lm_head`): a bad lane id, position, shape or dtype raises `PayloadError` naming the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxstation.engine.arena import KVArena, allocate_arena
from jaxstation.engine.sampling import SampleOut, SamplingArrays, sample, token_logprobs
from jaxstation.engine.steps import run_layers
from jaxstation.group.payload import DTYPES, PayloadError
from jaxstation.kernels.rowwise import log_softmax
from jaxstation.model.choices import LayerRange
from jaxstation.model.config import ModelConfig
from jaxstation.model.layers import Params, embed_tokens, layer_at, lm_logits
from jaxstation.model.loader import LoadedModel
from jaxstation.model.sharding import fused_sizes, mesh_of, natural_order

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingArrays))
_SAMPLING_DTYPES = {"temperature": np.float32, "top_k": np.int32, "top_p": np.float32, "min_p": np.float32,
                    "seed": np.uint32, "counter": np.int32}


def fingerprint(model: LoadedModel) -> str:
    """The model's identity: its config and every weight's dtype, shape and bytes (of the whole model), layer by layer,
    so that the stacked and the per-layer layouts of the same weights agree."""
    h = hashlib.blake2b(repr(model.cfg).encode(), digest_size=16)
    params = model.params
    layers = params.layers if isinstance(params.layers, tuple) else [
        layer_at(params.layers, i) for i in range(model.cfg.num_layers)]
    named = [("globals", dataclasses.replace(params, layers=()))] + [(f"layer{i}", x) for i, x in enumerate(layers)]
    for name, tree in named:
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            a = _natural(model.cfg, tree, path, np.asarray(leaf))
            h.update(f"{name}{jax.tree_util.keystr(path)}:{a.dtype}:{a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def _natural(cfg: ModelConfig, tree, path: tuple, a: np.ndarray) -> np.ndarray:
    """A weight leaf in the plain layout, whatever number of devices its layer's fused columns were laid out for: a
    split station serves the same model as a whole one."""
    shards = getattr(tree, "shards", 1)
    slot = next((k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)), None)
    sizes = fused_sizes(cfg, slot) if shards > 1 else None
    return a if sizes is None else natural_order(a, sizes, shards)


def slice_params(cfg: ModelConfig, params: Params, layers: LayerRange) -> tuple[ModelConfig, Params]:
    """The config and weights a station of `layers` needs: the range's layers, the embedding on the first station
    (and on the last when the head is tied to it), the head on the last. The final norm ([d]) stays everywhere: it
    names the compute dtype. The one place that knows how per-layer weights are laid out (a tuple of layers, or
    leaves stacked on a leading layer axis)."""
    first, last = layers.start == 0, layers.stop == cfg.num_layers
    if isinstance(params.layers, tuple):
        sub = params.layers[layers.start:layers.stop]
    else:
        sub = jax.tree_util.tree_map(lambda a: a[layers.start:layers.stop], params.layers)
    keep_embed = first or (last and params.lm_head is None)
    return (cfg.layers(layers.start, layers.stop),
            Params(embed=params.embed if keep_embed else None, layers=sub, final_norm=params.final_norm,
                   lm_head=params.lm_head if last else None))


@partial(jax.jit, static_argnames=("cfg", "block", "attention"), donate_argnames=("arena",))
def forward_step(cfg: ModelConfig, params: Params, arena: KVArena, inputs: jax.Array, positions: jax.Array,
                 lane0: jax.Array, n_blocks: jax.Array, *, block: int, attention: str) -> tuple[jax.Array, KVArena]:
    """inputs: token ids [K, Q] int32 (first station) or residuals [K, Q, d]; positions [K, Q] -> residuals.
    attention: the station's decode attention, for prefill chunks too, as the local engine's `prefill_chunk` runs it."""
    x = embed_tokens(cfg, params, inputs) if inputs.dtype == jnp.int32 else inputs
    lanes = lane0 + jnp.arange(x.shape[0], dtype=jnp.int32)  # rows sit on consecutive lanes
    return run_layers(cfg, params, arena, x, positions, lanes, n_blocks, block, attention=attention)


@partial(jax.jit, static_argnames=("cfg", "return_logits"))
def head_step(cfg: ModelConfig, params: Params, x: jax.Array, sampling: SamplingArrays, *,
              return_logits: bool) -> tuple[SampleOut, jax.Array | None]:
    """x: [R, d] -> one sample per row (and the float32 logits [R, vocab] if asked)."""
    logits = lm_logits(cfg, params, x)
    return sample(logits, sampling), (logits if return_logits else None)


@partial(jax.jit, static_argnames=("cfg",))
def score_step(cfg: ModelConfig, params: Params, x: jax.Array, targets: jax.Array) -> SampleOut:
    """x: [chunk, d] -> each row's log-probability of targets [chunk] and its top tokens (prompt logprobs)."""
    return token_logprobs(log_softmax(lm_logits(cfg, params, x)), targets)


class Stage:
    """Layers [start, stop) of `model` over `lanes` lanes of `max_seq` positions. One caller at a time. `weights`:
    the weight format the plan loaded (`--dtype`: gguf and gguf-exact hold the same bytes and multiply them in two
    ways), which /info reports for the host to check; `kv_dtype`: the arena's (default: the activations')."""

    def __init__(self, model: LoadedModel, layers: LayerRange, lanes: int, max_seq: int, chunk: int,
                 block: int, attention: str = "blocked", weights: str | None = None, kv_dtype: str | None = None
                 ) -> None:
        total = model.cfg.num_layers
        if layers.stop > total:
            raise ValueError(f"layers {layers} reach past the model's {total} layers")
        if max_seq % chunk or max_seq % block:
            raise ValueError(f"max_seq ({max_seq}) must be a multiple of the prefill chunk ({chunk}) "
                             f"and of the KV block ({block})")
        self.layers, self.total_layers = layers, total
        self.first, self.last = layers.start == 0, layers.stop == total
        self.fingerprint = fingerprint(model)
        self.full_cfg = model.cfg
        self.cfg, self.params = slice_params(model.cfg, model.params, layers)
        self.dtype = np.dtype(self.params.dtype)
        self.layer_loop = self.params.layer_loop
        self.lanes, self.max_seq, self.chunk, self.block = lanes, max_seq, chunk, block
        self.attention, self.weights = attention, weights
        self.kv_dtype = np.dtype(kv_dtype) if kv_dtype else self.dtype
        self.arena = allocate_arena(self.cfg, lanes, max_seq, self.kv_dtype, mesh=mesh_of(self.params))

    @property
    def dtype_name(self) -> str:
        return next(name for name, dt in DTYPES.items() if dt == self.dtype)

    def info(self) -> dict:
        """What a host checks before it sends a wave: layers, model identity and the lane geometry."""
        return {"layers": str(self.layers), "total_layers": self.total_layers, "fingerprint": self.fingerprint,
                "lanes": self.lanes, "max_seq": self.max_seq, "chunk": self.chunk, "block": self.block,
                "dtype": self.dtype_name, "weights": self.weights, "layer_loop": self.layer_loop,
                "attention": self.attention,
                "hidden_size": self.cfg.hidden_size, "vocab_size": self.cfg.vocab_size}

    # ---- validation -------------------------------------------------------------------------------------------
    def _wave(self, meta: dict) -> str:
        wave = meta.get("wave")
        if wave not in ("prefill", "decode"):
            raise PayloadError("wave", f"must be 'prefill' or 'decode', got {wave!r}")
        return wave

    def _group(self, k: int, field: str) -> None:
        if not 1 <= k <= self.lanes or self.lanes % k:
            raise PayloadError(field, f"a decode wave covers a number of lanes that divides {self.lanes}, got {k}")

    def check_forward(self, meta: dict, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(inputs, positions, lane0, n_blocks) of a valid /forward payload, or PayloadError naming the field."""
        wave = self._wave(meta)
        want = {"lanes", "positions", "tokens" if self.first else "x"}
        if set(arrays) != want:
            raise PayloadError("arrays", f"this station ({self.layers}) takes exactly {sorted(want)}, "
                                         f"got {sorted(arrays)}")
        lanes, positions = arrays["lanes"], arrays["positions"]
        if lanes.dtype != np.int32 or lanes.ndim != 1 or lanes.shape[0] < 1:
            raise PayloadError("lanes", f"must be int32 [K], got {lanes.dtype} {list(lanes.shape)}")
        k, q = lanes.shape[0], (1 if wave == "decode" else self.chunk)
        if wave == "prefill":
            if k != 1 or not 0 <= lanes[0] < self.lanes:
                raise PayloadError("lanes", f"a prefill chunk is for one lane in [0, {self.lanes}), got "
                                            f"{lanes.tolist()}")
        else:
            self._group(k, "lanes")
            if lanes[0] % k or lanes[0] + k > self.lanes or not np.array_equal(lanes, lanes[0] + np.arange(k)):
                raise PayloadError("lanes", f"a decode wave covers the contiguous lanes [j*K, (j+1)*K) within "
                                            f"[0, {self.lanes}), got {lanes.tolist()}")
        lane0 = int(lanes[0])
        if positions.dtype != np.int32 or positions.shape != (k, q):
            raise PayloadError("positions", f"must be int32 {[k, q]} for a {wave} wave, got {positions.dtype} "
                                            f"{list(positions.shape)}")
        if positions.min() < 0 or positions.max() >= self.max_seq:
            raise PayloadError("positions", f"must lie in [0, {self.max_seq})")
        start = int(positions[0, 0])
        if wave == "prefill" and (start % self.chunk or not np.array_equal(positions[0], start + np.arange(q))):
            raise PayloadError("positions", f"a prefill chunk is one lane's consecutive positions from a multiple "
                                            f"of {self.chunk}")
        if self.first:
            inputs = arrays["tokens"]
            if inputs.dtype != np.int32 or inputs.shape != (k, q):
                raise PayloadError("tokens", f"must be int32 {[k, q]}, got {inputs.dtype} {list(inputs.shape)}")
            if inputs.min() < 0 or inputs.max() >= self.cfg.vocab_size:
                raise PayloadError("tokens", f"token ids must lie in [0, {self.cfg.vocab_size})")
        else:
            inputs = arrays["x"]
            shape = (k, q, self.cfg.hidden_size)
            if inputs.dtype != self.dtype or inputs.shape != shape:
                raise PayloadError("x", f"must be {self.dtype_name} {list(shape)}, got {inputs.dtype} "
                                        f"{list(inputs.shape)}")
        n_blocks = meta.get("n_blocks")
        if type(n_blocks) is not int or not 1 <= n_blocks <= self.max_seq // self.block:
            raise PayloadError("n_blocks", f"must be an integer in [1, {self.max_seq // self.block}], got {n_blocks!r}")
        return inputs, positions, lane0, n_blocks

    def _head_route(self) -> None:
        if not self.last:
            raise PayloadError("route", f"this station holds layers {self.layers}; only the last one has the lm_head")

    def check_score(self, meta: dict, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(x, targets) of a valid /score payload (a prefill chunk's residuals and each row's next prompt token)."""
        self._head_route()
        if set(arrays) != {"x", "targets"}:
            raise PayloadError("arrays", f"/score takes exactly ['targets', 'x'], got {sorted(arrays)}")
        x, targets = arrays["x"], arrays["targets"]
        shape = (self.chunk, self.cfg.hidden_size)
        if x.dtype != self.dtype or x.shape != shape:
            raise PayloadError("x", f"must be {self.dtype_name} {list(shape)}, got {x.dtype} {list(x.shape)}")
        if targets.dtype != np.int32 or targets.shape != (self.chunk,):
            raise PayloadError("targets", f"must be int32 [{self.chunk}], got {targets.dtype} {list(targets.shape)}")
        if targets.min() < 0 or targets.max() >= self.cfg.vocab_size:
            raise PayloadError("targets", f"token ids must lie in [0, {self.cfg.vocab_size})")
        return x, targets

    def check_lm_head(self, meta: dict, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, SamplingArrays, bool]:
        """(x, sampling, return_logits) of a valid /lm_head payload, or PayloadError naming the field."""
        self._head_route()
        wave = self._wave(meta)
        want = {"x", *SAMPLING_FIELDS}
        if set(arrays) != want:
            raise PayloadError("arrays", f"/lm_head takes exactly {sorted(want)}, got {sorted(arrays)}")
        x = arrays["x"]
        if x.dtype != self.dtype or x.ndim != 2 or x.shape[1] != self.cfg.hidden_size or x.shape[0] < 1:
            raise PayloadError("x", f"must be {self.dtype_name} [R, {self.cfg.hidden_size}], got {x.dtype} "
                                    f"{list(x.shape)}")
        r = x.shape[0]
        if wave == "prefill" and r != 1:
            raise PayloadError("x", f"a prefill wave samples one row, got {r}")
        self._group(r, "x")
        for name, dtype in _SAMPLING_DTYPES.items():
            a = arrays[name]
            if a.dtype != dtype or a.shape != (r,):
                raise PayloadError(name, f"must be {np.dtype(dtype)} [{r}], got {a.dtype} {list(a.shape)}")
        s = SamplingArrays(**{name: arrays[name] for name in SAMPLING_FIELDS})
        if not np.all(np.isfinite(s.temperature) & (s.temperature >= 0)):
            raise PayloadError("temperature", "must be finite and >= 0")
        if np.any(s.top_k < 0):
            raise PayloadError("top_k", "must be >= 0")
        if not np.all((s.top_p > 0) & (s.top_p <= 1)):
            raise PayloadError("top_p", "must lie in (0, 1]")
        if not np.all((s.min_p >= 0) & (s.min_p <= 1)):
            raise PayloadError("min_p", "must lie in [0, 1]")
        if np.any(s.counter < 0):
            raise PayloadError("counter", "must be >= 0")
        logits = meta.get("logits", False)
        if not isinstance(logits, bool):
            raise PayloadError("logits", f"must be a boolean, got {logits!r}")
        return x, s, logits

    # ---- steps ------------------------------------------------------------------------------------------------
    def _pad(self, rows: np.ndarray, lane0: int, fill: np.ndarray) -> np.ndarray:
        """A station's decode wave always runs all lanes: `rows` sit at lane0, idle rows elsewhere. (Off the CPU
        kernels XLA may round a row differently in a program of another batch size, so a group never gets its own
        shape; on them the local engine's narrow waves give the same bits.)"""
        full = np.broadcast_to(fill, (self.lanes, *rows.shape[1:])).copy()
        full[lane0:lane0 + rows.shape[0]] = rows
        return full

    def forward(self, wave: str, inputs: np.ndarray, positions: np.ndarray, lane0: int, n_blocks: int
                ) -> np.ndarray:
        """Checked inputs -> residuals [K, Q, d] in the station's dtype."""
        k = inputs.shape[0]
        if wave == "decode":
            inputs = self._pad(inputs, lane0, np.zeros((), inputs.dtype))
            positions = self._pad(positions, lane0, np.int32(self.max_seq - 1))  # idle rows: the scratch slot
            lane_arg = 0
        else:
            lane_arg = lane0
        x, self.arena = forward_step(self.cfg, self.params, self.arena, inputs, positions, np.int32(lane_arg),
                                     np.int32(n_blocks), block=self.block, attention=self.attention)
        x = np.asarray(jax.device_get(x))
        return x[lane0:lane0 + k] if wave == "decode" else x

    def lm_head(self, wave: str, x: np.ndarray, sampling: SamplingArrays, return_logits: bool
                ) -> dict[str, np.ndarray]:
        """Checked rows -> tokens, logprob, top_ids, top_logprobs (and logits) per row."""
        r = x.shape[0]
        if wave == "decode":
            x = self._pad(x, 0, np.zeros((), x.dtype))
            idle = _idle_sampling(self.lanes)
            sampling = SamplingArrays(**{f: self._pad(getattr(sampling, f), 0, getattr(idle, f)[0])
                                         for f in SAMPLING_FIELDS})
        out, logits = head_step(self.cfg, self.params, x, sampling, return_logits=return_logits)
        arrays = _sample_arrays(out)
        if return_logits:
            arrays["logits"] = np.asarray(jax.device_get(logits))
        return {k: v[:r] for k, v in arrays.items()}

    def score(self, x: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
        """Checked chunk rows -> targets, their logprobs and each row's top tokens (compiled on first use)."""
        return _sample_arrays(score_step(self.cfg, self.params, x, targets))

    def reset(self) -> None:
        """A fresh arena, e.g. after a failed step left the donated one unusable."""
        self.arena = None
        self.arena = allocate_arena(self.cfg, self.lanes, self.max_seq, self.kv_dtype, mesh=mesh_of(self.params))

    def warmup(self) -> None:
        """Compile the prefill and decode shapes (and the head's). Whatever this writes precedes every request,
        and a request overwrites each position before it reads it."""
        d = self.cfg.hidden_size

        def inputs(k: int, q: int) -> np.ndarray:
            return np.zeros((k, q), np.int32) if self.first else np.zeros((k, q, d), self.dtype)

        self.forward("prefill", inputs(1, self.chunk), np.arange(self.chunk, dtype=np.int32)[None], 0, 1)
        self.forward("decode", inputs(1, 1), np.zeros((1, 1), np.int32), 0, 1)
        if self.last:
            for wave, r in (("prefill", 1), ("decode", self.lanes)):
                for temperature in (0.0, 1.0):
                    s = dataclasses.replace(_idle_sampling(r), temperature=np.full(r, temperature, np.float32),
                                            top_p=np.full(r, 0.9, np.float32))
                    self.lm_head(wave, np.zeros((r, d), self.dtype), s, False)


def _sample_arrays(out: SampleOut) -> dict[str, np.ndarray]:
    host = SampleOut(np.asarray(out.packed))  # one transfer
    return {f: getattr(host, f) for f in ("tokens", "logprob", "top_ids", "top_logprobs")}


def _idle_sampling(rows: int) -> SamplingArrays:
    """Greedy, unfiltered rows: what an idle lane samples with."""
    return SamplingArrays(temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32),
                          top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
                          seed=np.zeros(rows, np.uint32), counter=np.zeros(rows, np.int32))
