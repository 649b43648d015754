"""Loader checks: every broken checkpoint raises an error that names the culprit; GGUF dequantization is exact.

HF cases copy a tiny fixture into tmp_path and break it; GGUF cases write tiny one-layer files with gguf.GGUFWriter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file, save_file

from jaxstation.model.loader import CheckpointError, load_gguf, load_hf_dir, load_model

# ----------------------------------------------------------------------------------------------------- HF dirs


@pytest.fixture
def mistral(tmp_path: Path) -> Path:
    """A writable copy of tiny-mistral (one model.safetensors, tied)."""
    return Path(shutil.copytree(FIXTURES / "tiny-mistral", tmp_path / "tiny-mistral"))


@pytest.fixture
def llama3(tmp_path: Path) -> Path:
    """A writable copy of tiny-llama3 (5 shards + index, untied)."""
    return Path(shutil.copytree(FIXTURES / "tiny-llama3", tmp_path / "tiny-llama3"))


def _edit_safetensors(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _shard_of(d: Path, name: str) -> Path:
    return d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_copies_load(mistral, llama3):
    # the unbroken copies load, so each failure below is down to the one thing broken
    assert load_hf_dir(mistral)[0].sliding_window == 16
    assert load_hf_dir(llama3)[1].lm_head is not None


def test_hf_unknown_tensor(mistral):
    name = "model.layers.0.mlp.gate_proj.bias"
    _edit_safetensors(mistral / "model.safetensors", lambda t: t.update({name: np.zeros(128, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unknown tensor 'model\.layers\.0\.mlp\.gate_proj\.bias'"):
        load_hf_dir(mistral)


def test_hf_tensor_of_a_layer_past_the_config(mistral):
    name = "model.layers.2.input_layernorm.weight"  # the config has 2 layers
    _edit_safetensors(mistral / "model.safetensors", lambda t: t.update({name: np.ones(64, np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.input_layernorm\.weight"):
        load_hf_dir(mistral)


def test_hf_missing_tensor(mistral):
    name = "model.layers.1.mlp.down_proj.weight"
    _edit_safetensors(mistral / "model.safetensors", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.down_proj\.weight'"):
        load_hf_dir(mistral)


def test_hf_missing_lm_head_when_untied(llama3):
    shard = _shard_of(llama3, "lm_head.weight")
    _edit_safetensors(shard, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head\.weight'"):
        load_hf_dir(llama3)


def test_hf_wrong_shape(llama3):
    name = "model.layers.0.self_attn.k_proj.weight"  # expected (2 kv heads * 16, 64) = (32, 64)
    shard = _shard_of(llama3, name)
    _edit_safetensors(shard, lambda t: t.update({name: np.zeros((16, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        load_hf_dir(llama3)


def test_hf_truncated_shard(llama3):
    shard = _shard_of(llama3, "model.layers.1.mlp.up_proj.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=shard.name):
        load_hf_dir(llama3)


def test_hf_truncated_single_file(mistral):
    path = mistral / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf_dir(mistral)


def test_hf_missing_shard(llama3):
    shard = _shard_of(llama3, "model.norm.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing shard file .*{shard.name}"):
        load_hf_dir(llama3)


def test_hf_missing_config(mistral):
    (mistral / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_dir(mistral)


def test_hf_unsupported_architecture(mistral):
    _edit_config(mistral, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_hf_dir(mistral)


@pytest.mark.parametrize("field,value,pattern", [
    ("attention_bias", True, "attention_bias"),
    ("mlp_bias", True, "mlp_bias"),
    ("hidden_act", "gelu", "hidden_act"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}, "yarn"),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}, "yarn"),
    ("qk_layernorm", True, "qk_layernorm"),
])
def test_hf_unsupported_config_field(mistral, field, value, pattern):
    if field == "rope_scaling":
        cfg = json.loads((mistral / "config.json").read_text())
        cfg.pop("rope_parameters")
        cfg[field] = value
        (mistral / "config.json").write_text(json.dumps(cfg))
    else:
        _edit_config(mistral, **{field: value})
    with pytest.raises(ValueError, match=pattern):
        load_hf_dir(mistral)


def test_hf_dir_without_tok_json_names_the_file():
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_model(FIXTURES / "tiny-mistral")


def test_load_model_rejects_other_paths(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="model.bin"):
        load_model(path)


# --------------------------------------------------------------------------------------------------------- GGUF

V, D, F, HEADS, KV_HEADS = 64, 32, 64, 4, 2
HD = D // HEADS
SHAPES = {  # HF [out, in] order; numpy arrays in this order are what GGUFWriter stores as ggml [in, out]
    "token_embd.weight": (V, D), "output_norm.weight": (D,), "output.weight": (V, D),
    "blk.0.attn_norm.weight": (D,), "blk.0.attn_q.weight": (HEADS * HD, D), "blk.0.attn_k.weight": (KV_HEADS * HD, D),
    "blk.0.attn_v.weight": (KV_HEADS * HD, D), "blk.0.attn_output.weight": (D, HEADS * HD),
    "blk.0.ffn_norm.weight": (D,), "blk.0.ffn_gate.weight": (F, D), "blk.0.ffn_up.weight": (F, D),
    "blk.0.ffn_down.weight": (D, F),
}
ROPE_HEADS = {"blk.0.attn_q.weight": HEADS, "blk.0.attn_k.weight": KV_HEADS}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved rows (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_weights(seed: int = 0, f: int = F) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in SHAPES.items():
        shape = tuple(f if s == F and "ffn" in name and "norm" not in name else s for s in shape)
        out[name] = (1 + 0.1 * rng.standard_normal(shape) if "norm" in name else rng.standard_normal(shape)) \
            .astype(np.float32)
    return out


def _encode(arr: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q | None]:
    """What to hand GGUFWriter.add_tensor: (array, raw_dtype)."""
    if qtype == Q.F32:
        return arr.astype(np.float32), None
    if qtype == Q.F16:
        return arr.astype(np.float16), None
    return gguf.quants.quantize(arr, qtype), qtype


def _raw_k_quant(rows: int, cols: int, qtype: Q, seed: int) -> np.ndarray:
    """Random K-quant blocks with sane fp16 scale fields (gguf.quants cannot quantize these types)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin (fp16), scales[12], qs[128]
        raw[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        raw[..., 2:4] = np.frombuffer(np.float16(0.005).tobytes(), np.uint8)
    elif qtype == Q.Q6_K:  # ql[128], qh[64], scales[16] int8, d (fp16)
        raw[..., 208:210] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    else:
        raise AssertionError(qtype)
    return raw.reshape(rows, -1)


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q | None]], arch: str = "llama", f: int = F,
               tokenizer: bool = False) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(D)
    w.add_feed_forward_length(f)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_context_length(128)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(V)
    if tokenizer:  # a minimal byte-level BPE vocabulary: printable ASCII, no merges
        w.add_tokenizer_model("gpt2")
        w.add_token_list([chr(33 + i) for i in range(V)])
        w.add_token_merges([])
        w.add_eos_token_id(2)
    for name, (arr, raw_dtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _loaded(params) -> dict[str, np.ndarray]:
    """Our Params back in GGUF names and HF [out, in] order (q/k as HF rotate-half rows)."""
    L = params.layers  # noqa: N806
    qkv = np.asarray(L.wqkv[0]).T
    nq, nk = HEADS * HD, KV_HEADS * HD
    gate_up = np.asarray(L.w_gate_up[0]).T
    f = gate_up.shape[0] // 2
    out = {
        "token_embd.weight": np.asarray(params.embed), "output_norm.weight": np.asarray(params.final_norm),
        "blk.0.attn_norm.weight": np.asarray(L.attn_norm[0]), "blk.0.attn_q.weight": qkv[:nq],
        "blk.0.attn_k.weight": qkv[nq:nq + nk], "blk.0.attn_v.weight": qkv[nq + nk:],
        "blk.0.attn_output.weight": np.asarray(L.wo[0]).T, "blk.0.ffn_norm.weight": np.asarray(L.mlp_norm[0]),
        "blk.0.ffn_gate.weight": gate_up[:f], "blk.0.ffn_up.weight": gate_up[f:],
        "blk.0.ffn_down.weight": np.asarray(L.w_down[0]).T,
    }
    if params.lm_head is not None:
        out["output.weight"] = np.asarray(params.lm_head).T
    return out


def _complete_file(path: Path, qtype: Q = Q.F32, **replace) -> Path:
    """Every tensor in `qtype` (norms F32, as llama.cpp keeps them), q/k rows permuted; `replace` overrides."""
    hf = _hf_weights()
    tensors = {}
    for name, w in hf.items():
        stored = _permute(w, ROPE_HEADS[name]) if name in ROPE_HEADS else w
        tensors[name] = _encode(stored, Q.F32 if w.ndim == 1 else qtype)
    for name, value in replace.items():
        name = name.replace("__", ".")
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    return write_gguf(path, tensors)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_gguf_loads_and_dequantizes(tmp_path, qtype):
    hf = _hf_weights()
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    written = {}
    tensors = {}
    for name, w in hf.items():
        stored = _permute(w, ROPE_HEADS[name]) if name in ROPE_HEADS else w
        tensors[name] = _encode(stored, Q.F32 if w.ndim == 1 else qtype)
        arr, raw = tensors[name]
        deq = np.asarray(gguf.quants.dequantize(arr, raw or (Q.F32 if arr.dtype == np.float32 else Q.F16)))
        deq = deq.astype(np.float32).reshape(w.shape)
        written[name] = _unpermute(deq, ROPE_HEADS[name]) if name in ROPE_HEADS else deq
    write_gguf(path, tensors)

    cfg, params = load_gguf(path)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (V, D, F, 1)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.max_position) == (HEADS, KV_HEADS, HD, 128)
    assert not cfg.tie_word_embeddings and params.embed.dtype == jnp.float32
    got = _loaded(params)
    assert got.keys() == written.keys()
    for name in written:
        np.testing.assert_array_equal(got[name], written[name], err_msg=f"{qtype.name} {name}")
        if qtype in (Q.F32, Q.F16):  # exact types: what we wrote (q/k back in HF row order)
            exact = hf[name].astype(np.float16).astype(np.float32) if qtype == Q.F16 and hf[name].ndim == 2 \
                else hf[name]
            np.testing.assert_array_equal(got[name], exact, err_msg=f"{qtype.name} {name}")
        else:  # lossy, but close to what we wrote (catches a wrong un-permutation or transposition)
            scale = np.abs(hf[name]).max()
            assert np.abs(got[name] - hf[name]).max() <= 0.25 * scale, f"{qtype.name} {name}"


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_gguf_k_quants(tmp_path, qtype):
    f = 256  # K-quant super-blocks are 256 wide: ffn_down [D, 256] is one block per row
    hf = _hf_weights(f=f)
    tensors = {name: _encode(_permute(w, ROPE_HEADS[name]) if name in ROPE_HEADS else w, Q.F32)
               for name, w in hf.items()}
    raw = _raw_k_quant(D, f, qtype, seed=3)
    tensors["blk.0.ffn_down.weight"] = (raw, qtype)
    write_gguf(tmp_path / "k.gguf", tensors, f=f)
    cfg, params = load_gguf(tmp_path / "k.gguf")
    assert cfg.intermediate_size == f
    got = _loaded(params)
    expected = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(D, f)
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    np.testing.assert_array_equal(got["blk.0.ffn_down.weight"], expected)
    np.testing.assert_array_equal(got["blk.0.attn_q.weight"], hf["blk.0.attn_q.weight"])
    np.testing.assert_array_equal(got["blk.0.ffn_up.weight"], hf["blk.0.ffn_up.weight"])


