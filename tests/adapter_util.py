"""LoRA adapters for tests, written with numpy and safetensors in PEFT's layout (and llama.cpp's GGUF LoRA layout),
and a model with an adapter merged into its weights (W + scale * B A), written as an HF directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from jaxstation.model.config import ModelConfig

PEFT_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
GGUF_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
              "down": "ffn_down"}


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection."""
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, f), "up": (d, f), "down": (f, d)}


def random_lora(cfg: ModelConfig, rank: int, seed: int, modules: tuple[str, ...] = tuple(PEFT_NAMES),
                b_std: float = 0.05) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer, module) -> (A [r, in], B [out, r]), float32."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(cfg.num_layers):
        for m in modules:
            d_in, d_out = shapes(cfg)[m]
            out[i, m] = (rng.normal(0, d_in ** -0.5, (rank, d_in)).astype(np.float32),
                         rng.normal(0, b_std, (d_out, rank)).astype(np.float32))
    return out


def write_peft(path: Path, lora: dict, rank: int, alpha: float, rslora: bool = False, **config) -> Path:
    """A PEFT adapter directory, as `PeftModel.save_pretrained` writes one."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (i, m), (a, b) in lora.items():
        prefix = f"base_model.model.model.layers.{i}.{PEFT_NAMES[m]}"
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
    save_file(tensors, str(path / "adapter_model.safetensors"))
    modules = sorted({PEFT_NAMES[m].split(".")[1] for _, m in lora})
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules, "use_rslora": rslora,
        "bias": "none", "task_type": "CAUSAL_LM", **config}))
    return path


def permute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for a `llama` GGUF (pairwise RoPE)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_lora(path: Path, cfg: ModelConfig, lora: dict, alpha: float, arch: str = "llama") -> Path:
    """A GGUF LoRA file as llama.cpp's convert_lora_to_gguf writes one: B's q/k rows permuted for a llama file."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for (i, m), (a, b) in lora.items():
        if arch == "llama" and m in ("q", "k"):
            b = permute_rope(b, cfg.num_heads if m == "q" else cfg.num_kv_heads)
        writer.add_tensor(f"blk.{i}.{GGUF_NAMES[m]}.weight.lora_a", np.ascontiguousarray(a))
        writer.add_tensor(f"blk.{i}.{GGUF_NAMES[m]}.weight.lora_b", np.ascontiguousarray(b))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_merged(base: Path, out: Path, lora: dict, scale: float) -> Path:
    """A copy of the HF directory `base` with W + scale * B A in place of each adapted projection."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(base, out)
    index = out / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    for fname in files:
        tensors = load_file(str(out / fname))
        for (i, m), (a, b) in lora.items():
            name = f"model.layers.{i}.{PEFT_NAMES[m]}.weight"
            if name in tensors:
                w = tensors[name].astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))
                tensors[name] = w.astype(np.float32)
        save_file(tensors, str(out / fname))
    return out
