"""The warm-up: one step lowers and compiles every step's program on every core at once, after which no step compiles;
its step times are kept in a file beside the compilation cache, so a warm-up of the same engine on the same machine
runs no step to time it; and an engine warmed up either way gives a request the tokens it gets from the other."""

from __future__ import annotations

from conftest import tiny_model

from jaxstation.config.coldstart import CompileCount
from jaxstation.engine.engine import Engine, generate
from jaxstation.engine.rows import SamplingParams
from jaxstation.engine.warmup import StepTimes

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=5)


def _engine(lanes: int = 4, max_seq: int = 96) -> Engine:
    """A tiny Llama on the CPU kernel: narrow waves and packed steps, shapes no other test compiles (max_seq)."""
    model = tiny_model("tiny-llama3", layer_loop="unroll", matmul="kernel")
    return Engine(model, lanes=lanes, max_seq=max_seq, chunk=16, block=16, attention="kernel", prefill_budget=32)


def test_the_programs_step_compiles_every_step_and_the_steps_after_it_compile_nothing() -> None:
    engine = _engine()
    steps = engine.warmup_steps()
    names = [name for name, _ in steps]
    at = names.index("programs")
    assert names[:at] == ["begin", "prefix_copy"]
    assert names[at + 1:] == ["decode_1", "decode_2", "decode", "pack_16", "pack_32"]
    for _, run in steps[:at]:
        run()
    arena = engine.arena
    count = CompileCount()
    steps[at][1]()
    assert engine.arena is arena and engine.lowering is None  # lowered, compiled, nothing ran
    assert count.delta()[0] == 5  # a program each
    count = CompileCount()
    for _, run in steps[at + 1:]:
        run()
    assert count.delta() == (0, 0)
    timed = set(engine.step_s)  # every wave, and the packed steps from the narrowest up (warmup.DECODE_WAIT)
    assert timed - {("pack", 32, 4)} == {("decode", 1), ("decode", 2), ("decode", 4), ("pack", 16, 4)}


def test_step_times_are_kept_and_a_second_warm_up_runs_no_step_to_time_them(tmp_path) -> None:
    first = _engine(max_seq=112)
    first.step_times = StepTimes(tmp_path, first)
    first.warmup()
    kept = first.step_times.path
    assert kept.parent.parent == tmp_path and StepTimes(tmp_path, first).load() == first.step_s
    assert len(first.step_s) >= 4 and all(t > 0 for t in first.step_s.values())
    written = kept.stat().st_mtime_ns

    second = _engine(max_seq=112)
    second.step_times = StepTimes(tmp_path, second)
    assert second.step_times.path == kept
    second.step_s.update(second.step_times.load())
    second.warmup()
    assert second.step_s == first.step_s and kept.stat().st_mtime_ns == written  # nothing timed, nothing written
    assert StepTimes(tmp_path, _engine(lanes=2, max_seq=112)).path != kept  # other shapes, another file
    prompt = list(range(5, 40))
    assert generate(second, prompt, 6, SEEDED, lane=1) == generate(first, prompt, 6, SEEDED, lane=1)


def test_an_unreadable_times_file_reads_as_none_and_is_written_over(tmp_path) -> None:
    engine = _engine(max_seq=112)
    times = StepTimes(tmp_path, engine)
    times.path.parent.mkdir(parents=True)
    times.path.write_text("{not json")
    assert times.load() == {}
    times.save({("decode", 1): 0.5, ("pack", 16, 4): 1.5})
    assert times.load() == {("decode", 1): 0.5, ("pack", 16, 4): 1.5}
