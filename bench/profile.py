"""Where a decode wave's time goes, at 1, 8 and 32 lanes: each part compiled and timed on its own.

- projections: every layer's norms and matmuls (q/k/v, o, gate/up, down) with attention taken out;
- attention: every layer's attention over the live length (the step's own implementation), no matmuls;
- lm_head + sampling: the final norm, the lm_head and on-device sampling (greedy, and temperature + top-p);
- step: the whole compiled `step_rows`, arguments already on the device;
- host: `Engine.decode` wall time minus the step (building the wave's arrays, fetching the samples).

The parts need not add up exactly to the step (the step fuses across them), but they show where the bytes and the
time go. Several levers can be compared in one run: --dtype, --layer-loop, --attention and XLA_FLAGS (a new process
per flag set). Usage:
  python -m bench.profile                                   # default model, the backend's defaults
  python -m bench.profile --dtype int8 --name profile_int8
  XLA_FLAGS=--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY \\
      python -m bench.profile --name profile_xnn
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import add_lane_sweep_args, add_model_args, bench_model, summary, timed, write_result
from jaxstation.engine.attention import blocked_attention, dense_decode_attention, kernel_decode_attention
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, SamplingParams, sampling_arrays
from jaxstation.engine.sampling import sample
from jaxstation.engine.steps import step_rows
from jaxstation.model.layers import attn_out, lm_logits, mlp_block, over_layers, qkv_proj, rotary, rotary_at


def _median_ms(fn, reps: int) -> dict:
    fn()
    s = summary([timed(fn) for _ in range(reps)])
    return {"median_ms": 1e3 * s["median"], "spread_ms": [1e3 * s["min"], 1e3 * s["max"]]}


def parts(engine: Engine, live: int, reps: int) -> dict:
    cfg, params, lanes = engine.cfg, engine.params, engine.lanes
    positions = jnp.full((lanes, 1), live - 1, jnp.int32)
    rots = rotary(cfg, positions)
    x = jnp.ones((lanes, 1, cfg.hidden_size), params.dtype)

    @jax.jit
    def projections(params, x):
        def body(i, layer, x):
            q, _, _ = qkv_proj(cfg, layer, x, rotary_at(cfg, rots, i))
            return mlp_block(cfg, layer, attn_out(cfg, layer, x, q.reshape(lanes, 1, -1)))
        return over_layers(params, body, x)

    q = jnp.ones((lanes, 1, cfg.num_kv_heads, cfg.group_size, cfg.head_dim), params.dtype)
    n_blocks = jnp.int32(live // engine.block + 1)

    @jax.jit
    def attention(arena):
        def one(i):
            kv = arena.layer(i)
            if engine.attention == "blocked":
                return blocked_attention(cfg, q, positions, kv, i, jnp.arange(lanes), n_blocks, engine.block)
            if engine.attention == "kernel":
                return kernel_decode_attention(cfg, q.reshape(lanes, cfg.num_heads, -1), positions[:, 0], kv, i,
                                               jnp.arange(lanes))
            return dense_decode_attention(cfg, q.reshape(lanes, cfg.num_heads, -1), positions[:, 0],
                                          *kv.read(slice(None), slice(None), q.dtype), engine.attention)
        return sum(one(i) for i in range(cfg.num_layers))

    logits_in = jnp.ones((lanes, cfg.hidden_size), params.dtype)
    greedy = jax.tree_util.tree_map(jnp.asarray, sampling_arrays([(SamplingParams(), 0)] * lanes))
    nucleus = jax.tree_util.tree_map(jnp.asarray, sampling_arrays(
        [(SamplingParams(temperature=0.8, top_p=0.9, seed=1), 0)] * lanes))
    head = jax.jit(lambda params, h, s: sample(lm_logits(cfg, params, h), s))
    wave = [DecodeRow(1, live - 1, SamplingParams(), 0)] * lanes
    pos, tok = np.full(lanes, live - 1, np.int32), np.ones(lanes, np.int32)
    dev_args = jax.device_put((pos, tok, np.int32(n_blocks), greedy))

    def step() -> None:
        engine.arena, out, _ = step_rows(cfg, params, engine.arena, *dev_args, block=engine.block,
                                         attention=engine.attention)
        jax.block_until_ready(out)

    out = {
        "projections": _median_ms(lambda: projections(params, x).block_until_ready(), reps),
        "attention": _median_ms(lambda: attention(engine.arena).block_until_ready(), reps),
        "lm_head_greedy": _median_ms(lambda: jax.block_until_ready(head(params, logits_in, greedy)), reps),
        "lm_head_top_p": _median_ms(lambda: jax.block_until_ready(head(params, logits_in, nucleus)), reps),
        "step": _median_ms(step, reps),
        "engine_decode": _median_ms(lambda: engine.decode(wave), reps),
    }
    out["host_ms"] = out["engine_decode"]["median_ms"] - out["step"]["median_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    add_lane_sweep_args(ap, reps=7, name="profile")
    args = ap.parse_args()
    model, engine_kw = bench_model(args, args.max_seq)
    rows = []
    for lanes in args.lanes:
        engine = Engine(model, lanes=lanes, max_seq=args.max_seq, chunk=32, block=128, **engine_kw)
        engine.warmup()
        r = {"lanes": lanes, "live": args.live, **parts(engine, args.live, args.reps)}
        rows.append(r)
        ms = {k: v["median_ms"] for k, v in r.items() if isinstance(v, dict)}
        print(f"lanes {lanes:2d}: step {ms['step']:7.1f} ms | projections {ms['projections']:6.1f} | attention "
              f"{ms['attention']:6.1f} | lm_head+sample greedy {ms['lm_head_greedy']:5.1f} top-p "
              f"{ms['lm_head_top_p']:5.1f} | host {r['host_ms']:5.2f} ms", flush=True)
    path = write_result(args.name, {"config": vars(args), "model": str(model.source),
                                    "weight_bytes": model.params.nbytes, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                                    "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
