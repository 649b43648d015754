"""GGUF weights as stored, on the CPU kernel, float32-exact (weights "gguf-exact").

For every block format the kernel reads, a matmul over the blocks is bit for bit the float32 kernel's over the gguf
package's dequantization of the same blocks, at every row count, and rows looked up from the blocks are those
weights. The AVX2 variant (built on demand in a subprocess where the CPU has AVX-512) keeps that promise too. The
default model served in its stored Q4_1 and Q8_0 gives the float32 model's logits bit for bit, at 1, 8 and 32 rows.
The integer products of weights "gguf" are tested in test_gguf_int.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from conftest import oracle_logits
from test_sampling import sampled_rows

from bench import shapes
from jaxstation.kernels import cpu_kernel
from jaxstation.model.loader import LoadedModel, load_model
from jaxstation.model.quant import (
    GGUFBlocks,
    JoinedWeight,
    KernelWeight,
    kernel_weight,
    matmul,
    prepare_weight,
    projection,
    stack,
    take_rows,
)

ROOT = Path(__file__).resolve().parent.parent
# where each format keeps its float16 scales: random bytes there could be inf or NaN
def random_blocks(fmt: str, n_out: int, n_in: int, seed: int) -> GGUFBlocks:
    """Every quant bit random; the float16 scales of a weight's size (minimums negative or positive)."""
    return GGUFBlocks(shapes.random_blocks(fmt, n_out, n_in, np.random.default_rng(seed)), fmt, (n_out, n_in))


def check_formats_bitwise(n_in: int = 512, n_out: int = 40) -> None:
    """The property, for every format (also run in the AVX2 subprocess)."""
    x = np.random.default_rng(9).standard_normal((37, n_in)).astype(np.float32)
    f = jax.jit(matmul)
    for i, fmt in enumerate(cpu_kernel.BLOCK_FORMATS):
        blocks = random_blocks(fmt, n_out, n_in, seed=i)
        stored, dense = prepare_weight(blocks, "gguf-exact", "kernel"), blocks.dequantize()
        assert isinstance(stored, KernelWeight) and stored.blocks == fmt and stored.w.dtype == jnp.uint8
        assert np.isfinite(dense).all() and len(np.unique(dense)) > n_in  # many distinct weights
        as_float32 = kernel_weight(dense, "float32")
        full = np.asarray(f(jnp.asarray(x), stored))
        assert np.array_equal(full, np.asarray(f(jnp.asarray(x), as_float32))), fmt
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 32):  # every register-tile remainder, rebuilt or not, and wave widths
            assert np.array_equal(np.asarray(f(jnp.asarray(x[:rows]), stored)), full[:rows]), (fmt, rows)
        ids = jnp.asarray([[3, 0], [39, 3]], jnp.int32)
        rows = np.asarray(jax.jit(take_rows, static_argnums=2)(stored, ids, jnp.float32))
        assert rows.shape == (2, 2, n_in) and np.array_equal(rows, dense[np.asarray(ids)]), fmt


def test_every_block_format_gives_the_float32_kernels_bits() -> None:
    check_formats_bitwise()


