"""Runs tiny models split over virtual CPU devices and saves what they computed, for tests/test_tensor_parallel.py.

It runs in a process of its own: the number of CPU devices is fixed when JAX starts (JAX_NUM_CPU_DEVICES), and the
rest of the suite keeps one. For each case (a model, a weight format, a number of devices N) it saves, from one
8-lane engine at N: a greedy request's tokens and logits on lane 0 alone and beside 1, 3 and 7 sampled requests;
and from an engine at N = 1 the same request alone. The test compares them.

A case "stage:name:dtype:N" saves a mesh station's fingerprint and residuals at N = 1 and N instead; a case
"load:name:dtype:N" the most bytes device 0 held while a station loaded the model split over N devices.

Usage: JAX_NUM_CPU_DEVICES=4 python tests/sharded_run.py OUT.npz CASE...  (CASE: name:dtype:N, e.g. tiny-qwen2:int8:2;
a name "wide-<fixture>" is that fixture's family with 8 heads and 4 KV heads and seeded random weights)
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import zlib
from pathlib import Path

import jax
import numpy as np

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from conftest import FIXTURES, run_wave  # noqa: E402

from jaxstation.config.coldstart import enable_compile_cache  # noqa: E402
from jaxstation.config.plan import load_planned, resolve_plan  # noqa: E402
from jaxstation.config.settings import StationConfig  # noqa: E402
from jaxstation.engine.engine import Engine  # noqa: E402
from jaxstation.engine.rows import SamplingParams  # noqa: E402
from jaxstation.mesh.stage import Stage  # noqa: E402
from jaxstation.model.choices import LayerRange  # noqa: E402
from jaxstation.model.config import ModelConfig  # noqa: E402
from jaxstation.model.layers import build_params  # noqa: E402
from jaxstation.model.loader import LoadedModel, checkpoint_config, hf_config  # noqa: E402
from jaxstation.model.sharding import device_bytes, make_mesh, shard_params  # noqa: E402

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # lane 0's request, greedy
STEPS = 6
NEIGHBOURS = (0, 1, 3, 7)


def wide_tensors(cfg: ModelConfig, seed: int = 0):
    """Seeded random checkpoint tensors ([out, in], HF slots) at cfg's shapes: `tensor(layer, slot)`."""
    d, hd, f, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    shapes = {"embed": (v, d), "lm_head": (v, d), "q": (cfg.num_heads * hd, d), "k": (cfg.num_kv_heads * hd, d),
              "v": (cfg.num_kv_heads * hd, d), "o": (d, cfg.num_heads * hd), "gate": (f, d), "up": (f, d),
              "down": (d, f), "bq": (cfg.num_heads * hd,), "bk": (cfg.num_kv_heads * hd,),
              "bv": (cfg.num_kv_heads * hd,), "q_norm": (hd,), "k_norm": (hd,)}
    cache: dict = {}

    def tensor(layer: int | None, slot: str) -> np.ndarray:
        if (layer, slot) not in cache:
            rng = np.random.default_rng([seed, 1 + (-1 if layer is None else layer), zlib.crc32(slot.encode())])
            if slot in shapes:
                cache[layer, slot] = (0.1 * rng.standard_normal(shapes[slot])).astype(np.float32)
            else:  # the norms over [d]
                cache[layer, slot] = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
        return cache[layer, slot]

    return tensor


def load(name: str, dtype: str, shards: int, matmul: str = "auto") -> LoadedModel:
    """A fixture (or its wide variant) laid out for `shards` devices and placed on a mesh of them."""
    if name.startswith("wide-"):
        path = FIXTURES / name.removeprefix("wide-")
        cfg = dataclasses.replace(hf_config(path / "config.json"), num_heads=8, num_kv_heads=4)
        params = build_params(cfg, wide_tensors(cfg), dtype, "unroll", "xla", shards)
        if shards > 1:
            params = shard_params(params, make_mesh(shards))
        return LoadedModel(cfg=cfg, params=params, tokenizer=None, source=path)
    config = StationConfig(model=str(FIXTURES / name), dtype=dtype, layer_loop="unroll", matmul=matmul,
                           tensor_parallel=shards)
    return load_planned(config, resolve_plan(config, checkpoint_config(config.model)))  # as a station loads it


