"""Checkpoint loaders: HF safetensors directories and GGUF files into our `Params` pytree.

Each format has an explicit name map. A tensor we do not know, a tensor that is missing, a tensor of the wrong shape
or a file that cannot be read raises `CheckpointError` naming it; nothing is guessed or silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxstation.kernels.cpu_kernel import BLOCK_FORMATS
from jaxstation.model import sharding
from jaxstation.model.choices import GGUF_WEIGHTS, WEIGHT_DTYPES
from jaxstation.model.config import ModelConfig
from jaxstation.model.gguf_file import GGUFFile, GGUFTensor
from jaxstation.model.gguf_tokenizer import check_gguf_tokenizer
from jaxstation.model.layers import Params, build_params
from jaxstation.model.quant import GGUFBlocks, Tensor
from jaxstation.model.source import CheckpointError, model_source
from jaxstation.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ4_NL", "IQ4_XS")
_MATRICES = ("embed", "lm_head", "q", "k", "v", "o", "gate", "up", "down")  # the slots a GGUF file may keep in blocks
_LAYER_SLOTS = ("attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down")
_BIAS_SLOTS = ("bq", "bk", "bv")  # ModelConfig.qkv_bias
_QK_NORM_SLOTS = ("q_norm", "k_norm")  # ModelConfig.qk_norm
_SANDWICH_SLOTS = ("post_attn_norm", "post_mlp_norm")  # ModelConfig.sandwich_norms
_NORMS = ("final_norm", "attn_norm", "mlp_norm") + _QK_NORM_SLOTS + _SANDWICH_SLOTS


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    cfg: ModelConfig
    params: Params
    tokenizer: Tokenizer
    source: Path


# Checkpoint name -> (layer index or None, our slot). HF tensors are [out, in]; GGUF arrays read as [out, in] too.
_HF_GLOBAL = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v", "self_attn.o_proj.weight": "o", "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
}
# Gemma names its four norms a layer after their place: its post-attention norm is not the MLP's input norm
_HF_SANDWICH_NAMES = {**_HF_LAYER_NAMES, "post_attention_layernorm.weight": "post_attn_norm",
                      "pre_feedforward_layernorm.weight": "mlp_norm",
                      "post_feedforward_layernorm.weight": "post_mlp_norm"}
_HF_SKIPPED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_GGUF_GLOBAL = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v",
    "attn_output.weight": "o", "ffn_norm.weight": "mlp_norm", "ffn_gate.weight": "gate", "ffn_up.weight": "up",
    "ffn_down.weight": "down", "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm", "post_attention_norm.weight": "post_attn_norm",
    "post_ffw_norm.weight": "post_mlp_norm",
}


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {
        "embed": (cfg.vocab_size, d), "final_norm": (d,), "lm_head": (cfg.vocab_size, d),
        "attn_norm": (d,), "q": (cfg.num_heads * hd, d), "k": (cfg.num_kv_heads * hd, d),
        "v": (cfg.num_kv_heads * hd, d), "o": (d, cfg.num_heads * hd), "mlp_norm": (d,), "gate": (f, d),
        "up": (f, d), "down": (d, f), "bq": (cfg.num_heads * hd,), "bk": (cfg.num_kv_heads * hd,),
        "bv": (cfg.num_kv_heads * hd,), "q_norm": (hd,), "k_norm": (hd,), "post_attn_norm": (d,),
        "post_mlp_norm": (d,),
    }


def _layer_slots(cfg: ModelConfig) -> tuple[str, ...]:
    """The tensors each layer of this architecture has."""
    return (_LAYER_SLOTS + (_BIAS_SLOTS if cfg.qkv_bias else ()) + (_QK_NORM_SLOTS if cfg.qk_norm else ())
            + (_SANDWICH_SLOTS if cfg.sandwich_norms else ()))


def _map_name(name: str, globals_: Mapping[str, str], layer_re: re.Pattern, layer_names: Mapping[str, str],
              num_layers: int) -> tuple[int | None, str]:
    if name in globals_:
        return None, globals_[name]
    m = layer_re.fullmatch(name)
    if m and m.group(2) in layer_names and int(m.group(1)) < num_layers:
        return int(m.group(1)), layer_names[m.group(2)]
    raise CheckpointError(f"unknown tensor {name!r}: not part of a {num_layers}-layer checkpoint of a served family")


def _assemble(cfg: ModelConfig, tensors: Mapping[tuple[int | None, str], Tensor], names: Mapping, weights: str,
              layer_loop: str, source: str, matmul: str, shards: int = 1) -> tuple[ModelConfig, Params]:
    """Check every tensor's presence and shape, then build the Params (`model.build_params`) for `shards` devices:
    the config they are built for (its KV heads replicated where a split needs it), and the Params."""
    shapes = _expected_shapes(cfg)
    required = [(None, "embed"), (None, "final_norm")] + [
        (i, s) for i in range(cfg.num_layers) for s in _layer_slots(cfg)]
    if not cfg.tie_word_embeddings:
        required.append((None, "lm_head"))
    for key in required:
        if key not in tensors:
            raise CheckpointError(f"missing tensor {names[key]!r} in {source}")
    for key in tensors.keys() - set(required):
        raise CheckpointError(f"unexpected tensor {names[key]!r} in {source}: this architecture's layers have none")
    for key, arr in tensors.items():
        if tuple(arr.shape) != shapes[key[1]]:
            raise CheckpointError(
                f"tensor {names[key]!r} in {source} has shape {tuple(arr.shape)}, expected {shapes[key[1]]}"
            )

    cfg, tensors = _replicate_kv(cfg, tensors, shards)
    return cfg, build_params(cfg, lambda layer, slot: tensors[layer, slot], weights, layer_loop, matmul, shards)


def _replicate_kv(cfg: ModelConfig, tensors: Mapping[tuple[int | None, str], Tensor], shards: int
                  ) -> tuple[ModelConfig, Mapping[tuple[int | None, str], Tensor]]:
    """With fewer KV heads than `shards` devices: each KV head's k and v rows (and biases) repeated
    `sharding.kv_replicas` times, and the config's KV heads with them (`sharding.replicated_kv`)."""
    copies = sharding.kv_replicas(cfg, shards)
    if copies == 1:
        return cfg, tensors

    def repeat(arr: Tensor) -> np.ndarray:  # [kv * head_dim, ...] -> [kv * copies * head_dim, ...]
        w = arr.dequantize() if isinstance(arr, GGUFBlocks) else np.asarray(arr)
        heads = w.reshape(cfg.num_kv_heads, cfg.head_dim, *w.shape[1:])
        return np.repeat(heads, copies, axis=0).reshape(-1, *w.shape[1:])

    out = {key: repeat(arr) if key[1] in ("k", "v", "bk", "bv") else arr for key, arr in tensors.items()}
    return sharding.replicated_kv(cfg, shards), out


