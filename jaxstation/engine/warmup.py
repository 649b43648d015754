"""An engine's warm-up, and the step times it leaves for the scheduler's packed turns.

The warm-up compiles every step shape a station uses, so that no request waits on a compiler: its "programs" step
lowers each step's programs one after another (tracing is Python) and then compiles them, or reads them from the
persistent cache, on every core at once. Then it runs each step once on lane 0 (and on more lanes where a packed step
is wider than one context), greedy, timed into `Engine.step_s`: every decode wave, and the packed steps from the
narrowest up, until one takes more than DECODE_WAIT of the widest wave. `turn_rows` reads those times to keep a packed
turn that carries decode rows within DECODE_WAIT of their plain wave, so running lanes keep their pace while prompts
enter; a wider step than that can serve only a turn without decode rows, so it is compiled and not run (on an 8B model
a 128-row step is seconds of arithmetic). The times are kept beside the compilation cache (`StepTimes`: named by the
engine's shapes, its weights and the CPU), so a start on a warm cache runs no step to time it. An engine that packs
prompts never runs a plain prefill chunk (a scored prompt's compiles on first use), so it compiles none. The caller of
the engine runs the warm-up (the station's start-up, on the thread that later hands the engine over).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from jaxstation.engine.rows import DecodeRow, PromptPiece, SamplingParams
from jaxstation.engine.rules import pack_slots, tier_refusal
from jaxstation.kernels.cpu_kernel import cpu_info

if TYPE_CHECKING:
    from jaxstation.engine.engine import Engine

log = logging.getLogger(__name__)

DECODE_WAIT = 2.0  # a packed turn that carries decode rows takes at most about this many of their plain waves
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9)
GREEDY = SamplingParams()
PENALIZED = SamplingParams(repetition_penalty=1.1)

Step = tuple[str, Callable[[], object]]
StepKey = tuple[str, int] | tuple[str, int, int]


def warmup_steps(engine: Engine) -> list[Step]:
    """Every step shape `engine` runs, as (name, run it once); those that run through the engine's `_run` or
    `_prefill` come after the step that compiles their programs (`with_programs`)."""
    prompt = [0] * (engine.chunk + 1)
    steps: list[Step] = [("begin", partial(engine.begin, 0, prompt, PENALIZED, frozenset()))]
    if tier_refusal(engine) is None:
        steps.append(("prefix_copy", partial(_prefix_copy, engine)))
    stepped: list[Step] = []
    if not engine.prefill_budget:  # a middle chunk, and a last one, which samples
        stepped += [("prefill", partial(engine.prefill, 0, prompt, 0, GREEDY)),
                    ("prefill_last", partial(engine.prefill, 0, prompt, engine.chunk, GREEDY))]
    for width in engine.wave_widths:
        stepped.append(("decode" if width == engine.lanes else f"decode_{width}", partial(_decode, engine, width)))
    if engine.verify_rows:  # the full-width verify step: the narrower ones are the narrow waves' programs
        stepped.append(("verify", partial(_verify, engine)))
    for width in engine.pack_widths:
        for slots in pack_slots(width, engine.lanes):
            if len(_pieces(engine, width, GREEDY)) > slots:
                continue  # a context too short to fill the width from that few lanes
            name = f"pack_{width}" if slots == min(width, engine.lanes) else f"pack_{width}_{slots}"
            stepped.append((name, partial(_pack, engine, width, slots)))
    return [*steps, *with_programs(engine, stepped)]


def with_programs(engine: Engine, steps: list[Step], name: str = "programs") -> list[Step]:
    """`steps`, each running its programs through `engine`'s `_run` or `_prefill`, after a step called `name` that
    compiles those programs (`compile_programs`)."""
    return [(name, partial(compile_programs, engine, steps)), *steps]


def compile_programs(engine: Engine, steps: list[Step]) -> None:
    """Lower the programs `steps` run (each step called with `engine.lowering` set, so nothing runs), one after
    another, then compile them, or read them from the persistent compilation cache, on every core at once; each
    program's time is logged. A later call of the same shapes finds its program compiled."""
    programs: dict[str, jax.stages.Lowered] = {}
    for name, run in steps:
        engine.lowering = []
        try:
            run()
            lowered = engine.lowering
        finally:
            engine.lowering = None
        if len(lowered) > 1:  # the verify step runs one program twice (sampled, then greedy): compile it once
            lowered = list({program.as_text(): program for program in lowered}.values())
        programs.update((f"{name}_{i + 1}" if i else name, program) for i, program in enumerate(lowered))
    with ThreadPoolExecutor(max(1, min(len(programs), os.cpu_count() or 1))) as pool:
        for label, seconds in pool.map(_compile, programs.items()):
            log.info("start-up program %s: %.2f s", label, seconds)


def _compile(named: tuple[str, jax.stages.Lowered]) -> tuple[str, float]:
    t0 = time.perf_counter()
    named[1].compile()
    return named[0], time.perf_counter() - t0


def _prefix_copy(engine: Engine) -> None:
    """The prefix cache's host tier's copies, a chunk each way."""
    engine.restore_prefix(0, engine.save_prefix(0, engine.chunk), engine.chunk, engine.save_window(0, engine.chunk))


