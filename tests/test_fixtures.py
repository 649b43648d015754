"""Sanity checks on the committed HF fixtures (see scripts/make_fixtures.py); no torch/transformers needed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LLAMA3 = FIXTURES / "tiny-llama3"
MISTRAL = FIXTURES / "tiny-mistral"
MAX_MODEL_BYTES = 1_000_000


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _rope(cfg: dict) -> dict:
    # transformers >= 5 writes "rope_parameters" (rope_theta inside); older versions "rope_scaling" + "rope_theta".
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "rope_theta" in cfg:
        rope.setdefault("rope_theta", cfg["rope_theta"])
    return rope


@pytest.mark.parametrize("d", [LLAMA3, MISTRAL], ids=lambda d: d.name)
def test_files_exist_and_small(d: Path):
    for name in ("config.json", "reference.npz"):
        assert (d / name).is_file(), d / name
    total = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    assert total < MAX_MODEL_BYTES, total
    assert (FIXTURES / "README.md").is_file()


def test_llama3_is_sharded():
    assert not (LLAMA3 / "model.safetensors").exists()
    index = json.loads((LLAMA3 / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1, shards
    for s in shards:
        assert (LLAMA3 / s).is_file(), s
    assert "lm_head.weight" in index["weight_map"]  # untied


def test_mistral_single_file():
    assert (MISTRAL / "model.safetensors").is_file()
    assert not (MISTRAL / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("d", [LLAMA3, MISTRAL], ids=lambda d: d.name)
def test_reference_shapes(d: Path):
    with np.load(d / "reference.npz") as ref:
        ids, logits, greedy = ref["input_ids"], ref["logits"], ref["greedy_ids"]
        prompt_len = int(ref["greedy_prompt_len"])
    assert ids.shape == (48,) and ids.dtype == np.int32
    assert ids.min() >= 3 and ids.max() < 256
    assert logits.shape == (48, 256) and logits.dtype == np.float32
    assert np.isfinite(logits).all() and logits.std() > 0.1
    assert greedy.shape == (16,) and greedy.dtype == np.int32
    assert greedy.min() >= 0 and greedy.max() < 256
    assert prompt_len == 20
    # The first greedy token is the argmax of the full-pass logits at the last prompt position.
    assert int(np.argmax(logits[prompt_len - 1])) == int(greedy[0])


def test_llama3_config():
    cfg = _config(LLAMA3)
    assert cfg["model_type"] == "llama"
    assert cfg["hidden_size"] == 64 and cfg["intermediate_size"] == 128
    assert cfg["num_hidden_layers"] == 2
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    assert cfg["vocab_size"] == 256
    assert cfg["tie_word_embeddings"] is False
    rope = _rope(cfg)
    assert rope["rope_type"] == "llama3"
    assert rope["rope_theta"] == 500000.0
    assert rope["factor"] == 8.0
    assert rope["low_freq_factor"] == 1.0 and rope["high_freq_factor"] == 4.0
    assert rope["original_max_position_embeddings"] == 64


def test_mistral_config():
    cfg = _config(MISTRAL)
    assert cfg["model_type"] == "mistral"
    assert cfg["sliding_window"] == 16
    assert cfg["tie_word_embeddings"] is True
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    rope = _rope(cfg)
    assert rope.get("rope_type", "default") == "default"
    assert rope["rope_theta"] == 10000.0
