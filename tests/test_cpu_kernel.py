"""The CPU kernels (jaxstation/kernels/cpu_kernel.py): they build here, the matmul computes x @ w.T (* scale), the
norm HF's RMSNorm, the top-k `jax.lax.top_k`'s, the LoRA delta x A^T B^T from each row's slot and the sampled rows'
bits JAX's Threefry's, every row's bits are independent of the other rows in the call, and the station picks them by
default on CPU for float32, int8 and a GGUF model's stored blocks (tests/test_gguf_blocks.py)."""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import oracle_logits

from jaxstation.config.plan import Plan, resolve_plan
from jaxstation.config.settings import ConfigError, StationConfig
from jaxstation.engine.sampling import row_bits
from jaxstation.kernels import cpu_kernel
from jaxstation.model.loader import LoadedModel, checkpoint_config, load_model
from jaxstation.model.quant import KernelWeight, QuantWeight, kernel_weight, matmul, prepare_weight

SHAPES = [(576, 960), (1536, 576), (64, 4)]  # [in, out]: the default model's, and a small one


def test_the_kernel_builds_and_is_the_cpu_default() -> None:
    # CI's machine is x86-64 with AVX2 and a compiler: a kernel that silently failed to build would fail here
    assert platform.machine() == "x86_64" and {"avx2", "fma", "f16c"} <= cpu_kernel.cpu_info()[1]
    assert cpu_kernel.available()
    flags = cpu_kernel.cpu_info()[1]
    assert cpu_kernel.vector_lanes() == (16 if "avx512f" in flags else 8)
    assert cpu_kernel.int_dot_isa() == ("avx512-vnni" if "avx512_vnni" in flags else "avx512" if "avx512f" in flags
                                        else "avx-vnni" if "avx_vnni" in flags else "avx2")
    cfg = checkpoint_config(None)  # the default model's; the weight format depends on the model's path alone

    def plan(**settings) -> Plan:
        return resolve_plan(StationConfig(**settings), cfg)

    assert plan().matmul == "kernel" and plan().dtype == "gguf"  # the default model's blocks, integer products
    amx = cpu_kernel.int_amx()  # the default build: AMX where the CPU has it and Linux grants it
    assert amx == "amx" or (amx.startswith("off: ") and not {"amx_tile", "amx_int8"} <= flags) or "refused" in amx
    why = f" (amx {amx})" if amx.startswith("off: ") and {"amx_tile", "amx_int8"} <= flags else ""
    assert plan().int_dot == cpu_kernel.int_dot() == cpu_kernel.int_dot_isa() + (" + amx" if amx == "amx" else why)
    assert f"dtype gguf (integer dot {plan().int_dot})" in str(plan())
    assert plan(dtype="gguf-exact").int_dot is None and "dtype gguf-exact," in str(plan(dtype="gguf-exact"))
    assert plan(model="tests/fixtures/tiny-llama3").dtype == "float32"
    assert plan(matmul="xla").dtype == "float32"
    assert plan(dtype="int8").matmul == "kernel"
    assert plan(dtype="int8").layer_loop == "unroll"  # the kernel reads each layer's int8 weights in place
    assert plan(dtype="bfloat16").matmul == "xla"
    assert plan(matmul="xla").matmul == "xla"
    assert plan(dtype="int8", matmul="xla").layer_loop == "scan"
    with pytest.raises(ConfigError,
                       match="MOONSHINE_MATMUL=kernel takes float32, int8, gguf, gguf-exact weights, not bfloat16"):
        plan(dtype="bfloat16", matmul="kernel")
    with pytest.raises(ConfigError, match="--dtype=gguf needs the CPU kernel"):
        plan(dtype="gguf", matmul="xla", sources={"dtype": "--dtype"})
    with pytest.raises(ConfigError, match="MOONSHINE_DTYPE=gguf needs a .gguf model, not tests/fixtures/tiny-llama3"):
        plan(dtype="gguf", model="tests/fixtures/tiny-llama3")
    with pytest.raises(ConfigError, match="--dtype=gguf-exact needs the CPU kernel"):
        plan(dtype="gguf-exact", matmul="xla", sources={"dtype": "--dtype"})
    with pytest.raises(ConfigError, match="MOONSHINE_MATMUL='fast' must be one of auto, xla, kernel"):
        StationConfig(matmul="fast")


