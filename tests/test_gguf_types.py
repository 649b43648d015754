"""Every GGUF weight type the loader reads, from a tiny model file per type (`tests/fixtures/gguf-types`).

Loaded as float32, each tensor holds exactly the values the gguf package's reference dequantizer gives for the bytes
its own reader finds in the file (q/k rows back in HF's order); as bfloat16, those values rounded. Served as stored on
the CPU kernel, float32-exact (weights "gguf-exact"), each model's logits are bit for bit those of the same model
dequantized to float32. A type outside the list is refused at load, naming the file, the tensor, its type and the
types that are served.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, not_written_to_the_cache
from gguf import GGMLQuantizationType as Q

from jaxstation.kernels.cpu_kernel import BLOCK_FORMATS
from jaxstation.model.layers import forward_full
from jaxstation.model.loader import GGUF_TYPES, CheckpointError, checkpoint_config, load_gguf

TYPES = FIXTURES / "gguf-types"
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 16  # the fixtures' (scripts/make_fixtures.py: TYPES_SHAPE)


def fixture(name: str) -> Path:
    return TYPES / f"tiny-llama-{name}.gguf"


def reference(path: Path) -> dict[str, np.ndarray]:
    """Each tensor [out, in] as gguf's reader and dequantizer give it, q/k rows back in HF's rotate-half order."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        w = w.reshape(tuple(int(n) for n in reversed(t.shape)))
        heads = {"blk.0.attn_q.weight": HEADS, "blk.0.attn_k.weight": KV_HEADS}.get(t.name)
        if heads:  # llama.cpp's interleaved rows -> HF's halves
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        out[t.name] = w
    return out


def loaded(params) -> dict[str, np.ndarray]:
    """The loaded Params under GGUF names, [out, in] (one layer, tied)."""
    layer = params.layers
    qkv = np.asarray(layer.wqkv[0]).T
    nq, nk = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    gate_up = np.asarray(layer.w_gate_up[0]).T
    f = gate_up.shape[0] // 2
    return {"token_embd.weight": np.asarray(params.embed), "output_norm.weight": np.asarray(params.final_norm),
            "blk.0.attn_norm.weight": np.asarray(layer.attn_norm[0]), "blk.0.attn_q.weight": qkv[:nq],
            "blk.0.attn_k.weight": qkv[nq:nq + nk], "blk.0.attn_v.weight": qkv[nq + nk:],
            "blk.0.attn_output.weight": np.asarray(layer.wo[0]).T,
            "blk.0.ffn_norm.weight": np.asarray(layer.mlp_norm[0]), "blk.0.ffn_gate.weight": gate_up[:f],
            "blk.0.ffn_up.weight": gate_up[f:], "blk.0.ffn_down.weight": np.asarray(layer.w_down[0]).T}


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_each_type_loads_to_the_reference_dequantization(name: str) -> None:
    path = fixture(name)
    types = {t.name: Q(t.tensor_type).name for t in gguf.GGUFReader(path).tensors}
    assert types["token_embd.weight"] == name and types["blk.0.ffn_up.weight"] == name  # the file is of that type
    expected = reference(path)
    cfg, params = load_gguf(path)
    assert cfg.tie_word_embeddings and params.lm_head is None
    got = loaded(params)
    assert got.keys() == expected.keys()
    for tensor, values in expected.items():
        assert np.isfinite(values).all() and len(np.unique(values)) > 8, tensor
        np.testing.assert_array_equal(got[tensor], values, err_msg=f"{name} {tensor}")


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_each_type_as_stored_gives_the_dequantized_logits(name: str) -> None:
    path = fixture(name)
    stored_cfg, stored = load_gguf(path, "gguf-exact", layer_loop="unroll", matmul="kernel")
    dense_cfg, dense = load_gguf(path, "float32", layer_loop="unroll", matmul="kernel")
    embed_blocks = getattr(stored.embed, "blocks", None)
    assert embed_blocks == (name if name in BLOCK_FORMATS else None)  # kept in its blocks where the kernel reads them
    tokens = jnp.asarray([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], jnp.int32)
    with not_written_to_the_cache():  # the oracle's programs (conftest.oracle_logits)
        got = np.asarray(forward_full(stored_cfg, stored, tokens))
        want = np.asarray(forward_full(dense_cfg, dense, tokens))
    assert np.isfinite(want).all() and want.std() > 0.1
    assert np.array_equal(got, want), np.abs(got - want).max()


@pytest.mark.parametrize("name", ["Q5_0", "Q3_K", "IQ4_XS"])
def test_a_dequantized_type_loads_in_bfloat16_as_its_values_rounded(name: str) -> None:
    expected = reference(fixture(name))
    _, params = load_gguf(fixture(name), "bfloat16")
    got = loaded(params)
    for tensor, values in expected.items():
        assert got[tensor].dtype == jnp.bfloat16, tensor
        np.testing.assert_array_equal(got[tensor].astype(np.float32), values.astype(jnp.bfloat16).astype(np.float32))


def rewrite_gguf(path: Path, base: Path, tensors: dict[str, tuple[np.ndarray, Q | None]] | None = None,
                 tokenizer_from: Path | None = None, strings: dict[str, str] | None = None,
                 values: dict[str, object] | None = None) -> Path:
    """`base` written again to `path`: its metadata, `tokenizer_from`'s `tokenizer.*` over it, then `strings`, and
    `values` in place of its keys' values (of the same type); its tensors, those in `tensors` replaced by (array, raw
    type)."""
    tensors, strings, values = tensors or {}, strings or {}, values or {}
    writer = gguf.GGUFWriter(str(path), gguf.GGUFReader(base).fields["general.architecture"].contents())
    fields = {f.name: f for f in gguf.GGUFReader(base).fields.values()}
    if tokenizer_from:
        theirs = gguf.GGUFReader(tokenizer_from).fields.values()
        fields |= {f.name: f for f in theirs if f.name.startswith("tokenizer.")}
    for field in fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture" and field.name not in strings:
            writer.add_key_value(field.name, values.get(field.name, field.contents()), field.types[0],
                                 field.types[-1])
    for key, value in strings.items():
        writer.add_string(key, value)
    for t in gguf.GGUFReader(base).tensors:
        stored = (np.asarray(t.data), None if t.tensor_type in (Q.F32, Q.F16) else Q(t.tensor_type))
        arr, raw = tensors.get(t.name, stored)
        writer.add_tensor(t.name, arr, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def with_type(path: Path, tensor: str, qtype: Q) -> Path:
    """The F32 fixture with `tensor` (rows of 256) as zero blocks of `qtype`."""
    shape = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in gguf.GGUFReader(fixture("F32")).tensors}
    rows, cols = shape[tensor]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    return rewrite_gguf(path, fixture("F32"), {tensor: (np.zeros((rows, cols // block * nbytes), np.uint8), qtype)})


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ3_S, Q.IQ1_S, Q.TQ1_0])
def test_an_unsupported_type_is_refused_naming_the_tensor_and_the_types_served(tmp_path: Path, qtype: Q) -> None:
    path = with_type(tmp_path / f"tiny-{qtype.name}.gguf", "blk.0.ffn_up.weight", qtype)
    for load in (load_gguf, checkpoint_config):  # at load, and in serve's check before it listens
        with pytest.raises(CheckpointError) as e:
            load(path)
        message = str(e.value)
        assert f"tensor 'blk.0.ffn_up.weight' in {path} has unsupported GGUF type {qtype.name}" in message
        assert "\n" not in message and all(t in message for t in GGUF_TYPES)
