"""The decoder in functional JAX: parameter pytree, layer pieces and the full-sequence oracle. One layer serves every
family: the Llama layer, plus what the config declares (biases, q/k norms, sandwich norms, soft caps, per-layer windows
and RoPE bases; docs/models.md).

Weights are stored [in, out] so activations multiply on the left; q/k/v and gate/up are fused so that each layer
reads its weights in three matmuls plus the output projections. A projection is a float array, an int8
`QuantWeight`, or a `KernelWeight` laid out for the CPU kernel (jaxstation/model/quant.py); `quant.matmul` handles each.

Two layouts of the per-layer weights, chosen at load (`layer_loop`):
- "scan": every leaf stacked on a leading layer axis, walked by `fori_loop` (one compiled layer body: quick to
  compile, and what int8 needs on XLA's CPU dot);
- "unroll": a tuple with one `LayerParams` per layer, walked by a Python loop, so that each matmul reads its own
  weight buffer in place (on a GPU, indexing a stacked weight inside a loop copies it before the GEMM; on CPU it
  measures as fast or faster for float weights: `bench.step --layer-loop`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxstation.kernels import cpu_kernel
from jaxstation.kernels.rowwise import row_sum
from jaxstation.model.choices import GGUF_WEIGHTS, LAYER_LOOPS, MATMULS, WEIGHT_DTYPES
from jaxstation.model.config import NO_WINDOW, ModelConfig
from jaxstation.model.lora import LoraLayer, LoraProj, add_delta, empty_layer, part_shapes, write_slot
from jaxstation.model.quant import (
    Tensor,
    Weight,
    compute_dtype,
    matmul,
    matmul_transposed,
    on_kernel,
    precision_for,
    prepare_embedding,
    prepare_weight,
    projection,
    stack,
    take_rows,
)
from jaxstation.model.sharding import fused_sizes, make_mesh, on_shards, shard_major, split_fused

# a layer's weights that are not projections
VECTOR_SLOTS = ("attn_norm", "mlp_norm", "bqkv", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")
Carry = TypeVar("Carry")


@partial(jax.tree_util.register_dataclass, data_fields=[
    "attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down", "bqkv", "q_norm", "k_norm", "post_attn_norm",
    "post_mlp_norm", "lora"], meta_fields=["shards"])
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """One layer's weights ("unroll"), or every layer's stacked on a leading axis ("scan"). The optional ones are
    what a family adds to the Llama layer (`ModelConfig.qkv_bias`, `qk_norm`, `sandwich_norms`); None where it has
    none."""

    attn_norm: jax.Array  # [d]
    wqkv: Weight  # [d, (heads + 2 * kv_heads) * head_dim]
    wo: Weight  # [heads * head_dim, d]
    mlp_norm: jax.Array  # [d]
    w_gate_up: Weight  # [d, 2 * ffn]
    w_down: Weight  # [ffn, d]
    bqkv: jax.Array | None = None  # [(heads + 2 * kv_heads) * head_dim]
    q_norm: jax.Array | None = None  # [head_dim]
    k_norm: jax.Array | None = None  # [head_dim]
    post_attn_norm: jax.Array | None = None  # [d]
    post_mlp_norm: jax.Array | None = None  # [d]
    shards: int = 1  # the devices wqkv and w_gate_up are laid out for (`sharding.shard_major`)
    lora: LoraLayer | None = None  # the resident LoRA adapters' stacks (model/lora.py), where a station serves them


@partial(jax.tree_util.register_dataclass, data_fields=["embed", "layers", "final_norm", "lm_head"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Params:
    embed: Weight  # [vocab, d]
    layers: LayerParams | tuple[LayerParams, ...]
    final_norm: jax.Array  # [d]
    lm_head: Weight | None  # [d, vocab]; None when tied to embed

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype: activations, norms and the KV arena."""
        return self.final_norm.dtype

    @property
    def row_invariant(self) -> bool:
        """Every matmul runs on the CPU kernel, whose rows do not depend on how many rows a call has: a wave may then
        run narrower than the arena without changing any row's bits (XLA's dot computes one row differently)."""
        heads = [self.embed if self.lm_head is None else self.lm_head]
        projections = [w for layer in layer_list(self) for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
        return all(on_kernel(w) for w in heads + projections)

    @property
    def layer_loop(self) -> str:
        return "unroll" if isinstance(self.layers, tuple) else "scan"


def projection_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """Each layer's projections as (in, out): wqkv, wo, w_gate_up, w_down."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    return [(d, cfg.qkv_size), (cfg.num_heads * cfg.head_dim, d), (d, 2 * f), (f, d)]


def kernel_takes_every_matmul(cfg: ModelConfig) -> bool:
    """Whether matmul "kernel" lays every projection and the head of `cfg`'s shapes out for the CPU kernel, so that the
    loaded Params are `row_invariant`: known from the shapes alone, before loading (a GGUF block format the kernel
    reads at a shape implies that shape fits it)."""
    return all(cpu_kernel.fits(i, o) for i, o in [*projection_shapes(cfg), (cfg.hidden_size, cfg.vocab_size)])


def build_params(cfg: ModelConfig, tensor: Callable[[int | None, str], Tensor], weights: str = "float32",
                 layer_loop: str = "scan", matmul: str = "xla", shards: int = 1) -> Params:
    """Build Params from checkpoint-oriented tensors ([out, in], HF slot names via `tensor(layer, slot)`): fuse q/k/v
    and gate/up, transpose to [in, out], cast or quantize, and lay the layers out for `layer_loop`.
    matmul "kernel" lays float32 and int8 projections out for the CPU kernel (`quant.KernelWeight`); weights "gguf"
    and "gguf-exact" keep GGUF blocks (`quant.GGUFBlocks`) as stored there, and read any other tensor as float32.
    shards > 1 lays the fused projections out for that many devices (`sharding.shard_major`), for XLA's dot only, and
    puts each matrix from host memory straight onto its shards of a mesh of that many devices (`sharding.on_shards`),
    so no device holds more than its share and the one matrix being cast or quantized (`sharding.shard_params` then
    places the rest)."""
    if weights not in WEIGHT_DTYPES:
        raise ValueError(f"weights must be one of {WEIGHT_DTYPES}, got {weights!r}")
    if weights in GGUF_WEIGHTS and matmul != "kernel":
        raise ValueError(f"weights {weights!r} need matmul 'kernel': only the CPU kernel reads GGUF blocks")
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    if matmul not in MATMULS:
        raise ValueError(f"matmul must be one of {MATMULS}, got {matmul!r}")
    if shards > 1 and matmul != "xla":
        raise ValueError("weights laid out for several devices need matmul 'xla': XLA cannot split the CPU kernel")
    dtype = compute_dtype(weights)
    mesh = make_mesh(shards) if shards > 1 else None

    def proj(w: Tensor, slot: str) -> Weight:  # [in, out] or [layers, in, out]; GGUF blocks out-major
        return prepare_weight(on_shards(slot, w, mesh), weights, matmul)

    def layer_arrays(i: int) -> dict[str, Tensor]:
        t = functools.partial(tensor, i)
        qkv, gate_up = fused_sizes(cfg, "wqkv"), fused_sizes(cfg, "w_gate_up")
        arrays = {"attn_norm": t("attn_norm"), "wqkv": shard_major(projection([t("q"), t("k"), t("v")]), qkv, shards),
                  "wo": projection([t("o")]), "mlp_norm": t("mlp_norm"), "w_down": projection([t("down")]),
                  "w_gate_up": shard_major(projection([t("gate"), t("up")]), gate_up, shards)}
        if cfg.qkv_bias:
            arrays["bqkv"] = shard_major(np.concatenate([t("bq"), t("bk"), t("bv")]), qkv, shards)
        if cfg.qk_norm:
            arrays["q_norm"], arrays["k_norm"] = t("q_norm"), t("k_norm")
        if cfg.sandwich_norms:
            arrays["post_attn_norm"], arrays["post_mlp_norm"] = t("post_attn_norm"), t("post_mlp_norm")
        return arrays

    def build(a: dict) -> LayerParams:
        vectors = {k: jnp.asarray(v, dtype) for k, v in a.items() if k in VECTOR_SLOTS}
        matrices = {k: proj(a[k], k) for k in ("wqkv", "wo", "w_gate_up", "w_down")}
        return LayerParams(**vectors, **matrices, shards=shards)

    if layer_loop == "unroll":
        layers: LayerParams | tuple[LayerParams, ...] = tuple(build(layer_arrays(i)) for i in range(cfg.num_layers))
    else:
        per_layer = [layer_arrays(i) for i in range(cfg.num_layers)]
        layers = build({k: stack([a[k] for a in per_layer]) for k in per_layer[0]})
    embed_w = prepare_embedding(on_shards("embed", tensor(None, "embed"), mesh), weights, matmul,
                                cfg.tie_word_embeddings)
    lm_head = None if cfg.tie_word_embeddings else proj(projection([tensor(None, "lm_head")]), "lm_head")
    return Params(embed=embed_w, layers=layers, final_norm=jnp.asarray(tensor(None, "final_norm"), dtype),
                  lm_head=lm_head)


def layer_at(layers: LayerParams, i: jax.Array | int) -> LayerParams:
    """One layer's weights out of the stacked pytree."""
    return jax.tree_util.tree_map(lambda a: a[i], layers)


def over_layers(params: Params, body: Callable[[jax.Array | int, LayerParams, Carry], Carry], carry: Carry) -> Carry:
    """carry = body(i, layer_i, carry) for every layer, in the params' layout."""
    if isinstance(params.layers, tuple):
        for i, layer in enumerate(params.layers):
            carry = body(i, layer, carry)
        return carry
    n = jax.tree_util.tree_leaves(params.layers)[0].shape[0]
    return jax.lax.fori_loop(0, n, lambda i, c: body(i, layer_at(params.layers, i), c), carry)


def embed_tokens(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """tokens [...] int32 -> [..., d] in the compute dtype (times cfg.embed_scale where the family scales them). The
    scaled rows are computed whole: folded into the ops after them, XLA computed a layer's output differently in
    programs of different depths (a mesh stage's residuals then differed from the whole model's)."""
    x = take_rows(params.embed, tokens, params.dtype)
    return x if cfg.embed_scale is None else jax.lax.optimization_barrier(x * jnp.asarray(cfg.embed_scale, x.dtype))


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap), or x without a cap."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def window_at(cfg: ModelConfig, layer: jax.Array | int) -> jax.Array | int | None:
    """Layer `layer`'s sliding window: an int or None for a Python index; for a traced one (a stacked walk) an int32,
    NO_WINDOW on a global layer."""
    if cfg.sliding_window is None or isinstance(layer, int):
        return None if cfg.sliding_window is None else cfg.window(layer)
    if not cfg.local_layers:
        return cfg.sliding_window
    return jnp.where(jnp.asarray(cfg.local_layers)[layer], cfg.sliding_window, NO_WINDOW)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, beside: Weight | None = None) -> jax.Array:
    """HF's LlamaRMSNorm: normalise in float32, cast back, then scale. A norm beside a projection on the CPU kernel
    (feeding it or fed by it) runs on the kernels too: each row in one fixed order whatever the rows (XLA's fusions
    of a norm computed a row differently at different row counts), in one call where XLA needs a handful of fusions."""
    if beside is not None and on_kernel(beside) and x.dtype == jnp.float32:
        return cpu_kernel.rms_norm(x, weight, eps)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(row_sum(xf * xf)[..., None] / x.shape[-1] + eps)
    return weight * xf.astype(x.dtype)