def test_a_compiler_that_fails_names_what_it_compiled(tmp_path, monkeypatch) -> None:
    """A build (an empty cache, a compiler that exits 1) raises one line naming the source (or the precompiled header),
    and leaves no library."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(cpu_kernel.KernelUnavailable, match=r"^compiling \w+\.(cc|h) failed"):
        cpu_kernel._build()
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))


def _weights(n_in: int, n_out: int, weights: str, seed: int = 0) -> tuple[KernelWeight, np.ndarray]:
    """A kernel weight and the float64 [in, out] matrix it stands for."""
    w = np.random.default_rng(seed).standard_normal((n_in, n_out)).astype(np.float32)
    kw = prepare_weight(w, weights, "kernel")
    assert isinstance(kw, KernelWeight) and kw.w.shape == (n_out, n_in)
    dense = np.asarray(kw.w, np.float64).T
    return kw, dense if kw.scale is None else dense * np.asarray(kw.scale, np.float64)


@pytest.mark.parametrize("weights", ["float32", "int8"])
@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_kernel_computes_the_product(weights: str, n_in: int, n_out: int) -> None:
    kw, dense = _weights(n_in, n_out, weights)
    x = np.random.default_rng(1).standard_normal((2, 5, n_in)).astype(np.float32)  # leading dims are rows
    got = np.asarray(jax.jit(matmul)(jnp.asarray(x), kw))
    assert got.shape == (2, 5, n_out) and got.dtype == np.float32
    np.testing.assert_allclose(got, x.astype(np.float64) @ dense, rtol=1e-4, atol=1e-4 * np.sqrt(n_in))


@pytest.mark.parametrize("weights", ["float32", "int8"])
@pytest.mark.parametrize("n_in,n_out", SHAPES[:2])
def test_a_rows_bits_do_not_depend_on_the_other_rows(weights: str, n_in: int, n_out: int) -> None:
    kw, _ = _weights(n_in, n_out, weights, seed=2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((33, n_in)).astype(np.float32)
    f = jax.jit(matmul)
    full = np.asarray(f(jnp.asarray(x), kw))
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32):  # every register-tile remainder, rebuilt or not
        assert np.array_equal(np.asarray(f(jnp.asarray(x[:rows]), kw)), full[:rows]), rows
    perm = rng.permutation(33)
    assert np.array_equal(np.asarray(f(jnp.asarray(x[perm]), kw)), full[perm])
    others = x.copy()
    others[1:] = rng.standard_normal((32, n_in)).astype(np.float32) * 1e3
    assert np.array_equal(np.asarray(f(jnp.asarray(others), kw))[0], full[0])



def test_the_kernels_workers_give_xlas_pools_bits_under_concurrent_callers() -> None:
    """The kernels' own spinning workers (cpu_kernels.h) and XLA's intra-op pool give the same bits, also when several
    threads call kernels at once (the pool runs one caller's job; the others hand theirs to XLA's pool)."""
    import threading

    kw, _ = _weights(576, 960, "int8", seed=4)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 576)).astype(np.float32))
    f = jax.jit(matmul)
    try:
        cpu_kernel.set_spin_us(0)
        want = np.asarray(f(x, kw))
        cpu_kernel.set_spin_us(200)
        got, errors = [], []

        def calls() -> None:
            try:
                got.extend(np.asarray(f(x, kw)) for _ in range(50))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=calls) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and not any(t.is_alive() for t in threads)
        assert len(got) == 200 and all(np.array_equal(g, want) for g in got)
    finally:
        cpu_kernel.set_spin_us(cpu_kernel.SPIN_US)


def check_top_k() -> None:
    """The top-k kernel gives jax.lax.top_k's values and indices: random rows (a 262,144-token vocabulary's), ascending
    rows (every value displaces the k-th), ties (lower index first), and float32's total order (NaN, -0, inf)."""
    rng = np.random.default_rng(0)
    cases = [rng.standard_normal((3, 262144)).astype(np.float32),
             np.sort(rng.standard_normal((2, 1000)).astype(np.float32)),
             rng.integers(-3, 3, (5, 77)).astype(np.float32),
             np.array([[0.0, -0.0, 1.0, np.nan, 1.0, -np.inf, np.inf, -np.nan, -0.0, 0.0]], np.float32)]
    for x in cases:
        for k in (1, 5, 10):
            got = jax.jit(cpu_kernel.top_k, static_argnums=1)(jnp.asarray(x), k)
            want = jax.lax.top_k(jnp.asarray(x), k)
            assert np.array_equal(np.asarray(got[1]), np.asarray(want[1])), (x.shape, k)
            assert np.array_equal(np.asarray(got[0]), np.asarray(want[0]), equal_nan=True), (x.shape, k)


def test_the_top_k_kernel_is_lax_top_k() -> None:
    check_top_k()


