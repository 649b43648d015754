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
               "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                   "gemma3_text": "gemma3"}
SUPPORTED_HF_ARCHITECTURES = tuple(HF_FAMILIES)
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
ACTIVATIONS = ("silu", "gelu_tanh")
_HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
NO_WINDOW = 1 << 30  # a global layer's window where a step needs one number per layer

# HF config.json fields that do not change the forward pass we compute: the one list of them (docs/models.md), by
# kind. Every other field is read (`_HF_USED_KEYS`) or refused by name.
HF_IGNORED_FIELDS = frozenset().union(
    # names, versions and provenance
    {"_name_or_path", "_model_name_or_path", "_commit_hash", "architectures", "model_type", "transformers_version",
     "unsloth_version", "unsloth_fixed"},
    # the dtype the weights were saved in (the station casts them to its own); a quantization's tensors are refused
    # by name at load
    {"torch_dtype", "dtype", "use_bfloat16", "quantization_config"},
    # ids and spellings of special tokens, which the tokenizer defines
    {"bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "mask_token_id", "cls_token_id",
     "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id", "sep_token"},
    # training and runtime switches: initialisation, dropout, the KV cache, extra outputs, attention backends
    {"initializer_range", "pretraining_tp", "attention_dropout", "use_cache", "cache_implementation",
     "output_attentions", "output_hidden_states", "return_dict", "torchscript", "tf_legacy_loss", "pruned_heads",
     "chunk_size", "chunk_size_feed_forward", "_attn_implementation", "_attn_implementation_autoset",
     "attn_implementation"},
    # generation defaults (each request carries its own)
    {"max_length", "min_length", "do_sample", "num_beams", "temperature", "top_k", "top_p", "repetition_penalty",
     "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
     "num_return_sequences", "output_scores", "return_dict_in_generate", "remove_invalid_values",
     "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "early_stopping",
     "diversity_penalty", "num_beam_groups", "typical_p"},
    # other model classes' heads and encoder-decoder settings, task metadata
    {"is_decoder", "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size", "is_encoder_decoder",
     "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params", "prefix", "tokenizer_class"},
    # restated by a field that is read: Qwen's windowed layers by use_sliding_window, Gemma's pattern by layer_types
    {"max_window_layers", "_sliding_window_pattern", "sliding_window_pattern"},
)
_HF_USED_KEYS = frozenset(
    {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
        "max_position_embeddings", "tie_word_embeddings", "sliding_window", "hidden_act", "attention_bias",
        "mlp_bias", "layer_types", "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
        "final_logit_softcapping", "use_bidirectional_attention", "rope_local_base_freq", "use_sliding_window",
    }
)


