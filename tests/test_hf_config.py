"""config.json as transformers 4.x and 5.x write it (`tests/fixtures/hf-configs`, made by scripts/make_fixtures.py).

Metadata (names, versions, dtypes, special-token ids, generation defaults, ...: `config.HF_IGNORED_FIELDS`) is
ignored; each family's default config reads the same from both versions, and so does Gemma 3 270M's config as
transformers derives it from the GGUF file, which also equals what the station reads from that file's metadata. A field
that could change the computation and is not implemented is still refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import FIXTURES

from jaxstation.model.config import HF_IGNORED_FIELDS, ModelConfig
from jaxstation.model.loader import checkpoint_config

CONFIGS = FIXTURES / "hf-configs"
FILES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma-3-270m-from-gguf")


def read(version: int, name: str) -> dict:
    return json.loads((CONFIGS / f"transformers-{version}" / f"{name}.json").read_text())


@pytest.mark.parametrize("name", FILES)
def test_both_versions_read_as_the_same_model(name: str) -> None:
    old, new = read(4, name), read(5, name)
    assert old["transformers_version"].startswith("4.") and new["transformers_version"].startswith("5.")
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(new)


def test_gemma3_from_gguf_matches_the_files_own_metadata(gemma3_270m: Path) -> None:
    config = read(5, "gemma-3-270m-from-gguf")
    assert {"_model_name_or_path", "unk_token_id"} <= config.keys()  # what transformers 5 writes for this model
    from_hf = ModelConfig.from_hf(config)
    # the HF loader adds Gemma's norm offset to the weights; the GGUF file stores them with it
    assert dataclasses.replace(from_hf, norm_offset=0.0) == checkpoint_config(gemma3_270m)
    assert (from_hf.num_layers, from_hf.hidden_size, from_hf.head_dim, from_hf.sliding_window) == (18, 640, 256, 512)


@pytest.mark.parametrize("field", sorted(HF_IGNORED_FIELDS))
def test_every_ignored_field_leaves_the_model_as_it_is(field: str) -> None:
    config = read(5, "llama")
    assert ModelConfig.from_hf({**config, field: "anything"}) == ModelConfig.from_hf(config)


@pytest.mark.parametrize("field,value", [("partial_rotary_factor", 0.5), ("attn_temperature_tuning", True),
                                         ("num_experts", 8), ("layer_norm_type", "layernorm")])
def test_a_field_that_could_change_the_math_is_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"unsupported config field\(s\) \['{field}'\] in config.json"):
        ModelConfig.from_hf({**read(4, "gemma3_text"), field: value})