Rotary = tuple[jax.Array, jax.Array]  # cos, sin: [..., T, 1, head_dim] float32
Rotaries = tuple[Rotary, Rotary]  # the global layers' and the local layers' (the same where they share a base)


def rotary(cfg: ModelConfig, positions: jax.Array) -> Rotaries:
    """RoPE's cos and sin at `positions` ([..., T] int32): computed once per step and shared by every layer, so that an
    unrolled step carries one copy (two where local layers have a base of their own), not two per layer."""

    def at(local: bool) -> Rotary:
        inv_freq = jnp.asarray(cfg.inv_freq(local))  # [head_dim // 2]
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, head_dim // 2]
        emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., T, 1, head_dim]
        # computed whole: otherwise XLA folds cos and sin into every layer's RoPE, once per head and per layer
        return jax.lax.optimization_barrier((jnp.cos(emb), jnp.sin(emb)))

    glob = at(False)
    return glob, (at(True) if cfg.local_rope_theta is not None else glob)


def rotary_at(cfg: ModelConfig, rots: Rotaries, layer: jax.Array | int) -> Rotary:
    """Layer `layer`'s RoPE (a Python index, or a traced one in a stacked walk)."""
    glob, local = rots
    if local is glob:
        return glob
    if isinstance(layer, int):
        return local if cfg.is_local(layer) else glob
    is_local = jnp.asarray(cfg.local_layers or (True,) * cfg.num_layers)[layer]
    return jax.tree_util.tree_map(lambda a, b: jnp.where(is_local, a, b), local, glob)


