"""An engine's warm-up, and the step times it leaves for the scheduler's packed turns.

The warm-up compiles every step shape a station uses, so that no request waits on a compiler, and runs each once on
lane 0 (and on more lanes where a packed step is wider than one context), greedy, timed into `Engine.step_s`: every
decode wave, and the packed steps from the narrowest up, until one takes more than DECODE_WAIT of the widest wave.
`turn_rows` reads those times to keep a packed turn that carries decode rows within DECODE_WAIT of their plain wave,
so running lanes keep their pace while prompts enter; a wider step than that can serve only a turn without
decode rows, so it is compiled and not run (on an 8B model a 128-row step is seconds of arithmetic). An engine that
packs prompts never runs a plain prefill chunk (a scored prompt's compiles on first use), so it compiles none. The
caller of the engine runs it (the station's start-up, on the thread that later hands the engine over).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

import jax

from jaxstation.engine.rows import DecodeRow, PromptPiece, SamplingParams
from jaxstation.engine.rules import pack_slots, tier_refusal

if TYPE_CHECKING:
    from jaxstation.engine.engine import Engine

DECODE_WAIT = 2.0  # a packed turn that carries decode rows takes at most about this many of their plain waves
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9)
GREEDY = SamplingParams()
PENALIZED = SamplingParams(repetition_penalty=1.1)

Step = tuple[str, Callable[[], object]]


def warmup_steps(engine: Engine) -> list[Step]:
    """Every step shape `engine` runs, as (name, run it once); the first run of each compiles it."""
    prompt = [0] * (engine.chunk + 1)
    steps: list[Step] = [("begin", partial(engine.begin, 0, prompt, PENALIZED, frozenset()))]
    if not engine.prefill_budget:  # a middle chunk, and a last one, which samples
        steps += [("prefill", partial(engine.prefill, 0, prompt, 0, GREEDY)),
                  ("prefill_last", partial(engine.prefill, 0, prompt, engine.chunk, GREEDY))]
    if tier_refusal(engine) is None:
        steps.append(("prefix_copy", partial(_prefix_copy, engine)))
    for width in engine.wave_widths:
        steps.append(("decode" if width == engine.lanes else f"decode_{width}", partial(_decode, engine, width)))
    if engine.verify_rows:  # the full-width verify step: the narrower ones are the narrow waves' programs
        steps.append(("verify", partial(_verify, engine)))
    for width in engine.pack_widths:
        for slots in pack_slots(width, engine.lanes):
            if len(_pieces(engine, width, GREEDY)) > slots:
                continue  # a context too short to fill the width from that few lanes
            name = f"pack_{width}" if slots == min(width, engine.lanes) else f"pack_{width}_{slots}"
            steps.append((name, partial(_pack, engine, width, slots)))
    return steps


def _prefix_copy(engine: Engine) -> None:
    """The prefix cache's host tier's copies, a chunk each way."""
    engine.restore_prefix(0, engine.save_prefix(0, engine.chunk), engine.chunk, engine.save_window(0, engine.chunk))


def _lone_row(engine: Engine, sampling: SamplingParams, drafts: tuple[int, ...] = ()) -> list[DecodeRow | None]:
    """A wave's rows where lane 0 alone decodes after the warm-up prompt."""
    return [DecodeRow(0, engine.chunk + 1, sampling, 0, drafts=drafts), *[None] * (engine.lanes - 1)]


def _decode(engine: Engine, width: int) -> None:
    """A `width`-row wave, compiled, then run greedy and timed."""
    run = partial(engine._wave, _lone_row(engine, GREEDY), width, False)
    with compiled(engine):
        run()
    _timed(engine, ("decode", width), run)


def _verify(engine: Engine) -> None:
    """A verify step of lane 0's token and a draft in every other row, sampled then greedy."""
    for sampling in (SAMPLED, GREEDY):
        engine.verify(_lone_row(engine, sampling, drafts=(0,) * (engine.lanes - 1)))


def _pack(engine: Engine, width: int, slots: int) -> None:
    """A `width`-row packed step sampling `slots` rows, compiled, then run greedy and timed; only compiled where a
    narrower one took more than DECODE_WAIT times the widest wave (no turn with decode rows could take it)."""
    run = partial(engine.pack, _pieces(engine, width, GREEDY), [None] * engine.lanes, slots)
    with compiled(engine):
        run()
    widest = engine.step_s.get(("decode", engine.lanes), float("inf"))
    if not any(key[0] == "pack" and key[1] < width and t > DECODE_WAIT * widest for key, t in engine.step_s.items()):
        _timed(engine, ("pack", width, slots), run)


@contextlib.contextmanager
def compiled(engine: Engine) -> Iterator[None]:
    """Within it, `engine`'s steps compile and run nothing (`Engine.compile_only`)."""
    engine.compile_only = True
    try:
        yield
    finally:
        engine.compile_only = False


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


def _timed(engine: Engine, key: tuple[str, int] | tuple[str, int, int], run: Callable[[], object]) -> None:
    """Run a step and keep its wall time, to its arena's last write, in `engine.step_s[key]`."""
    t0 = time.perf_counter()
    run()
    jax.block_until_ready(engine.arena)
    engine.step_s[key] = time.perf_counter() - t0


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