def test_gguf_tied_when_no_output(tmp_path):
    cfg, params = load_gguf(_complete_file(tmp_path / "tied.gguf", output__weight=None))
    assert cfg.tie_word_embeddings and params.lm_head is None


def test_gguf_unknown_tensor(tmp_path):
    path = _complete_file(tmp_path / "x.gguf", blk__0__ffn_up__bias=(np.zeros(D, np.float32), None))
    with pytest.raises(CheckpointError, match=r"unknown tensor 'blk\.0\.ffn_up\.bias'"):
        load_gguf(path)


def test_gguf_missing_tensor(tmp_path):
    path = _complete_file(tmp_path / "x.gguf", blk__0__ffn_up__weight=None)
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk\.0\.ffn_up\.weight'"):
        load_gguf(path)


def test_gguf_wrong_shape(tmp_path):
    path = _complete_file(tmp_path / "x.gguf", blk__0__ffn_gate__weight=(np.zeros((F - 8, D), np.float32), None))
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_gate\.weight.*\(56, 32\).*\(64, 32\)"):
        load_gguf(path)


def test_gguf_unsupported_architecture(tmp_path):
    hf = _hf_weights()
    path = write_gguf(tmp_path / "other.gguf", {n: (w, None) for n, w in hf.items()}, arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        load_gguf(path)


@pytest.mark.parametrize("keep", [0.5, 0.98])
def test_gguf_truncated(tmp_path, keep):
    path = _complete_file(tmp_path / "trunc.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="trunc.gguf"):
        load_gguf(path)


def test_gguf_header_and_table_errors_name_what_is_wrong(tmp_path):
    data = bytearray(_complete_file(tmp_path / "good.gguf").read_bytes())
    cases = {"magic": (b"GGUG", "not a GGUF file"), "version": ((9).to_bytes(4, "little"), "GGUF version 9")}
    for name, (patch, message) in cases.items():
        at = 0 if name == "magic" else 4
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(bytes(data[:at]) + patch + bytes(data[at + 4:]))
        with pytest.raises(CheckpointError, match=f"{name}.gguf.*{message}"):
            load_gguf(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="cannot read GGUF file .*empty.gguf"):
        load_gguf(empty)


def test_load_model_gguf_dtypes(tmp_path):
    hf = _hf_weights()
    tensors = {n: (_permute(w, ROPE_HEADS[n]) if n in ROPE_HEADS else w, None) for n, w in hf.items()}
    path = write_gguf(tmp_path / "tok.gguf", tensors, tokenizer=True)
    m32 = load_model(path)
    assert m32.params.embed.dtype == jnp.float32 and m32.tokenizer is not None and m32.tokenizer.eos_ids == (2,)
    m16 = load_model(path, dtype="bfloat16")
    import jax

    leaves = jax.tree_util.tree_leaves(m16.params)
    assert leaves and all(x.dtype == jnp.bfloat16 for x in leaves)
    np.testing.assert_array_equal(np.asarray(m16.params.embed, np.float32),
                                  np.asarray(m32.params.embed.astype(jnp.bfloat16), np.float32))
    with pytest.raises(ValueError, match="float16"):
        load_model(path, dtype="float16")