def load_hf_dir(path: Path, dtype: str = "float32", layer_loop: str = "scan", matmul: str = "xla", shards: int = 1
                ) -> tuple[ModelConfig, Params]:
    """An HF directory: config.json plus model.safetensors, or shards listed in model.safetensors.index.json."""
    from safetensors import safe_open

    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"missing file {config_path}")
    cfg = hf_config(config_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"missing file {path / 'model.safetensors'} (and no model.safetensors.index.json)")
    tensors: dict[tuple[int | None, str], np.ndarray] = {}
    layer_names = _HF_SANDWICH_NAMES if cfg.sandwich_norms else _HF_LAYER_NAMES
    names = {k: _hf_name(k, layer_names) for k in _all_keys(cfg) if k[0] is None or k[1] in layer_names.values()}
    for fname in files:
        fpath = path / fname
        if not fpath.is_file():
            raise CheckpointError(f"missing shard file {fpath}")
        try:
            with safe_open(str(fpath), framework="numpy") as f:
                for name in f.keys():
                    if _HF_SKIPPED.fullmatch(name):
                        continue
                    key = _map_name(name, _HF_GLOBAL, _HF_LAYER, layer_names, cfg.num_layers)
                    tensors[key] = np.asarray(f.get_tensor(name), np.float32)
                    if key[1] in _NORMS and cfg.norm_offset:  # (GGUF files store them with the offset added)
                        tensors[key] = tensors[key] + np.float32(cfg.norm_offset)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise CheckpointError(f"cannot read safetensors file {fpath}: {e}") from e
    if cfg.tie_word_embeddings:
        tensors.pop((None, "lm_head"), None)
    return _assemble(cfg, tensors, names, dtype, layer_loop, str(path), matmul, shards)