def test_the_row_max_kernel_is_jnp_max_and_the_first_argmax() -> None:
    """Rows of 49,152 and odd lengths: maxima and first indices as XLA's reductions give them, ties (the first wins,
    +0 and -0 equal), -inf rows; a row with a NaN anywhere has the maximum NaN and the last index (XLA's CPU max
    passes over it); each row alone as among others."""
    rng = np.random.default_rng(3)
    for n in (49152, 37, 1):
        x = rng.standard_normal((9, n)).astype(np.float32)
        x[1, n // 3] = x[1, n - 1] = x[1].max() + 1  # a tie: the first
        x[2] = -np.inf
        x[3, n // 2] = np.nan
        x[4] = np.round(x[4])  # many ties
        x[5] = 0.0
        x[5, n - 1] = -0.0
        x[6, :] = -0.0
        x[6, n // 2] = 0.0
        x[7] = x[7] * 1e30
        xs = jnp.asarray(x)
        top, at = jax.jit(cpu_kernel.row_max)(xs)
        iota = np.arange(n)
        want_max = np.asarray(jax.jit(lambda x: jnp.max(x, axis=-1))(xs))
        want_at = np.minimum(np.where(x == want_max[:, None], iota, n).min(axis=-1), n - 1)
        finite = np.arange(9) != 3
        np.testing.assert_array_equal(np.asarray(top)[finite], want_max[finite])  # +0 == -0
        assert np.array_equal(np.asarray(at)[finite], want_at[finite]), (n, np.asarray(at), want_at)
        assert np.asarray(at)[3] == n - 1 and np.isnan(np.asarray(top)[3])
        for r in range(9):
            alone_top, alone_at = jax.jit(cpu_kernel.row_max)(xs[r:r + 1])
            assert int(alone_at[0]) == int(at[r])
            assert np.array_equal(np.asarray(alone_top)[0], np.asarray(top)[r], equal_nan=True)


@pytest.mark.parametrize("d", [576, 577, 64])
def test_the_norm_kernel_is_rms_norm_and_row_invariant(d: int) -> None:
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((33, d)) * rng.uniform(0.01, 30, (33, 1))).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    f = jax.jit(lambda x: cpu_kernel.rms_norm(x, jnp.asarray(w), 1e-5))
    full = np.asarray(f(jnp.asarray(x)))
    x64 = x.astype(np.float64)
    expected = w * x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(full, expected, rtol=2e-6, atol=1e-6)
    for rows in (1, 2, 3, 16):
        assert np.array_equal(np.asarray(f(jnp.asarray(x[:rows]))), full[:rows]), rows
    others = x.copy()
    others[1:] *= 1e3
    assert np.array_equal(np.asarray(f(jnp.asarray(others)))[0], full[0])
    assert np.array_equal(np.asarray(jax.jit(lambda x: cpu_kernel.rms_norm(x, jnp.asarray(w), 1e-5))(
        jnp.asarray(x[:6].reshape(2, 3, d)))), full[:6].reshape(2, 3, d))


@pytest.mark.parametrize(("d", "outs"), [(576, (576, 192, 192)), (1536, (576,)), (577, (33, 65))])
def test_the_lora_kernel_is_each_rows_own_adapters_delta(d: int, outs: tuple[int, ...]) -> None:
    """x A^T B^T per row from the row's slot, near float64's; a row's bits alone, beside others, in another slot order
    or at another row count are the same, and slot 0 (zeros) adds nothing to any output."""
    rng = np.random.default_rng(8)
    slots, rank, rows, q = 4, 8, 6, 3
    a = rng.standard_normal((slots, d, len(outs) * rank)).astype(np.float32)
    b = [rng.standard_normal((slots, rank, o)).astype(np.float32) for o in outs]
    a[0], b = 0.0, [np.concatenate([np.zeros_like(part[:1]), part[1:]]) for part in b]
    x = rng.standard_normal((rows, q, d)).astype(np.float32)
    ids = np.array([1, 0, 3, 2, 1, 3], np.int32)
    f = jax.jit(lambda x, ids: cpu_kernel.lora_delta(x, jnp.asarray(a), tuple(map(jnp.asarray, b)), ids))
    full = np.asarray(f(x, ids))
    h = np.einsum("mqd,mdr->mqr", x.astype(np.float64), a[ids].astype(np.float64))
    expected = np.concatenate([np.einsum("mqr,mro->mqo", h[..., j * rank:(j + 1) * rank], part[ids].astype(np.float64))
                               for j, part in enumerate(b)], axis=-1)
    np.testing.assert_allclose(full, expected, rtol=1e-5, atol=2e-4)
    assert not full[ids == 0].any()
    for r in range(rows):
        assert np.array_equal(np.asarray(f(x[r:r + 1], ids[r:r + 1])), full[r:r + 1]), r
    order = np.array([5, 2, 0, 4, 1, 3])
    assert np.array_equal(np.asarray(f(x[order], ids[order])), full[order])
    others = x.copy()
    others[1:] *= 1e3
    assert np.array_equal(np.asarray(f(others, ids))[0], full[0])


def test_the_row_bits_kernel_gives_jaxs_threefry_bits() -> None:
    """The bits a sampled row draws with on the kernels are `sampling.row_bits`' (JAX's Threefry), so a seed gives
    the same tokens on the kernels' path as the bits JAX computes would: every seed and counter edge and 1,000 more."""
    rng = np.random.default_rng(9)
    seed = np.concatenate([[0, 1, 2**32 - 1, 123456789], rng.integers(0, 2**32, 1000)]).astype(np.uint32)
    counter = np.concatenate([[0, 1, 2**31 - 1, -1], rng.integers(-2**31, 2**31, 1000)]).astype(np.int32)
    want = np.asarray(jax.jit(row_bits)(seed, counter))
    assert want.shape == (1004, 2) and len(np.unique(want[:, 0])) > 990
    assert np.array_equal(np.asarray(jax.jit(cpu_kernel.row_bits)(seed, counter)), want)


def test_shapes_the_kernel_cannot_take_stay_on_xla() -> None:
    assert cpu_kernel.fits(576, 960) and not cpu_kernel.fits(48, 64) and not cpu_kernel.fits(64, 6)
    w = np.ones((48, 64), np.float32)
    assert isinstance(prepare_weight(w, "int8", "kernel"), QuantWeight)
    assert isinstance(prepare_weight(w, "float32", "kernel"), jax.Array)
    with pytest.raises(ValueError,
                       match="the CPU kernel takes float32, int8, gguf or gguf-exact weights, not bfloat16"):
        kernel_weight(np.ones((64, 64), np.float32), "bfloat16")


def _full_logits(model: LoadedModel, prompt: list[int]) -> np.ndarray:
    return np.asarray(oracle_logits(model, jnp.asarray(prompt, jnp.int32)))


PROMPT = list(range(100, 148))


def test_the_default_models_exact_blocks_on_the_kernel_match_xla(exact_model: LoadedModel,
                                                                 xla_model: LoadedModel) -> None:
    xla = xla_model
    assert exact_model.params.row_invariant and not xla.params.row_invariant
    got, ref = _full_logits(exact_model, PROMPT), _full_logits(xla, PROMPT)
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
    assert np.abs(got - ref).max() < 2e-3  # float32, two summation orders


def test_int8_on_the_kernel_matches_int8_on_xla(int8_kernel_model: LoadedModel) -> None:
    kernel = int8_kernel_model
    xla = load_model(dtype="int8", layer_loop="unroll", matmul="xla")
    p = kernel.params
    for w in (p.embed, *(w for layer in p.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))):
        assert isinstance(w, KernelWeight) and w.w.dtype == jnp.int8 and w.scale.dtype == jnp.float32
    assert p.nbytes == xla.params.nbytes  # the same int8 values and scales, laid out out-major
    got, ref = _full_logits(kernel, PROMPT), _full_logits(xla, PROMPT)
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
    assert np.abs(got - ref).max() < 2e-3


@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_kernel(window: int | None) -> None:
    """Against a float64 softmax over each row's own positions (a row at the last position, the scratch slot, over
    itself only); a row's bits do not depend on the other rows."""
    rng = np.random.default_rng(4)
    layers, lanes, seq, kvh, group, hd = 2, 5, 40, 2, 3, 32
    k = rng.standard_normal((layers, lanes, seq, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((layers, lanes, seq, kvh, hd)).astype(np.float32)
    q = rng.standard_normal((4, kvh * group, hd)).astype(np.float32)
    row_lanes = np.array([3, 0, 4, 1], np.int32)
    positions = np.array([0, 17, 39, 8], np.int32)
    f = jax.jit(lambda q, lanes, pos: cpu_kernel.decode_attention(q, jnp.asarray(k), jnp.asarray(v), 1, lanes, pos,
                                                                  window))
    got = np.asarray(f(q, row_lanes, positions))
    for r, (lane, pos) in enumerate(zip(row_lanes, positions, strict=True)):
        lo = pos if pos == seq - 1 else 0 if window is None else max(0, pos - window + 1)  # the scratch slot: itself
        for h in range(kvh * group):
            keys, vals = k[1, lane, lo:pos + 1, h // group], v[1, lane, lo:pos + 1, h // group]
            s = keys.astype(np.float64) @ q[r, h] / np.sqrt(hd)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[r, h], (p / p.sum()) @ vals, rtol=1e-5, atol=1e-5)
    for rows in ([2], [3, 1], [0, 1, 2]):
        part = np.asarray(f(q[rows], row_lanes[rows], positions[rows]))
        assert np.array_equal(part, got[rows])
    with pytest.raises(Exception, match="lane or position out of range"):
        f(q[:1], np.array([5], np.int32), np.array([0], np.int32)).block_until_ready()