def rope(x: jax.Array, rot: Rotary) -> jax.Array:
    """Rotate-half RoPE. x: [..., T, heads, head_dim]; rot: `rotary` at x's positions."""
    cos, sin = rot
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def project(x: jax.Array, w: Weight, lora: LoraProj | None, adapters: jax.Array | None) -> jax.Array:
    """x @ w, plus each row's LoRA delta where the layer has adapters and the step gives each row's slot
    (adapters: [rows] int32 over x's leading axis)."""
    y = matmul(x, w)
    return y if lora is None or adapters is None else add_delta(y, lora, x, adapters, kernel=on_kernel(w))


def _lora(layer: LayerParams, name: str) -> LoraProj | None:
    return None if layer.lora is None else getattr(layer.lora, name)


def qkv_proj(cfg: ModelConfig, layer: LayerParams, x: jax.Array, rot: Rotary, adapters: jax.Array | None = None):
    """Norm, fused q/k/v projection and RoPE. x: [..., T, d] -> q [..., T, heads, hd], k/v [..., T, kv_heads, hd].
    adapters: each row's LoRA slot ([rows] over x's leading axis), or None."""
    h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps, beside=layer.wqkv)
    qkv = project(h, layer.wqkv, _lora(layer, "wqkv"), adapters)
    if layer.bqkv is not None:
        qkv = qkv + layer.bqkv
    lead = x.shape[:-1]
    q, k, v = split_fused(qkv, fused_sizes(cfg, "wqkv"), layer.shards)
    q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
    k, v = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim), v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    if layer.q_norm is not None:
        q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps, beside=layer.wqkv)
        k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps, beside=layer.wqkv)
    return rope(q, rot), rope(k, rot), v