def _all_keys(cfg: ModelConfig) -> list[tuple[int | None, str]]:
    """Every key a checkpoint's names may map to (what `_assemble` then requires or refuses)."""
    return [(None, s) for s in ("embed", "final_norm", "lm_head")] + [
        (i, s) for i in range(cfg.num_layers) for s in _LAYER_SLOTS + _BIAS_SLOTS + _QK_NORM_SLOTS + _SANDWICH_SLOTS]


def _hf_name(key: tuple[int | None, str], layer_names: Mapping[str, str]) -> str:
    layer, slot = key
    if layer is None:
        return next(n for n, s in _HF_GLOBAL.items() if s == slot)
    return f"model.layers.{layer}." + next(n for n, s in layer_names.items() if s == slot)


def _gguf_name(key: tuple[int | None, str]) -> str:
    layer, slot = key
    if layer is None:
        return next(n for n, s in _GGUF_GLOBAL.items() if s == slot)
    return f"blk.{layer}." + next(n for n, s in _GGUF_LAYER_NAMES.items() if s == slot)


def unpermute_rope(w: Tensor, n_heads: int) -> Tensor:
    """llama.cpp stores a `llama` model's q/k rows interleaved for its pairwise RoPE (other architectures keep HF's
    order and rotate halves); restore HF's rotate-half row order (of a dense matrix, or of the rows of its blocks)."""
    if isinstance(w, GGUFBlocks):
        return dataclasses.replace(w, data=unpermute_rope(w.data, n_heads))
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    """The config a GGUF file's metadata declares (the vocabulary from its token list, tied unless it has an output
    tensor)."""
    meta = reader.fields
    try:
        return ModelConfig.from_gguf(meta, vocab_size=len(meta.get("tokenizer.ggml.tokens", [])),
                                     tied="output.weight" not in {t.name for t in reader.tensors})
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path} is not a GGUF checkpoint of a served family: {e}") from None


def hf_config(path: Path) -> ModelConfig:
    """The config an HF directory's config.json declares."""
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except KeyError as e:
        raise CheckpointError(f"{path} has no field {e}") from None
    except ValueError as e:  # JSONDecodeError, or a config that is not a served family's
        raise CheckpointError(f"{path}: {e}") from None


def served_type(tensor: GGUFTensor, path: Path) -> GGMLQuantizationType:
    """The tensor's GGUF type, if the loader reads it."""
    from gguf import GGMLQuantizationType

    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype.name not in GGUF_TYPES:
        raise CheckpointError(f"tensor {tensor.name!r} in {path} has unsupported GGUF type {qtype.name}; supported: "
                              f"{', '.join(GGUF_TYPES)}")
    return qtype


def tokenizer_of(source: Path, fields: Mapping | None = None) -> Tokenizer:
    """The tokenizer of an HF directory, or of a GGUF file (from its metadata `fields`, read here if None)."""
    try:
        if source.is_dir():
            return Tokenizer.from_hf_dir(source)
        return Tokenizer.from_gguf(open_gguf(source).fields if fields is None else fields)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


