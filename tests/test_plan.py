"""The station's plan: every `auto` setting decided once from the settings, this machine and the model, and logged in
one line; the settings themselves parsed once and probing nothing."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from conftest import engine_config, station_plan

from jaxstation.config.plan import resolve_plan, startup_plan
from jaxstation.config.settings import ConfigError, StationConfig, resolve
from jaxstation.kernels import cpu_kernel
from jaxstation.model.default_model import default_model_path
from jaxstation.model.loader import checkpoint_config

SHAPE = {"lanes": 4, "max_seq": 512, "prefill_chunk": 32, "kv_block": 128}


def test_the_plan_on_this_machine_is_logged_once_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    config = resolve(None, {"MOONSHINE_BATCH_LANES": "4", "MOONSHINE_MAX_SEQ": "512"})
    with caplog.at_level(logging.INFO, logger="jaxstation.config.plan"):
        plan = startup_plan(config)
    assert [r.getMessage() for r in caplog.records] == [
        f"plan: backend cpu, dtype gguf (integer dot {cpu_kernel.int_dot()}), matmul kernel, layer_loop unroll, "
        "attention kernel, wave_widths 1,2,4, prefill_budget 128, speculative off, kv_dtype bfloat16"]
    assert plan == resolve_plan(config, checkpoint_config(None))


def test_settings_are_parsed_once_and_keep_their_meaning() -> None:
    config = StationConfig(**SHAPE, wave_widths="2, 1", prefill_budget="off")
    assert (config.wave_widths, config.prefill_budget) == ((1, 2, 4), 0)
    assert dataclasses.replace(config, max_seq=256) == StationConfig(**{**SHAPE, "max_seq": 256}, wave_widths="1,2",
                                                                     prefill_budget="off")
    plan = resolve_plan(config, checkpoint_config(None))
    assert (plan.wave_widths, plan.prefill_budget) == ((1, 2, 4), 0)


def test_a_link_to_a_gguf_file_plans_as_the_file_does(tmp_path) -> None:
    """The container image serves /opt/jaxstation/model, a link with no suffix: its plan is the linked file's."""
    (tmp_path / "model").symlink_to(default_model_path())
    linked = StationConfig(**SHAPE, model=str(tmp_path / "model"))
    assert linked.model_is_gguf
    assert resolve_plan(linked, checkpoint_config(linked.model)) == resolve_plan(StationConfig(**SHAPE),
                                                                              checkpoint_config(None))


def test_a_mesh_runs_full_waves_and_no_packing() -> None:
    cfg = checkpoint_config(None)
    station = resolve_plan(StationConfig(**SHAPE, layers="0:15"), cfg)
    host = resolve_plan(StationConfig(**SHAPE, stations="http://127.0.0.1:1"), cfg)
    assert station == host
    assert str(host) == (f"backend cpu, dtype gguf (integer dot {cpu_kernel.int_dot()}), matmul kernel, "
                         "layer_loop unroll, attention kernel, wave_widths 4, prefill_budget off, speculative off, "
                         "kv_dtype bfloat16")


def test_speculation_is_planned_where_waves_run_narrow_and_refused_elsewhere() -> None:
    config = engine_config(speculative="ngram")
    assert station_plan(config).speculative == "ngram"
    with pytest.raises(ConfigError, match="MOONSHINE_SPECULATIVE=ngram verifies drafts in narrow waves"):
        station_plan(engine_config(speculative="ngram", matmul="xla", dtype="float32"))
    with pytest.raises(ConfigError, match="MOONSHINE_SPECULATIVE='nope' must be one of off, ngram"):
        engine_config(speculative="nope")


def test_the_arena_is_bfloat16_for_integer_products_where_the_kernel_reads_it_and_the_activations_elsewhere() -> None:
    """The integer path's arena halves to bfloat16 by default; float32 and gguf-exact weights keep float32's exact
    bits, as does the blocked walk (which reads the activations' dtype); a setting is taken as asked."""
    assert station_plan(engine_config()).kv_dtype == "bfloat16"
    assert station_plan(engine_config(dtype="gguf-exact")).kv_dtype == "float32"
    assert station_plan(engine_config(dtype="float32")).kv_dtype == "float32"
    assert station_plan(engine_config(attention="blocked")).kv_dtype == "float32"
    assert station_plan(engine_config(kv_dtype="int8")).kv_dtype == "int8"
    assert station_plan(engine_config(kv_dtype="float32")).kv_dtype == "float32"


@pytest.mark.parametrize("kv_dtype", ["auto", "float32", "bfloat16", "int8"])
def test_a_smaller_arena_takes_the_attention_kernel(kv_dtype: str) -> None:
    """The kernel reads a bfloat16 or int8 arena in place, so float32 activations keep it whatever the arena's dtype;
    the blocked walk stays one setting away."""
    assert station_plan(engine_config(kv_dtype=kv_dtype)).attention == "kernel"
    assert station_plan(engine_config(kv_dtype=kv_dtype, attention="kernel")).attention == "kernel"
    assert station_plan(engine_config(kv_dtype=kv_dtype, attention="blocked")).attention == "blocked"