def attn_out(cfg: ModelConfig, layer: LayerParams, x: jax.Array, o: jax.Array, adapters: jax.Array | None = None
             ) -> jax.Array:
    """The residual after attention: x + o @ wo (normed first with sandwich norms). o: [..., heads * head_dim]."""
    return x + _post_norm(cfg, project(o, layer.wo, _lora(layer, "wo"), adapters), layer.post_attn_norm, layer.wo)


def mlp_block(cfg: ModelConfig, layer: LayerParams, x: jax.Array, adapters: jax.Array | None = None) -> jax.Array:
    """Residual gated MLP: x + down(act(gate) * up), SwiGLU or GeGLU (tanh GELU)."""
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps, beside=layer.w_gate_up)
    gate_up = project(h, layer.w_gate_up, _lora(layer, "w_gate_up"), adapters)
    gate, up = split_fused(gate_up, fused_sizes(cfg, "w_gate_up"), layer.shards)
    act = jax.nn.silu(gate) if cfg.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
    down = project(act * up, layer.w_down, _lora(layer, "w_down"), adapters)
    return x + _post_norm(cfg, down, layer.post_mlp_norm, layer.w_down)


def _post_norm(cfg: ModelConfig, y: jax.Array, weight: jax.Array | None, fed_by: Weight) -> jax.Array:
    return y if weight is None else rms_norm(y, weight, cfg.rms_norm_eps, beside=fed_by)