def open_gguf(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (OSError, ValueError) as e:  # GGUFError (not GGUF, truncated), or empty (numpy cannot map 0 bytes)
        raise CheckpointError(f"cannot read GGUF file {path}: {e}") from e


def load_gguf(path: Path, dtype: str = "float32", reader: GGUFFile | None = None, layer_loop: str = "scan",
              matmul: str = "xla", shards: int = 1) -> tuple[ModelConfig, Params]:
    """A GGUF file: config from metadata, tensors dequantized with the gguf package; with dtype "gguf" or
    "gguf-exact", matrices in a block format the CPU kernel reads stay in their blocks (`quant.GGUFBlocks`)."""
    from gguf import dequantize

    reader = reader or open_gguf(path)
    cfg = gguf_config(reader, path)
    tensors: dict[tuple[int | None, str], Tensor] = {}
    names: dict[tuple[int | None, str], str] = {k: _gguf_name(k) for k in _all_keys(cfg)}
    interleaved = reader.fields.get("general.architecture") == "llama"  # its converter permuted q/k rows (see above)
    for t in reader.tensors:
        key = _map_name(t.name, _GGUF_GLOBAL, _GGUF_LAYER, _GGUF_LAYER_NAMES, cfg.num_layers)
        qtype = served_type(t, path)
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml dims are [in, out]
        if dtype in GGUF_WEIGHTS and qtype.name in BLOCK_FORMATS and key[1] in _MATRICES and len(shape) == 2:
            arr: Tensor = GGUFBlocks(np.asarray(t.data).reshape(shape[0], -1), qtype.name, shape)
        else:
            try:
                arr = np.asarray(dequantize(t.data, qtype), np.float32).reshape(shape)
            except Exception as e:
                raise CheckpointError(f"cannot dequantize tensor {t.name!r} ({qtype.name}) in {path}: {e}") from e
            if np.may_share_memory(arr, t.data):  # an F32 tensor is the file's bytes: a device array made from it
                arr = arr.copy()  # may alias them and so keep the whole file mapped, and resident, while it lives
        if interleaved and key[1] in ("q", "k") and arr.shape == _expected_shapes(cfg)[key[1]]:
            arr = unpermute_rope(arr, cfg.num_heads if key[1] == "q" else cfg.num_kv_heads)
        tensors[key] = arr
    return _assemble(cfg, tensors, names, dtype, layer_loop, str(path), matmul, shards)


def load_model(path: str | Path | None = None, dtype: str = "float32", layer_loop: str = "scan",
               matmul: str = "xla", shards: int = 1) -> LoadedModel:
    """Load a model and its tokenizer: an HF directory, a .gguf file, or (None) the embedded default model.

    dtype: the weights' dtype, one of `choices.WEIGHT_DTYPES` (int8 quantizes every projection at load);
    layer_loop: the per-layer weight layout, one of `choices.LAYER_LOOPS`;
    matmul: "xla" or "kernel" (the CPU kernel, `choices.MATMULS`);
    shards: the devices the weights will be split over (`sharding.shard_major`; `sharding.shard_params` places them).
    """
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype!r}")
    source = model_source(path)
    if source.is_dir():
        cfg, params = load_hf_dir(source, dtype, layer_loop, matmul, shards)
        tokenizer = tokenizer_of(source)
    else:
        reader = open_gguf(source)
        cfg, params = load_gguf(source, dtype, reader, layer_loop, matmul, shards)
        tokenizer = tokenizer_of(source, reader.fields)
    return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, source=source)


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint (as `load_model`'s), read without its tensors."""
    return tokenizer_of(model_source(path))


def checkpoint_config(path: str | Path | None) -> ModelConfig:
    """The config a checkpoint declares, read without loading its tensors: what `serve` checks before it listens.
    Raises CheckpointError for a path that is not a checkpoint, a file that is not GGUF, an unreadable config, and
    for a GGUF file a tensor of a type or a tokenizer model that is not served."""
    source = model_source(path)
    if source.is_dir():
        return hf_config(source / "config.json")
    reader = open_gguf(source)
    for t in reader.tensors:
        served_type(t, source)
    try:
        check_gguf_tokenizer(reader.fields)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    return gguf_config(reader, source)


def checkpoint_weight_bytes(path: str | Path | None, dtype: str) -> int | None:
    """Bytes a GGUF file's weights take once loaded as `dtype` "gguf" or "gguf-exact", read without its tensors: a
    matrix in a block format the kernel reads as its blocks, anything else dequantized to float32 (an upper bound
    where a matrix's shape does not fit the kernel). None for other checkpoints and weight formats."""
    source = model_source(path)
    if dtype not in GGUF_WEIGHTS or source.is_dir():
        return None
    total = 0
    for t in open_gguf(source).tensors:
        blocks = served_type(t, source).name in BLOCK_FORMATS and len(t.shape) == 2
        total += t.data.nbytes if blocks else int(np.prod(t.shape, dtype=np.int64)) * 4
    return total