def test_the_avx2_variant_gives_the_same_bits() -> None:
    """The kernels built without AVX-512 (8-lane vectors, two steps a block of 32): the same property, the same
    top-k, and the sampling kernel's tokens and cut-offs, bit for bit. On a CPU with
    AVX-512 this is the variant an AVX2-only machine builds; on an AVX2 machine it is the native one."""
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        from jaxstation.kernels import cpu_kernel
        from test_cpu_kernel import check_top_k
        from test_gguf_blocks import check_formats_bitwise
        from test_sampling import sampled_rows
        assert cpu_kernel.vector_lanes() == 8, cpu_kernel.vector_lanes()
        check_formats_bitwise()
        check_top_k()
        print("sampled", sampled_rows())
        print("avx2 ok")
    """)
    env = {**os.environ, cpu_kernel.ISA_ENV: "avx2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "avx2 ok" in done.stdout, done.stdout + done.stderr[-3000:]
    assert f"sampled {sampled_rows()}" in done.stdout


def test_a_projection_stored_in_several_formats_joins_its_parts() -> None:
    """q, k and v in Q5_0, Q5_0 and Q8_0 (a Q4_K_M file's mix): each part as stored, the float32 kernel's bits over
    the joined dequantized weight at every row count; stacked for a layer scan, the layers' dense [in, out]."""
    parts = [random_blocks("Q5_0", 64, 256, seed=1), random_blocks("Q5_0", 16, 256, seed=2),
             random_blocks("Q8_0", 16, 256, seed=3)]
    joined = projection(parts)
    assert [p.fmt for p in joined] == ["Q5_0", "Q8_0"] and joined[0].shape == (80, 256)
    w = prepare_weight(joined, "gguf-exact", "kernel")
    assert isinstance(w, JoinedWeight) and [p.blocks for p in w.parts] == ["Q5_0", "Q8_0"]
    dense = np.concatenate([p.dequantize() for p in parts])  # [96, 256]
    x = jnp.asarray(np.random.default_rng(4).standard_normal((8, 256)), jnp.float32)
    want = np.asarray(jax.jit(matmul)(x, kernel_weight(dense, "float32")))
    for rows in (1, 5, 8):
        assert np.array_equal(np.asarray(jax.jit(matmul)(x[:rows], w)), want[:rows]), rows
    layers = stack([joined, projection([random_blocks("Q5_0", 96, 256, seed=5)])])
    assert layers.shape == (2, 256, 96) and np.array_equal(layers[0], dense.T)


def test_shapes_and_formats_the_kernel_cannot_take() -> None:
    assert cpu_kernel.fits_blocks("Q4_K", 512, 40) and not cpu_kernel.fits_blocks("Q4_K", 576, 40)
    assert not cpu_kernel.fits_blocks("Q4_1", 576, 6) and not cpu_kernel.fits_blocks("IQ4_NL", 576, 64)
    blocks = random_blocks("Q4_K", 8, 256, seed=1)
    odd = GGUFBlocks(blocks.data[:6], "Q4_K", (6, 256))  # 6 channels: not a multiple of 4, so dense on XLA's dot
    w = prepare_weight(odd, "gguf", "kernel")
    assert isinstance(w, jax.Array) and np.array_equal(np.asarray(w), blocks.dequantize()[:6].T)
    dense = prepare_weight(blocks, "float32", "kernel")  # other weights dequantize
    assert isinstance(dense, KernelWeight) and dense.blocks is None and dense.w.dtype == jnp.float32


def test_the_default_model_in_its_stored_blocks_gives_float32s_logits(float32_model: LoadedModel) -> None:
    """Q4_1 projections and the Q8_0 tied embedding as stored, float32-exact, at about a sixth of the float32 bytes;
    logits bit-equal to the float32 kernel's at 1, 8 and 32 rows (prompt lengths)."""
    exact = load_model(dtype="gguf-exact", layer_loop="unroll", matmul="kernel")
    p = exact.params
    assert p.embed.blocks == "Q8_0" and not p.embed.integer and p.lm_head is None
    assert {(w.blocks, w.integer) for layer in p.layers
            for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)} == {("Q4_1", False)}
    assert p.nbytes < float32_model.params.nbytes / 5
    prompt = exact.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome. " * 3)
    for rows in (1, 8, 32):
        tokens = jnp.asarray(prompt[:rows], jnp.int32)
        got = np.asarray(oracle_logits(exact, tokens))
        ref = np.asarray(oracle_logits(float32_model, tokens))
        assert np.array_equal(got, ref), (rows, np.abs(got - ref).max())
    stacked = load_model(dtype="gguf-exact", layer_loop="scan", matmul="kernel")  # one loop over stacked blocks
    assert stacked.params.layers.wqkv.blocks == "Q4_1" and stacked.params.layers.wqkv.w.shape[0] == 30
    tokens = jnp.asarray(prompt[:8], jnp.int32)
    assert np.array_equal(np.asarray(oracle_logits(stacked, tokens)),
                          np.asarray(oracle_logits(exact, tokens)))
