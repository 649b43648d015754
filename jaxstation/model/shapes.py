"""Named real architectures with random weights: benchmarks and device checks at real shapes without a checkpoint.

The weights are drawn on the device, in the layout and dtype a loaded model would have, so a 7B-shaped model needs
no host memory or transfer. Random weights give meaningless tokens but real bytes, FLOPs and memory.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jaxstation.model.config import ModelConfig
from jaxstation.model.layers import LayerParams, Params, compute_dtype
from jaxstation.model.loader import LoadedModel
from jaxstation.model.quant import prepare_embedding, prepare_weight
from jaxstation.model.sharding import make_mesh, shard_params

ARCHITECTURES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                                max_position=8192, tie_word_embeddings=True),
    "qwen3-0.6b": ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                              max_position=40960, tie_word_embeddings=True, qk_norm=True),
    "mistral-7b": ModelConfig(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1e6,
                              max_position=32768, tie_word_embeddings=False),
    "llama3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                             max_position=8192, tie_word_embeddings=False),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                              max_position=32768, tie_word_embeddings=False, qkv_bias=True),
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                            max_position=40960, tie_word_embeddings=False, qk_norm=True),
    "gemma-3-4b": ModelConfig(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34,
                              num_heads=8, num_kv_heads=4, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e6,
                              max_position=131072, tie_word_embeddings=True, sliding_window=1024, qk_norm=True,
                              local_layers=tuple(i % 6 != 5 for i in range(34)), local_rope_theta=10000.0,
                              rope_linear_factor=8.0, hidden_act="gelu_tanh", embed_scale=float(2560 ** 0.5),
                              sandwich_norms=True, query_scale=256 ** -0.5, norm_offset=1.0),
}


def random_params(cfg: ModelConfig, weights: str = "bfloat16", layer_loop: str = "scan", seed: int = 0,
                  matmul: str = "xla", shards: int = 1) -> Params:
    """N(0, 0.02) weights and unit norms at cfg's shapes, drawn on the default device; with shards > 1, taken as laid
    out for that many devices (random weights have no other order) and placed on a mesh of them."""
    dtype = compute_dtype(weights)
    d, f = cfg.hidden_size, cfg.intermediate_size
    key = iter(jax.random.split(jax.random.PRNGKey(seed), 8 * cfg.num_layers + 8))

    def normal(shape: tuple[int, ...]) -> jax.Array:
        return (0.02 * jax.random.normal(next(key), shape, jnp.float32)).astype(dtype)

    def proj(shape: tuple[int, ...]):  # [..., in, out]
        return prepare_weight(normal(shape), weights, matmul)

    def layer(lead: tuple[int, ...]) -> LayerParams:
        hd = cfg.head_dim
        return LayerParams(attn_norm=jnp.ones((*lead, d), dtype), wqkv=proj((*lead, d, cfg.qkv_size)),
                           wo=proj((*lead, cfg.num_heads * hd, d)), mlp_norm=jnp.ones((*lead, d), dtype),
                           w_gate_up=proj((*lead, d, 2 * f)), w_down=proj((*lead, f, d)),
                           bqkv=normal((*lead, cfg.qkv_size)) if cfg.qkv_bias else None,
                           q_norm=jnp.ones((*lead, hd), dtype) if cfg.qk_norm else None,
                           k_norm=jnp.ones((*lead, hd), dtype) if cfg.qk_norm else None,
                           post_attn_norm=jnp.ones((*lead, d), dtype) if cfg.sandwich_norms else None,
                           post_mlp_norm=jnp.ones((*lead, d), dtype) if cfg.sandwich_norms else None, shards=shards)

    layers = (tuple(layer(()) for _ in range(cfg.num_layers)) if layer_loop == "unroll"
              else layer((cfg.num_layers,)))
    embed = prepare_embedding(normal((cfg.vocab_size, d)), weights, matmul, cfg.tie_word_embeddings)
    lm_head = None if cfg.tie_word_embeddings else proj((d, cfg.vocab_size))
    params = Params(embed=embed, layers=layers, final_norm=jnp.ones((d,), dtype), lm_head=lm_head)
    return params if shards == 1 else shard_params(params, make_mesh(shards))


def random_model(name: str, weights: str = "bfloat16", layer_loop: str = "scan", seed: int = 0,
                 matmul: str = "xla", shards: int = 1) -> LoadedModel:
    """A LoadedModel (no tokenizer) of the named architecture with random weights."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(ARCHITECTURES)}")
    cfg = ARCHITECTURES[name]
    return LoadedModel(cfg=cfg, params=random_params(cfg, weights, layer_loop, seed, matmul, shards), tokenizer=None,
                       source=Path(f"random:{name}"))