def _lone_row(engine: Engine, sampling: SamplingParams, drafts: tuple[int, ...] = ()) -> list[DecodeRow | None]:
    """A wave's rows where lane 0 alone decodes after the warm-up prompt."""
    return [DecodeRow(0, engine.chunk + 1, sampling, 0, drafts=drafts), *[None] * (engine.lanes - 1)]


def _decode(engine: Engine, width: int) -> None:
    """A `width`-row wave, run greedy and timed."""
    _timed(engine, ("decode", width), partial(engine._wave, _lone_row(engine, GREEDY), width, False))


def _verify(engine: Engine) -> None:
    """A verify step of lane 0's token and a draft in every other row, sampled then greedy."""
    for sampling in (SAMPLED, GREEDY):
        engine.verify(_lone_row(engine, sampling, drafts=(0,) * (engine.lanes - 1)))


def _pack(engine: Engine, width: int, slots: int) -> None:
    """A `width`-row packed step sampling `slots` rows, run greedy and timed, unless a narrower one took more than
    DECODE_WAIT times the widest wave (no turn with decode rows could take it: it is compiled only)."""
    run = partial(engine.pack, _pieces(engine, width, GREEDY), [None] * engine.lanes, slots)
    widest = engine.step_s.get(("decode", engine.lanes), float("inf"))
    slow = any(key[0] == "pack" and key[1] < width and t > DECODE_WAIT * widest for key, t in engine.step_s.items())
    _timed(engine, ("pack", width, slots), run, measure=not slow)


def _pieces(engine: Engine, rows: int, sampling: SamplingParams) -> list[PromptPiece]:
    """Whole prompts that fill `rows` rows of a packed step: lane 0 first, each lane at most a context's worth
    (max_seq - 1 tokens), so a budget wider than the context spreads over lanes. A budget wider than every lane's
    context together runs the widest step those prompts reach, the widest any request can."""
    pieces = []
    left = rows
    for lane in range(engine.lanes):
        n = min(left, engine.max_seq - 1)
        if n < 1:
            break
        pieces.append(PromptPiece(lane, [0] * n, 0, n, sampling))
        left -= n
    return pieces


def _timed(engine: Engine, key: StepKey, run: Callable[[], object], measure: bool = True) -> None:
    """Run a step and keep its wall time, to its arena's last write, in `engine.step_s[key]` (and in its
    `step_times`), unless that time is known already or `measure` is false; while the engine lowers, only lower it."""
    if engine.lowering is not None:
        run()
        return
    if not measure or key in engine.step_s:
        return
    t0 = time.perf_counter()
    run()
    jax.block_until_ready(engine.arena)
    engine.step_s[key] = time.perf_counter() - t0
    if engine.step_times is not None:
        engine.step_times.save(engine.step_s)


class StepTimes:
    """An engine's warm-up step times, kept in a JSON file under a directory (the compilation cache's) and named by
    what they depend on: the engine's shapes, its weights' shapes and types, the CPU and its cores, JAX's version."""

    def __init__(self, directory: str | os.PathLike, engine: Engine) -> None:
        key = json.dumps([repr(engine.cfg), engine.lanes, engine.max_seq, engine.chunk, engine.block,
                          engine.attention, engine.wave_widths, engine.pack_widths, engine.verify_rows,
                          str(engine.kv_dtype), [(a.shape, str(a.dtype)) for a in jax.tree.leaves(engine.params)],
                          cpu_info()[0], len(os.sched_getaffinity(0)), jax.__version__, jax.default_backend()])
        self.path = Path(directory) / "jaxstation-step-times" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def load(self) -> dict[StepKey, float]:
        """The times kept, or none where there is no file (or one that cannot be read)."""
        try:
            return {tuple(key): float(seconds) for key, seconds in json.loads(self.path.read_text())}
        except (OSError, ValueError, TypeError):
            return {}

    def save(self, step_s: dict[StepKey, float]) -> None:
        """Write `step_s` whole: to a file aside, then moved over the kept one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        aside = self.path.with_suffix(f".{os.getpid()}.tmp")
        aside.write_text(json.dumps([[list(key), seconds] for key, seconds in step_s.items()]))
        aside.replace(self.path)


def turn_rows(engine: Engine, decode_rows: int) -> int:
    """The most rows of a packed turn that carries `decode_rows` decode rows: the widest packed step whose warm-up
    run (sampling those rows and one more) took at most DECODE_WAIT times the plain wave of those rows, and at least
    the narrowest with room for one prompt row (every width before the warm-up has timed them)."""
    if not decode_rows:
        return engine.prefill_budget
    wave = engine.step_s.get(("decode", next(w for w in engine.wave_widths if w >= decode_rows)))

    def took(width: int) -> float:
        slots = next((n for n in pack_slots(width, engine.lanes) if n > decode_rows), None)
        return float("inf") if slots is None else engine.step_s.get(("pack", width, slots), float("inf"))

    fits = [w for w in engine.pack_widths if w > decode_rows and (wave is None or took(w) <= DECODE_WAIT * wave)]
    room = next((w for w in engine.pack_widths if w > decode_rows), engine.prefill_budget)
    return max([*fits, room])

