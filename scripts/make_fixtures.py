#!/usr/bin/env python3
"""Build tiny random HF models and their reference outputs for the JAX parity tests.

Writes, under ``tests/fixtures/``:

* ``tiny-llama3/``  -- ``LlamaForCausalLM`` with llama3 rope scaling and GQA, saved SHARDED
  (``model.safetensors.index.json`` + several shards).
* ``tiny-mistral/`` -- ``MistralForCausalLM`` with ``sliding_window=16`` and tied embeddings,
  saved as a single ``model.safetensors``.

Each directory also gets ``config.json`` (from ``save_pretrained``) and ``reference.npz`` with
``input_ids`` [48] int32, ``logits`` [48, 256] float32 (one full forward pass), ``greedy_ids`` [16]
int32 (greedy continuation of the first ``greedy_prompt_len`` = 20 input ids, eos ignored) and
``greedy_prompt_len``.

Needs torch + transformers (``pip install -e .[fixtures]``); the tests themselves do not.
Usage: ``python scripts/make_fixtures.py``
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

SEQ_LEN = 48
PROMPT_LEN = 20
NEW_TOKENS = 16
VOCAB = 256

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="eager",
    dtype="float32",
)


def llama3_config() -> LlamaConfig:
    return LlamaConfig(
        **COMMON,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    )


def mistral_config(sliding_window: int | None = 16) -> MistralConfig:
    return MistralConfig(**COMMON, sliding_window=sliding_window, rope_theta=10000.0, tie_word_embeddings=True)


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Larger-than-default init so logits are far from zero: N(0, 0.2) weights, norms 1 + 0.1 N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.2 * noise)


def build(model_cls, config, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    init_weights(model, seed)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "weights not tied"
    return model


def make_input_ids(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, size=SEQ_LEN).astype(np.int32)


@torch.no_grad()
def forward_logits(model, input_ids: np.ndarray) -> np.ndarray:
    ids = torch.from_numpy(input_ids.astype(np.int64))[None]
    return model(input_ids=ids, use_cache=False).logits[0].float().numpy()


@torch.no_grad()
def greedy(model, prompt: np.ndarray) -> np.ndarray:
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        eos_token_id=None,
        pad_token_id=0,
    )
    new = out[0, ids.shape[1] :].numpy().astype(np.int32)
    assert new.shape == (NEW_TOKENS,), new.shape
    return new


@torch.no_grad()
def check_greedy_matches_argmax(model, prompt: np.ndarray, new: np.ndarray) -> None:
    """The generate() result must equal a manual no-cache argmax loop (no eos suppression surprises)."""
    seq = list(prompt.astype(np.int64))
    for _ in range(NEW_TOKENS):
        logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
        seq.append(int(torch.argmax(logits)))
    manual = np.array(seq[len(prompt) :], dtype=np.int32)
    assert np.array_equal(manual, new), (manual, new)


def save(model, out_dir: Path, input_ids: np.ndarray, **save_kwargs) -> np.ndarray:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True, **save_kwargs)
    # generation_config.json is not needed by the tests; keep only what we use.
    gen_cfg = out_dir / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()
    for f in out_dir.iterdir():
        f.chmod(0o644)
    logits = forward_logits(model, input_ids)
    assert logits.shape == (SEQ_LEN, VOCAB), logits.shape
    prompt = input_ids[:PROMPT_LEN]
    new = greedy(model, prompt)
    check_greedy_matches_argmax(model, prompt, new)
    # The files on disk must reproduce the logits (catches tying / sharding mistakes).
    reloaded = type(model).from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32).eval()
    np.testing.assert_allclose(forward_logits(reloaded, input_ids), logits, rtol=0, atol=1e-6)
    np.savez(
        out_dir / "reference.npz",
        input_ids=input_ids.astype(np.int32),
        logits=logits.astype(np.float32),
        greedy_ids=new.astype(np.int32),
        greedy_prompt_len=np.int32(PROMPT_LEN),
    )
    print(f"  logits std={logits.std():.3f} min={logits.min():.3f} max={logits.max():.3f}")
    print(f"  greedy_ids={new.tolist()}")
    return logits


def dir_size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


def make_llama3() -> None:
    out = FIXTURES / "tiny-llama3"
    print(f"[tiny-llama3] -> {out}")
    config = llama3_config()
    model = build(LlamaForCausalLM, config, seed=0)
    # llama3 scaling must really change some (but not all) rope frequencies at this size.
    head_dim = config.hidden_size // config.num_attention_heads
    base = 500000.0 ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    scaled = model.model.rotary_emb.inv_freq.double().numpy()
    changed = ~np.isclose(scaled, base, rtol=1e-6)
    print(f"  llama3 rope: {int(changed.sum())}/{len(base)} inv_freq entries changed by scaling")
    assert 0 < changed.sum() < len(base)
    save(model, out, make_input_ids(seed=1), max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1, f"expected a sharded checkpoint, got {shards}"
    assert all((out / s).is_file() for s in shards)
    assert not (out / "model.safetensors").exists()
    print(f"  sharded into {len(shards)} files: {shards}")
    print(f"  total size {dir_size(out)} bytes")


def make_mistral() -> None:
    out = FIXTURES / "tiny-mistral"
    print(f"[tiny-mistral] -> {out}")
    model = build(MistralForCausalLM, mistral_config(16), seed=2)
    input_ids = make_input_ids(seed=3)
    logits = save(model, out, input_ids)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()

    # The sliding window must actually be applied by eager attention in this transformers version.
    full = build(MistralForCausalLM, mistral_config(None), seed=2)
    full.load_state_dict(model.state_dict())
    logits_full = forward_logits(full, input_ids)
    early = np.abs(logits[:16] - logits_full[:16]).max()
    late = np.abs(logits[-1] - logits_full[-1]).max()
    print(f"  sliding_window=16 vs None: max|diff| positions <16 = {early:.2e}, last position = {late:.3e}")
    assert early < 1e-5, "sliding window changed logits inside the window"
    assert late > 1e-3, "sliding window had no effect: eager attention ignores it in this transformers version"
    print(f"  total size {dir_size(out)} bytes")


def write_readme() -> None:
    text = f"""# Test fixtures