def _cap(value: Any) -> float | None:
    return float(value) if value else None


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
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head's q and k (weights [head_dim]) before RoPE
    # Gemma 2 and 3:
    local_layers: tuple[bool, ...] = ()  # the layers sliding_window and local_rope_theta apply to; (): every layer
    local_rope_theta: float | None = None  # Gemma 3: the local layers' RoPE base (rope_theta is the global ones')
    rope_linear_factor: float | None = None  # linear RoPE scaling of the global layers' positions
    hidden_act: str = "silu"  # the MLP's gate: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: float | None = None  # embeddings times this (sqrt(hidden_size)); a tied head reads them unscaled
    sandwich_norms: bool = False  # an RMSNorm on the attention's and the MLP's output too, before each residual add
    query_scale: float | None = None  # the scores' scale (query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap), before the mask
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    norm_offset: float = 0.0  # HF stores Gemma's norm weights as w - 1 (it scales by 1 + w): its loader adds this

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
        if self.local_layers and len(self.local_layers) != self.num_layers:
            raise ValueError(f"local_layers names {len(self.local_layers)} layers, the model has {self.num_layers}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")

    def is_local(self, layer: int) -> bool:
        """Whether the sliding window (if any) and the local RoPE base apply to this layer."""
        return not self.local_layers or self.local_layers[layer]

    def window(self, layer: int) -> int | None:
        """The sliding window of this layer, or None."""
        return self.sliding_window if self.is_local(layer) else None

    def layers(self, start: int, stop: int) -> ModelConfig:
        """The config of layers [start, stop) alone (a mesh station's)."""
        return dataclasses.replace(self, num_layers=stop - start, local_layers=self.local_layers[start:stop])

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def inv_freq(self, local: bool = False) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2], float32, as HF computes them (Llama-3 or linear scaling
        included), of the global layers or (`local`) of the local layers where they have a base of their own."""
        exponents = np.arange(0, self.head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(self.head_dim)
        if local and self.local_rope_theta is not None:
            return (1.0 / (np.float32(self.local_rope_theta) ** exponents)).astype(np.float32)
        inv = (1.0 / (np.float32(self.rope_theta) ** exponents)).astype(np.float32)
        if self.rope_linear_factor is not None:
            return (inv / np.float32(self.rope_linear_factor)).astype(np.float32)
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
        family = next((HF_FAMILIES[a] for a in archs if a in HF_FAMILIES), _HF_MODEL_TYPES.get(model_type))
        if family is None:
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}: "
                f"jaxstation serves {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
            )
        gemma = family in ("gemma2", "gemma3")
        if family in ("qwen2", "qwen3") and config.get("use_sliding_window"):
            raise ValueError("unsupported config field use_sliding_window=true: a window on some layers only "
                             "(max_window_layers) is not implemented")
        unknown = sorted(k for k in config if k not in HF_IGNORED_FIELDS and k not in _HF_USED_KEYS)
        if unknown:
            raise ValueError(f"unsupported config field(s) {unknown} in config.json")
        act_key = "hidden_activation" if gemma else "hidden_act"
        act = _HF_ACTIVATIONS.get(config.get(act_key, "gelu_pytorch_tanh" if gemma else "silu"))
        if act is None:
            raise ValueError(f"unsupported config field {act_key}={config[act_key]!r}: served are "
                             f"{', '.join(_HF_ACTIVATIONS)}")
        for flag in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
            if config.get(flag):
                raise ValueError(f"unsupported config field {flag}=true: not implemented")
        layer_types = list(config.get("layer_types") or ["full_attention"] * int(config["num_hidden_layers"]))
        if set(layer_types) - {"full_attention", "sliding_attention"} or (not gemma and len(set(layer_types)) > 1):
            raise ValueError(f"unsupported config field layer_types={layer_types}")
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        local_rope = rope.pop("sliding_attention", None)  # Gemma 3: a RoPE per layer type
        rope = rope.pop("full_attention", rope)
        rope_theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported config field rope_scaling.rope_type={rope_type!r}")
        if local_rope is not None and local_rope.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported config field rope_parameters.sliding_attention={local_rope}")
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
        head_dim = int(config.get("head_dim") or hidden // heads)
        window = config.get("sliding_window")
        if config.get("use_sliding_window") is False or family in ("qwen2", "qwen3"):
            window = None
        local_theta = config.get("rope_local_base_freq", (local_rope or {}).get("rope_theta"))
        scalar = config.get("query_pre_attn_scalar")
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma)),
            rope_scaling=scaling,
            sliding_window=int(window) if window else None,
            qkv_bias=family == "qwen2",
            qk_norm=family in ("qwen3", "gemma3"),
            local_layers=tuple(t == "sliding_attention" for t in layer_types) if gemma else (),
            local_rope_theta=float(local_theta) if gemma and local_theta is not None else None,
            rope_linear_factor=float(rope["factor"]) if rope_type == "linear" else None,
            hidden_act=act,
            embed_scale=float(np.float32(hidden ** 0.5)) if gemma else None,
            sandwich_norms=gemma,
            query_scale=float(scalar) ** -0.5 if gemma and scalar is not None else None,
            attn_softcap=_cap(config.get("attn_logit_softcapping")),
            final_softcap=_cap(config.get("final_logit_softcapping")),
            norm_offset=1.0 if gemma else 0.0,
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
        if scaling_type not in ("none", "linear"):
            raise ValueError(f"unsupported GGUF metadata {arch}.rope.scaling.type={scaling_type!r}")
        window = meta.get(f"{arch}.attention.sliding_window")
        layers = int(need("block_count"))
        gemma = arch in ("gemma2", "gemma3")
        local_layers: tuple[bool, ...] = ()
        scale = meta.get(f"{arch}.attention.scale")
        if gemma:  # llama.cpp's defaults: local layers alternate (gemma2) or 5 of every 6 (gemma3); the 27B models
            # (46 and 62 layers) scale scores by hidden / heads, the others by head_dim
            pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
            local_layers = (tuple(bool(b) for b in pattern) if isinstance(pattern, (list, tuple))
                            else tuple(i % int(pattern) < int(pattern) - 1 for i in range(layers)))
            if scale is None:
                scale = (hidden / heads if layers in (46, 62) else head_dim) ** -0.5
        return cls(
            vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_size)),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position=int(need("context_length")),
            tie_word_embeddings=tied,
            sliding_window=int(window) if window else None,
            qkv_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "gemma3"),
            local_layers=local_layers,
            local_rope_theta=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
            rope_linear_factor=float(need("rope.scaling.factor")) if scaling_type == "linear" else None,
            hidden_act="gelu_tanh" if gemma else "silu",
            embed_scale=float(np.float32(hidden ** 0.5)) if gemma else None,
            sandwich_norms=gemma,
            query_scale=float(scale) if scale is not None else None,
            attn_softcap=_cap(meta.get(f"{arch}.attn_logit_softcapping")),
            final_softcap=_cap(meta.get(f"{arch}.final_logit_softcapping")),
        )


jax.tree_util.register_static(ModelConfig)
