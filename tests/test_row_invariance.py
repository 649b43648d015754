"""Each family's decoder layer, run as the station runs it on the CPU kernels, gives every row the same bits at every
width a plan uses: the decode waves' 1, 2, 4 and 8 rows and the packed steps' 16 to 128, against the same rows run at
128. And by construction: a row-invariant layer leaves XLA no float reduction (no norm on XLA's own ops, no XLA dot),
since XLA's fusions computed a norm's row differently at different row counts (jax 0.10 on Gemma's sandwich norms).

`layer_rows` is one layer without its attention (which reads the arena: tests/test_wave_widths.py covers it through
whole steps); the real Gemma 3 file's layers and head run the same check in tests/test_gemma3_270m.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

from jaxstation.model.config import ModelConfig
from jaxstation.model.layers import LayerParams, Params, attn_out, lm_logits, mlp_block, qkv_proj, rotary, rotary_at
from jaxstation.model.loader import LoadedModel

WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # the decode waves' and the packed steps' widths below FULL
FULL = 128
FAMILIES = ("tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3")
# float reductions XLA would vectorize by the whole shape, and its own norm
XLA_REDUCTIONS = {"dot_general", "reduce_sum", "rsqrt", "cumsum", "reduce_precision"}


def layer_rows(cfg: ModelConfig, layer: LayerParams, index: int, x: jax.Array, o: jax.Array,
               positions: jax.Array) -> tuple[jax.Array, ...]:
    """Layer `index` on rows x [rows, 1, d], with o [rows, 1, heads * head_dim] in place of its attention's output:
    q, k, v and the layer's output."""
    q, k, v = qkv_proj(cfg, layer, x, rotary_at(cfg, rotary(cfg, positions), index))
    return q, k, v, mlp_block(cfg, layer, attn_out(cfg, layer, x, o))


def layer_inputs(cfg: ModelConfig, rows: int, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 3, (rows, 1, cfg.hidden_size)).astype(np.float32)
    o = rng.normal(0, 1, (rows, 1, cfg.num_heads * cfg.head_dim)).astype(np.float32)
    positions = rng.integers(0, 200, (rows, 1)).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(o), jnp.asarray(positions)


def assert_rows_equal_at_every_width(fn: Callable[..., object], weights: object, *full_args: jax.Array,
                                     what: str = "") -> None:
    """fn(weights, *rows)'s outputs on the first w rows of full_args equal the first w rows of its outputs on all FULL
    rows. The weights are arguments, not constants folded into each width's program."""
    fn = jax.jit(fn)
    full = [np.asarray(a) for a in jax.tree_util.tree_leaves(fn(weights, *full_args))]
    for width in WIDTHS:
        part = jax.tree_util.tree_leaves(fn(weights, *(a[:width] for a in full_args)))
        for i, (got, want) in enumerate(zip(part, full, strict=True)):
            got = np.asarray(got)
            assert np.array_equal(got, want[:width]), \
                f"{what} output {i} at {width} rows: max abs {np.abs(got - want[:width]).max()}"


def primitives(fn: Callable[..., object], *args: jax.Array) -> set[str]:
    """Every primitive in fn's jaxpr, nested ones included."""

    def walk(jaxpr) -> Iterator[str]:
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from walk(inner)

    return set(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def row_invariant_parts(cfg: ModelConfig, params: Params, layers: Iterable[int] | None = None
                        ) -> dict[str, tuple[Callable[..., object], object, tuple]]:
    """The pieces of a step that must not depend on the row count, as (fn, weights, FULL rows of inputs) with
    fn(weights, *rows): the layers (every one unless `layers` names some) and the head."""
    x, o, positions = layer_inputs(cfg, FULL)
    parts = {f"layer {i}": (lambda w, x, o, p, i=i: layer_rows(cfg, w, i, x, o, p), params.layers[i], (x, o, positions))
             for i in (range(len(params.layers)) if layers is None else layers)}
    parts["head"] = (lambda w, h: lm_logits(cfg, w, h), params, (x[:, 0],))
    return parts


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> tuple[ModelConfig, Params]:
    model = tiny_model(request.param, "float32", "unroll", matmul="kernel")
    assert model.params.row_invariant
    return model.cfg, model.params


def test_a_row_invariant_step_leaves_xla_no_float_reduction(family: tuple[ModelConfig, Params]) -> None:
    cfg, params = family
    for name, (fn, weights, args) in row_invariant_parts(cfg, params).items():
        assert not (found := primitives(fn, weights, *args) & XLA_REDUCTIONS), f"{name}: {found}"


def test_every_layer_and_the_head_are_bit_equal_at_every_width(family: tuple[ModelConfig, Params]) -> None:
    cfg, params = family
    for name, (fn, weights, args) in row_invariant_parts(cfg, params).items():
        assert_rows_equal_at_every_width(fn, weights, *args, what=name)


def test_the_default_models_q4_1_layer_and_head_are_bit_equal_at_every_width(default_model: LoadedModel) -> None:
    """The default GGUF's blocks as a station loads them (Q4_1 projections and the tied Q8_0 head, repacked into the
    integer products' tiles) at its real shapes."""
    cfg, params = default_model.cfg, default_model.params
    assert params.row_invariant and (params.layers[0].wqkv.blocks, params.embed.blocks) == ("Q4_1R", "Q8_0R")
    for name, (fn, weights, args) in row_invariant_parts(cfg, params, layers=[0]).items():
        assert not (found := primitives(fn, weights, *args) & XLA_REDUCTIONS), f"{name}: {found}"
        assert_rows_equal_at_every_width(fn, weights, *args, what=name)