def lm_logits(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    """Final norm and lm_head; float32 logits [..., vocab]."""
    head = params.embed if params.lm_head is None else params.lm_head
    h = rms_norm(x, params.final_norm, cfg.rms_norm_eps, beside=head)
    if params.lm_head is None:
        logits = matmul_transposed(h, params.embed)
    else:
        logits = matmul(h, params.lm_head)
    return softcap(logits.astype(jnp.float32), cfg.final_softcap)


@partial(jax.jit, static_argnames=("cfg",))
def forward_full(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """The oracle: a plain causal forward over a whole sequence, no cache. tokens [T] -> logits [T, vocab]."""
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)
    rots = rotary(cfg, positions)
    qpos, kpos = positions[:, None], positions[None, :]
    precision = precision_for(params.dtype)

    def body(i, layer: LayerParams, x):
        q, k, v = qkv_proj(cfg, layer, x, rotary_at(cfg, rots, i))
        q = q.reshape(t, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
        s = jnp.einsum("qkgd,skd->kgqs", q, k, preferred_element_type=jnp.float32, precision=precision)
        s = softcap(s / jnp.sqrt(cfg.head_dim) if cfg.query_scale is None else s * cfg.query_scale, cfg.attn_softcap)
        mask = kpos <= qpos  # [T, T]
        if (window := window_at(cfg, i)) is not None:
            mask &= kpos > qpos - window
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        o = jnp.einsum("kgqs,skd->qkgd", p.astype(v.dtype), v,
                       precision=precision).reshape(t, cfg.num_heads * cfg.head_dim)
        return mlp_block(cfg, layer, attn_out(cfg, layer, x, o))

    return lm_logits(cfg, params, over_layers(params, body, embed_tokens(cfg, params, tokens)))


def lora_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each checkpoint projection's (in, out), as a LoRA adapter's A and B must fit it."""
    return part_shapes(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim,
                       cfg.num_kv_heads * cfg.head_dim)


def with_lora(cfg: ModelConfig, params: Params, slots: int, rank: int) -> Params:
    """The params with zeroed LoRA stacks of `slots` slots of rank `rank` on every layer (model/lora.py)."""
    if any(layer.shards > 1 for layer in layer_list(params)):
        raise ValueError("LoRA adapters need weights on one device: a station split over several serves none")
    empty = empty_layer(lora_shapes(cfg), slots, rank)
    if isinstance(params.layers, tuple):
        return dataclasses.replace(params, layers=tuple(dataclasses.replace(layer, lora=empty)
                                                        for layer in params.layers))
    stacked = jax.tree_util.tree_map(lambda a: jnp.zeros((cfg.num_layers, *a.shape), a.dtype), empty)
    return dataclasses.replace(params, layers=dataclasses.replace(params.layers, lora=stacked))


def write_adapter(params: Params, slot: int, layers: list[dict]) -> Params:
    """The params with LoRA slot `slot` holding `layers` (one `lora.slot_arrays` per layer)."""
    if isinstance(params.layers, tuple):
        return dataclasses.replace(params, layers=tuple(
            dataclasses.replace(layer, lora=write_slot(layer.lora, np.int32(slot), arrays))
            for layer, arrays in zip(params.layers, layers, strict=True)))
    stacked = jax.tree_util.tree_map(lambda *a: np.stack(a), *layers)
    lora = write_slot(params.layers.lora, np.int32(slot), stacked)
    return dataclasses.replace(params, layers=dataclasses.replace(params.layers, lora=lora))


def layer_list(params: Params) -> tuple[LayerParams, ...]:
    """Each layer's weights ("unroll"), or the one stacked pytree ("scan")."""
    return params.layers if isinstance(params.layers, tuple) else (params.layers,)