def others(k: int) -> dict[int, tuple[list[int], SamplingParams]]:
    """k sampled requests on lanes 1..k."""
    return {lane: ([(7 * lane + j) % 200 + 1 for j in range(2 + 2 * lane)],
                   SamplingParams(temperature=0.9, top_p=0.95, seed=lane)) for lane in range(1, k + 1)}


def run_case(name: str, dtype: str, shards: int) -> dict[str, np.ndarray]:
    """Lane 0's tokens and logits alone at N = 1, and alone and beside 1, 3, 7 others at N = shards."""
    out: dict[str, np.ndarray] = {}
    request = {0: (PROMPT, SamplingParams())}
    for n, neighbours in ((1, (0,)), (shards, NEIGHBOURS)):
        model = load(name, dtype, n)
        engine = Engine(model, lanes=8, max_seq=64, chunk=16, block=16)  # one chunk a prompt
        for k in neighbours:
            tokens, logits = run_wave(engine, {**request, **others(k)}, STEPS)[0]
            out[f"{n}:{k}:tokens"], out[f"{n}:{k}:logits"] = np.array(tokens), np.stack(logits)
        held = engine.arena.rings or engine.arena.full  # every layer of tiny-mistral is windowed: its rings
        out[f"{n}:arena_spec"] = np.array(str(getattr(held.k.sharding, "spec", "")))
        out[f"{n}:device_bytes"] = np.array(device_bytes(model.params))
    return out


def run_stage(name: str, dtype: str, shards: int) -> dict[str, np.ndarray]:
    """A mesh station holding the first layer, at N = 1 and at N = shards: its fingerprint, the residuals of one
    prefill chunk of PROMPT, and how its arena is split."""
    out: dict[str, np.ndarray] = {}
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, :len(PROMPT)] = PROMPT
    for n in (1, shards):
        model = load(name, dtype, n, matmul="xla")  # the layout of the weights is part of the fingerprint
        stage = Stage(model, LayerRange(0, 1), lanes=8, max_seq=64, chunk=16, block=16)
        out[f"{n}:fingerprint"] = np.array(stage.fingerprint)
        out[f"{n}:residuals"] = stage.forward("prefill", tokens, np.arange(16, dtype=np.int32)[None], 0, 1)
        out[f"{n}:arena_spec"] = np.array(str(getattr(stage.arena.k.sharding, "spec", "")))
    return out


def device_0_bytes() -> int:
    """Bytes of the live arrays device 0 holds: its shard of each split array, the whole of one it holds whole."""
    device = jax.devices()[0]
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.live_arrays()
               if device in a.sharding.device_set)


def run_load(name: str, dtype: str, shards: int) -> dict[str, np.ndarray]:
    """The most bytes device 0 holds while `load` splits the model over `shards` devices: sampled at every return
    from a jaxstation function, so each weight the loader builds is seen before the next one."""
    peak = 0

    def on_return(frame, event: str, _arg) -> None:
        nonlocal peak
        if event == "return" and frame.f_globals.get("__name__", "").startswith("jaxstation."):
            peak = max(peak, device_0_bytes())

    sys.setprofile(on_return)
    try:
        model = load(name, dtype, shards)
    finally:
        sys.setprofile(None)
    return {"peak": np.array(max(peak, device_0_bytes())), "device_bytes": np.array(device_bytes(model.params))}


def main() -> None:
    path, cases = sys.argv[1], sys.argv[2:]
    enable_compile_cache(os.environ.get("MOONSHINE_COMPILE_CACHE_DIR"))  # the test run's, where it has one
    saved = {}
    for case in cases:
        kind, name, dtype, n = case.split(":") if case.count(":") == 3 else ("case", *case.split(":"))
        run = {"stage": run_stage, "load": run_load}.get(kind, run_case)
        saved.update({f"{case}/{k}": v for k, v in run(name, dtype, int(n)).items()})
    np.savez(path, **saved)


if __name__ == "__main__":
    main()
