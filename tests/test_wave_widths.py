"""Narrow decode waves: a row-invariant engine runs a wave at the narrowest width that holds its live lanes, and a
request's tokens and logits are bit-equal at every width, in any lane, beside any neighbours."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import prefill_all, tiny_model
from test_batch_invariance import TARGET, run_wave

from jaxstation.config.plan import resolve_plan
from jaxstation.config.settings import ConfigError, StationConfig
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, SamplingParams
from jaxstation.engine.rules import default_wave_widths
from jaxstation.model.loader import LoadedModel

STEPS = 4
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=77)]


def test_default_widths(default_model: LoadedModel) -> None:
    assert default_wave_widths(1, narrow=True) == (1,)
    assert default_wave_widths(4, narrow=True) == (1, 2, 4)
    assert default_wave_widths(6, narrow=True) == (1, 2, 4, 6)
    assert default_wave_widths(32, narrow=True) == (1, 2, 4, 8, 16, 32)
    assert default_wave_widths(32, narrow=False) == (32,)
    assert StationConfig(lanes=32).wave_widths == "auto"  # the plan's choice
    assert StationConfig(lanes=32, wave_widths="full").wave_widths == (32,)
    assert StationConfig(lanes=32, wave_widths="16, 1,4").wave_widths == (1, 4, 16, 32)
    cfg = default_model.cfg
    assert resolve_plan(StationConfig(lanes=32), cfg).wave_widths == (1, 2, 4, 8, 16, 32)
    assert resolve_plan(StationConfig(lanes=32, matmul="xla"), cfg).wave_widths == (32,)
    narrow_without_kernel = r"decode waves narrower than the arena need every matmul on the CPU kernel and the " \
                            r"blocked or kernel attention \(matmul kernel: False, attention kernel\)"
    with pytest.raises(ConfigError, match=r"--wave-widths asks for waves of 1,4,32 rows: " + narrow_without_kernel):
        resolve_plan(StationConfig(lanes=32, matmul="xla", wave_widths="1,4", sources={"wave_widths": "--wave-widths"}),
                     cfg)
    with pytest.raises(ConfigError, match=r"MOONSHINE_WAVE_WIDTHS='1,64': every width must lie in \[1, "
                                          r"MOONSHINE_BATCH_LANES=32\]"):
        StationConfig(lanes=32, wave_widths="1,64")
    with pytest.raises(ConfigError, match="must be auto, full or a comma-separated list"):
        StationConfig(wave_widths="narrow")


def test_narrow_waves_need_the_kernel_and_the_blocked_attention(default_model: LoadedModel) -> None:
    assert Engine(default_model, lanes=8, max_seq=128, chunk=32, block=128).wave_widths == (1, 2, 4, 8)
    xla = tiny_model("tiny-llama3", "float32", "unroll", matmul="xla")
    assert Engine(xla, lanes=8, max_seq=64, chunk=8, block=16).wave_widths == (8,)
    with pytest.raises(ValueError, match="need every matmul on the CPU kernel"):
        Engine(xla, lanes=8, max_seq=64, chunk=8, block=16, wave_widths=(1, 8))
    kernel = tiny_model("tiny-llama3", "float32", "unroll", matmul="kernel")
    assert Engine(kernel, lanes=8, max_seq=64, chunk=8, block=16, attention="xla").wave_widths == (8,)
    with pytest.raises(ValueError, match=r"include lanes \(8\)"):
        Engine(kernel, lanes=8, max_seq=64, chunk=8, block=16, wave_widths=(1, 4))


def _widths_seen(engine: Engine, lanes: dict, steps: int) -> tuple[dict, list[int]]:
    """run_wave, recording the width of every decode wave."""
    seen: list[int] = []
    wave = engine._wave

    def recording(rows, width, return_logits):
        seen.append(width)
        return wave(rows, width, return_logits)

    engine._wave = recording
    try:
        return run_wave(engine, lanes, steps), seen
    finally:
        del engine._wave


def _neighbours(engine: Engine, target_lane: int, n: int, rng: np.random.Generator) -> dict:
    others = [i for i in range(engine.lanes) if i != target_lane]
    rng.shuffle(others)
    lanes = {}
    for j, other in enumerate(others[:n]):
        # the first neighbour is past one KV block, so the wave walks more blocks than the target needs; the rest are
        # short (one prefill chunk each)
        length = int(rng.integers(129, 150)) if j == 0 else int(rng.integers(2, engine.chunk))
        prompt = rng.integers(3, engine.cfg.vocab_size, length).tolist()
        sp = SamplingParams(temperature=1.0, top_p=0.8, seed=int(rng.integers(1 << 31))) if other % 2 else \
            SamplingParams()
        lanes[other] = (prompt, sp)
    return lanes


# gguf (the default model's blocks as stored): the wide engine, the target among 15 others at full width; int8: the
# station shape, widths 1, 2 and 4
WIDTH_CHECKS = {"gguf": ("wide_engine", [(7, 2, 4), (12, 15, 16)]),
                "int8": ("int8_engine", [(1, 1, 2), (3, 3, 4)])}


@pytest.mark.parametrize("weights", ["gguf", "int8"])
def test_bits_are_equal_at_every_width(weights: str, request) -> None:
    fixture, placements = WIDTH_CHECKS[weights]
    engine: Engine = request.getfixturevalue(fixture)
    rng = np.random.default_rng(5)
    for sp in SAMPLINGS:
        ref, seen = _widths_seen(engine, {0: (TARGET, sp)}, STEPS)
        assert set(seen) == {1}
        for lane, n_others, width in placements:
            lanes = {lane: (TARGET, sp), **_neighbours(engine, lane, n_others, rng)}
            got, seen = _widths_seen(engine, lanes, STEPS)
            assert set(seen) == {width}
            assert got[lane][0] == ref[0][0], f"{weights} {sp}: tokens differ at width {width}"
            for step, (a, b) in enumerate(zip(got[lane][1], ref[0][1], strict=True)):
                assert np.array_equal(a, b), f"{weights} width {width} step {step}: max abs {np.abs(a - b).max()}"


def test_a_wave_narrows_as_lanes_retire(engine: Engine) -> None:
    """Continuous batching: as neighbours finish, the same request moves to a narrower wave and keeps its bits."""
    assert engine.wave_widths == (1, 2, 4)
    ref = run_wave(engine, {2: (TARGET, SamplingParams())}, 6)[2]
    rng = np.random.default_rng(9)
    others = {lane: rng.integers(3, 49152, 40).tolist() for lane in (0, 1, 3)}
    sample, _ = prefill_all(engine, 2, TARGET, SamplingParams())
    for lane, prompt in others.items():
        prefill_all(engine, lane, prompt, SamplingParams())
    tokens, widths = [sample.token], []
    for step in range(6):
        rows: list[DecodeRow | None] = [None] * engine.lanes
        rows[2] = DecodeRow(tokens[-1], len(TARGET) + step, SamplingParams(), step + 1)
        for lane, prompt in list(others.items())[:max(0, 3 - step)]:  # one neighbour retires per wave
            rows[lane] = DecodeRow(1, len(prompt) + step, SamplingParams(), step + 1)
        live = sum(r is not None for r in rows)
        widths.append(next(w for w in engine.wave_widths if w >= live))
        tokens.append(engine.decode(rows)[0][2].token)
    assert tokens == ref[0]
    assert widths == [4, 4, 2, 1, 1, 1]
