"""LoRA adapter files: PEFT directories and llama.cpp's GGUF LoRA files, read into per-layer (A, B) pairs.

A PEFT directory holds adapter_config.json (`r`, `lora_alpha`, `target_modules`, `use_rslora`) and
adapter_model.safetensors (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`, [r, in], and `lora_B`,
[out, r]). A GGUF LoRA file (`general.type = adapter`) holds `blk.N.attn_q.weight.lora_a` ([r, in] read as numpy)
and `.lora_b` ([out, r]) with `adapter.lora.alpha`; for a `llama` file, llama.cpp's converter permuted q/k rows for
its pairwise RoPE, so B's q/k rows are put back in HF's order, as the model loader does for the weights.

The scale (alpha / r; alpha / sqrt(r) with rsLoRA; 1 for a GGUF file without alpha) is folded into B. Whatever would
make the adapter compute something other than its file's W + scale * B A on this base is refused in one line that
names the file, the tensor (or config field) and the reason: a shape that does not fit, a module that is not one of
the seven projections, another architecture, a rank above the station's limit, DoRA, per-module ranks, extra
trained modules.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxstation.model.config import ModelConfig
from jaxstation.model.layers import lora_shapes
from jaxstation.model.loader import CheckpointError, open_gguf, unpermute_rope
from jaxstation.model.lora import slot_arrays

PEFT_MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
                "down_proj": "down"}
GGUF_MODULES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
                "ffn_down": "down"}
_PEFT_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_GGUF_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")


class AdapterError(CheckpointError):
    """An adapter file that does not fit the base model; the message names the file, the tensor and the reason."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    """An adapter read for one base: per layer, checkpoint slot -> (A [r, in], B [out, r] with the scale folded in)."""

    source: Path
    rank: int
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]]

    def slots(self, cfg: ModelConfig, rank: int) -> list[dict]:
        """Its arrays for one LoRA slot of a station of rank `rank`, per layer (`lora.slot_arrays`)."""
        return [slot_arrays(layer, lora_shapes(cfg), rank) for layer in self.layers]


def gguf_architecture(cfg: ModelConfig) -> str:
    """The `general.architecture` llama.cpp writes for a model of this config (Mistral converts as llama)."""
    if cfg.qkv_bias:
        return "qwen2"
    if cfg.sandwich_norms:
        return "gemma3" if cfg.qk_norm else "gemma2"
    return "qwen3" if cfg.qk_norm else "llama"


def read_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> Adapter:
    """A PEFT directory or a GGUF LoRA file, checked against the base's `cfg` and the station's `max_rank`."""
    source = Path(path)
    if source.is_dir():
        return _read_peft(source, cfg, max_rank)
    if source.suffix == ".gguf" and source.is_file():
        return _read_gguf(source, cfg, max_rank)
    raise AdapterError(f"{source}: neither a PEFT directory (adapter_config.json, adapter_model.safetensors) nor a "
                       ".gguf file")


def _read_peft(source: Path, cfg: ModelConfig, max_rank: int) -> Adapter:
    from safetensors import safe_open

    config_path, weights_path = source / "adapter_config.json", source / "adapter_model.safetensors"
    for f in (config_path, weights_path):
        if not f.is_file():
            raise AdapterError(f"{f}: missing (a PEFT adapter directory holds adapter_config.json and "
                               "adapter_model.safetensors)")
    try:
        conf = json.loads(config_path.read_text())
        rank, alpha = int(conf["r"]), float(conf["lora_alpha"])
    except (ValueError, KeyError, TypeError) as e:
        raise AdapterError(f"{config_path}: field {e}: cannot read r and lora_alpha") from None

    def refuse(field: str, reason: str) -> AdapterError:
        return AdapterError(f"{config_path}: field {field!r}: {reason}")

    if conf.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", f"{conf['peft_type']!r} is not LORA")
    if rank > max_rank or rank < 1:
        raise refuse("r", f"rank {rank} is outside [1, --max-lora-rank {max_rank}]")
    for field in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform", "lora_bias",
                  "layer_replication", "target_parameters", "trainable_token_indices", "alora_invocation_tokens"):
        if conf.get(field):
            raise refuse(field, f"{conf[field]!r} is not served (plain LoRA on the seven projections only)")
    if conf.get("bias", "none") != "none":
        raise refuse("bias", f"{conf['bias']!r}: trained biases are not served")
    targets = conf.get("target_modules") or []
    if isinstance(targets, list):
        for t in targets:
            if t not in PEFT_MODULES:
                raise refuse("target_modules", f"unknown target module {t!r}; served: {', '.join(PEFT_MODULES)}")
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, tuple[str, np.ndarray]]] = {}
    try:
        with safe_open(str(weights_path), framework="numpy") as f:
            for name in f.keys():
                m = _PEFT_TENSOR.fullmatch(name)
                if m is None or m.group(2) not in PEFT_MODULES:
                    module = m.group(2) if m else name
                    raise AdapterError(f"{weights_path}: tensor {name!r}: unknown target module {module!r}; served: "
                                       f"{', '.join(PEFT_MODULES)} of model.layers.N")
                key = (int(m.group(1)), PEFT_MODULES[m.group(2)])
                pairs.setdefault(key, {})[m.group(3)] = (name, np.asarray(f.get_tensor(name), np.float32))
    except AdapterError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise AdapterError(f"{weights_path}: cannot read safetensors file: {e}") from e
    return _assemble(source, weights_path, cfg, rank, scale, pairs, permuted=False)


def _read_gguf(source: Path, cfg: ModelConfig, max_rank: int) -> Adapter:
    from gguf import GGMLQuantizationType, dequantize

    reader = open_gguf(source)
    fields = reader.fields

    def refuse(field: str, reason: str) -> AdapterError:
        return AdapterError(f"{source}: field {field!r}: {reason}")

    if fields.get("general.type") != "adapter" or fields.get("adapter.type", "lora") != "lora":
        raise refuse("general.type", f"{fields.get('general.type')!r} is not a LoRA adapter ('adapter')")
    arch, base = fields.get("general.architecture"), gguf_architecture(cfg)
    if arch != base:
        raise refuse("general.architecture", f"an adapter for {arch!r}, and the base model is {base!r}")
    alpha = float(fields.get("adapter.lora.alpha", 0.0))
    pairs: dict[tuple[int, str], dict[str, tuple[str, np.ndarray]]] = {}
    for t in reader.tensors:
        m = _GGUF_TENSOR.fullmatch(t.name)
        if m is None or m.group(2) not in GGUF_MODULES:
            module = m.group(2) if m else t.name
            raise AdapterError(f"{source}: tensor {t.name!r}: unknown target module {module!r}; served: "
                               f"{', '.join(GGUF_MODULES)} of blk.N")
        try:
            arr = np.asarray(dequantize(t.data, GGMLQuantizationType(t.tensor_type)), np.float32)
        except Exception as e:
            raise AdapterError(f"{source}: tensor {t.name!r}: cannot dequantize: {e}") from e
        key = (int(m.group(1)), GGUF_MODULES[m.group(2)])
        pairs.setdefault(key, {})[m.group(3).upper()] = (t.name, arr.reshape(tuple(reversed(t.shape))))
    ranks = {a[1].shape[0] for p in pairs.values() for k, a in p.items() if k == "A"}
    if len(ranks) > 1:
        raise refuse("adapter.lora.alpha", f"tensors of several ranks {sorted(ranks)}: one alpha scales one rank")
    rank = ranks.pop() if ranks else 1
    if rank > max_rank:
        name = next(a[0] for p in pairs.values() for k, a in p.items() if k == "A")
        raise AdapterError(f"{source}: tensor {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    scale = alpha / rank if alpha else 1.0
    return _assemble(source, source, cfg, rank, scale, pairs, permuted=arch == "llama")


def _assemble(source: Path, file: Path, cfg: ModelConfig, rank: int, scale: float,
              pairs: dict[tuple[int, str], dict[str, tuple[str, np.ndarray]]], permuted: bool) -> Adapter:
    """Check each (layer, module)'s A and B against the base's shapes and the rank; fold the scale into B."""
    shapes = lora_shapes(cfg)
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(cfg.num_layers)]
    for (layer, module), pair in sorted(pairs.items()):
        for key in ("A", "B"):
            if key not in pair:
                other = next(iter(pair.values()))[0]
                raise AdapterError(f"{file}: tensor {other!r}: its lora_{key} is missing")
        (a_name, a), (b_name, b) = pair["A"], pair["B"]
        if layer >= cfg.num_layers:
            raise AdapterError(f"{file}: tensor {a_name!r}: layer {layer}, and the base has {cfg.num_layers} layers")
        d_in, d_out = shapes[module]
        for name, arr, want in ((a_name, a, (rank, d_in)), (b_name, b, (d_out, rank))):
            if arr.shape != want:
                raise AdapterError(f"{file}: tensor {name!r}: shape {arr.shape}, and the base needs {want} "
                                   f"(rank {rank})")
        if permuted and module in ("q", "k"):
            b = unpermute_rope(b, cfg.num_heads if module == "q" else cfg.num_kv_heads)
        layers[layer][module] = (a, b * np.float32(scale))
    return Adapter(source=source, rank=rank, layers=layers)
