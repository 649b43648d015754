"""The model's architecture as one frozen, hashable dataclass, read from an HF config.json or from GGUF metadata.

It is registered as a static pytree node, so compiled steps take it as a compile-time constant.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

# The family of each served architecture: what its layers add to the Llama layer (`ModelConfig.family`).
HF_FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}
SUPPORTED_HF_ARCHITECTURES = tuple(HF_FAMILIES)
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3")

# HF config keys that do not change the forward pass we compute (bookkeeping, generation defaults, dtypes).
_HF_IGNORED_KEYS = frozenset(
    {
        "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
        "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "pretraining_tp",
        "attention_dropout", "output_attentions", "output_hidden_states", "return_dict", "is_decoder",
        "tie_encoder_decoder", "chunk_size_feed_forward", "id2label", "label2id", "problem_type",
        "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
        "finetuning_task", "torchscript", "max_length", "min_length", "do_sample", "num_beams",
        "temperature", "top_k", "top_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
        "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
        "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
        "suppress_tokens", "begin_suppress_tokens", "add_cross_attention", "cross_attention_hidden_size",
        "is_encoder_decoder", "early_stopping", "diversity_penalty", "num_beam_groups", "typical_p",
        "encoder_no_repeat_ngram_size", "tf_legacy_loss", "use_bfloat16", "pruned_heads", "chunk_size",
        "quantization_config", "max_window_layers", "use_sliding_window", "layer_types", "sep_token",
    }
)
_HF_USED_KEYS = frozenset(
    {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
        "max_position_embeddings", "tie_word_embeddings", "sliding_window", "hidden_act", "attention_bias",
        "mlp_bias",
    }
)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    qkv_bias: bool = False  # Qwen2: a bias on the q, k and v projections
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k (weights [head_dim]) before RoPE

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config field {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2], float32, as HF computes them (Llama-3 scaling included)."""
        exponents = np.arange(0, self.head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(self.head_dim)
        inv = (1.0 / (np.float32(self.rope_theta) ** exponents)).astype(np.float32)
        s = self.rope_scaling
        if s is None:
            return inv
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build from an HF config.json dict; refuse architectures and fields we do not implement."""
        archs = config.get("architectures") or []
        model_type = config.get("model_type")
        family = next((HF_FAMILIES[a] for a in archs if a in HF_FAMILIES), None)
        if family is None and model_type in HF_FAMILIES.values():
            family = model_type
        if family is None:
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}: "
                f"jaxstation serves {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
            )
        if family in ("qwen2", "qwen3") and config.get("use_sliding_window"):
            raise ValueError("unsupported config field use_sliding_window=true: a window on some layers only "
                             "(max_window_layers) is not implemented")
        unknown = sorted(k for k in config if k not in _HF_IGNORED_KEYS and k not in _HF_USED_KEYS)
        if unknown:
            raise ValueError(f"unsupported config field(s) {unknown} in config.json")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported config field hidden_act={config['hidden_act']!r}: only 'silu' is served")
        for flag in ("attention_bias", "mlp_bias"):
            if config.get(flag):
                raise ValueError(f"unsupported config field {flag}=true: biases are not implemented")
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported config field rope_scaling.rope_type={rope_type!r}")
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position=int(rope["original_max_position_embeddings"]),
            )
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        window = config.get("sliding_window")
        if config.get("use_sliding_window") is False or family in ("qwen2", "qwen3"):
            window = None
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            sliding_window=int(window) if window else None,
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
        )

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], vocab_size: int, tied: bool) -> ModelConfig:
        """Build from GGUF metadata (`meta` maps keys to decoded values)."""
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}: served are {SUPPORTED_GGUF_ARCHITECTURES}")

        def need(key: str) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                raise ValueError(f"GGUF metadata key {full} is missing")
            return meta[full]

        heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
        for key in ("attention.value_length", "rope.dimension_count"):
            if int(meta.get(f"{arch}.{key}", head_dim)) != head_dim:
                raise ValueError(f"unsupported GGUF metadata {arch}.{key}={meta[f'{arch}.{key}']}: it must equal the "
                                 f"head dimension ({head_dim}; partial RoPE or unequal k/v heads)")
        scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
        if scaling_type not in ("none",):
            raise ValueError(f"unsupported GGUF metadata {arch}.rope.scaling.type={scaling_type!r}")
        window = meta.get(f"{arch}.attention.sliding_window")
        return cls(
            vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_size)),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position=int(need("context_length")),
            tie_word_embeddings=tied,
            sliding_window=int(window) if window else None,
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
        )


jax.tree_util.register_static(ModelConfig)


@dataclasses.dataclass(frozen=True)
class LayerRange:
    """Layers [start, stop) of a model: what one mesh station holds."""

    start: int
    stop: int

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        """'A:B' -> layers [A, B)."""
        a, sep, b = text.partition(":")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit():
            raise ValueError(f"a layer range is 'A:B' with integers 0 <= A < B, got {text!r}")
        r = cls(int(a), int(b))
        if r.start >= r.stop:
            raise ValueError(f"a layer range is 'A:B' with A < B, got {text!r}")
        return r

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"