Tiny random Hugging Face checkpoints plus reference outputs, used by the JAX parity tests so that
those tests need neither torch nor transformers.

Generated by `scripts/make_fixtures.py` with:

- transformers {transformers.__version__}
- torch {torch.__version__}

Regenerate with:

```
pip install -e .[fixtures]
python scripts/make_fixtures.py
```

## Contents

- `tiny-llama3/`: `LlamaForCausalLM`, hidden 64, intermediate 128, 2 layers, 4 heads, 2 kv heads
  (GQA), vocab 256, rope_theta 500000 with llama3 rope scaling (factor 8, low/high freq factor
  1/4, original_max_position_embeddings 64), untied lm_head. Saved sharded
  (`model.safetensors.index.json` + `model-0000X-of-0000N.safetensors`).
- `tiny-mistral/`: `MistralForCausalLM`, same sizes, sliding_window 16, rope_theta 10000, tied
  embeddings (no `lm_head.weight` in the file). Single `model.safetensors`.

Weights are N(0, 0.2), RMSNorm weights 1 + 0.1 N(0, 1), float32, eager attention.

Each `reference.npz` holds:

- `input_ids` [48] int32, random in [3, 256)
- `logits` [48, 256] float32, one full forward pass over `input_ids`
- `greedy_ids` [16] int32, greedy continuation (eos ignored) of `input_ids[:greedy_prompt_len]`
- `greedy_prompt_len` = 20

Note: transformers 5.x writes rope settings to `config.json` as `rope_parameters` (which also
holds `rope_theta`), not the older top-level `rope_theta` / `rope_scaling` keys.
"""
    (FIXTURES / "README.md").write_text(text)


def main() -> None:
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    torch.use_deterministic_algorithms(True)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    make_llama3()
    make_mistral()
    write_readme()
    print("done")


if __name__ == "__main__":
    main()
