"""The runner: owns the weights, the KV arena and the compiled steps, and speaks in host-side lanes and tokens.

Only one thread may call an Engine (the scheduler's decode thread, or a caller holding the serialize lock). Every call
runs one of a fixed set of compiled programs whose shapes depend only on the station's settings (lanes, chunk, block,
wave widths): that is what keeps a request's tokens independent of its neighbours. A decode wave runs at the narrowest
of the engine's `wave_widths` that holds its live lanes. Narrower widths than the arena exist only when every matmul
runs on the CPU kernel, which computes a row alike at any width; otherwise every wave is full width. Prefill and decode
steps always return the logits they compute, and the host drops them unless asked: one program per shape whether or
not a caller reads logits. Every step of rows is built by `rows.step_arrays`; the warm-up is engine/warmup.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxstation.engine import warmup
from jaxstation.engine.arena import (
    KVBuffers,
    allocate_arena,
    arena_layout,
    kv_dtype_of,
    read_prefix,
    read_window,
    restore_lane,
)
from jaxstation.engine.choices import ATTENTIONS
from jaxstation.engine.penalties import lane_rows, start_lane
from jaxstation.engine.prefix_cache import LaneVersions, RingHold
from jaxstation.engine.rows import (
    DecodeRow,
    FedRow,
    PromptPiece,
    Sample,
    SampledRow,
    SamplingParams,
    packed_rows,
    penalty_arrays,
    read_samples,
    sampling_arrays,
    step_arrays,
    wave_rows,
)
from jaxstation.engine.rules import (
    attention_refusal,
    budget_refusal,
    default_prefill_budget,
    default_wave_widths,
    narrow_waves,
    pack_slots,
    pack_widths,
    widths_refusal,
)
from jaxstation.engine.runner import ChunkPrefill, PromptChunk
from jaxstation.engine.steps import prefill_chunk, step_rows
from jaxstation.model.layers import with_lora, write_adapter
from jaxstation.model.loader import LoadedModel
from jaxstation.model.sharding import mesh_of


class Engine(ChunkPrefill):
    """Lanes over one KV arena: `begin` sets a lane's token state, `prefill` fills it, `decode` advances the lanes."""

    token_controls = True  # penalties, logit_bias and min_tokens are applied (from the arena's token state)

    def __init__(self, model: LoadedModel, lanes: int, max_seq: int, chunk: int, block: int,
                 attention: str = "blocked", wave_widths: Sequence[int] | None = None,
                 prefill_budget: int | None = 0, speculative: bool = False, kv_windows: str = "ring",
                 kv_dtype: str = "auto", max_loras: int = 0, max_lora_rank: int = 16) -> None:
        """wave_widths: the decode wave widths (default: `rules.default_wave_widths`). prefill_budget: rows per
        packed admission step (`pack`; 0: prompts enter one `prefill` chunk at a time; None:
        `rules.default_prefill_budget`). speculative: verify drafted tokens (`verify`; where waves may run narrow).
        kv_windows: "ring" keeps only a windowed layer's window (engine/arena.py), "full" every position. kv_dtype:
        the arena's dtype (`choices.KV_DTYPES`; the decode attention kernel reads float32 only).
        max_loras, max_lora_rank: the LoRA adapters resident at once and their highest rank (model/lora.py): slots
        1..max_loras of stacks allocated here, slot 0 the base; 0 serves none and the steps carry no adapters.
        A station passes its plan's (config/plan.py), resolved by the same rules."""
        if max_seq % chunk or max_seq % block:
            raise ValueError(f"max_seq ({max_seq}) must be a multiple of the prefill chunk ({chunk}) "
                             f"and of the KV block ({block})")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        self.kv_dtype = kv_dtype_of(kv_dtype, model.params.dtype)
        if refusal := attention_refusal(model.cfg, attention, model.params.dtype, max_seq, self.kv_dtype):
            raise ValueError(f"attention={attention!r} {refusal}")
        self.wave_widths, self.prefill_budget = _shapes(lanes, model.params.row_invariant, attention, wave_widths,
                                                        prefill_budget)
        self.verify_rows = lanes if speculative and len(self.wave_widths) > 1 else 0  # narrow waves' rows
        self.pack_widths = pack_widths(self.prefill_budget) if self.prefill_budget else ()
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        if max_loras:
            model = dataclasses.replace(model, params=with_lora(model.cfg, model.params, max_loras + 1, max_lora_rank))
        self.lane_lora = np.zeros(lanes, np.int32)  # each lane's LoRA slot, set by `begin`
        self.model = model
        self.cfg = model.cfg
        self.lanes = lanes
        self.max_seq = max_seq
        self.chunk = chunk
        self.block = block
        self.attention = attention
        self.scratch_pos = max_seq - 1  # never holds a request's k/v: prompt + new tokens <= max_seq - 1 fed
        self.ring, self.windowed = arena_layout(self.cfg, max_seq, block, kv_windows, model.params.layer_loop,
                                                chunk=chunk, budget=self.prefill_budget, verify_rows=self.verify_rows)
        self.arena = None
        self.lane_versions = LaneVersions(lanes)
        self.ring_hold = RingHold(lanes, self.ring, self.cfg.sliding_window or 0)
        # one greedy run at warm-up: ("decode", width) and ("pack", width, sampled rows) -> seconds
        self.step_s: dict[tuple[str, int] | tuple[str, int, int], float] = {}
        self.step_times: warmup.StepTimes | None = None  # where step_s is kept between starts (`warmup.StepTimes`)
        self.lowering: list[jax.stages.Lowered] | None = None  # the warm-up's: steps lower into it, run nothing
        self.reset()

    @property
    def params(self):
        return self.model.params

    def reset(self) -> None:
        """(Re)allocate the arena, e.g. after a failed step left donated buffers unusable."""
        self.lane_versions.touch(range(self.lanes))
        self.ring_hold.clear()
        self.arena = None
        self.arena = allocate_arena(self.cfg, self.lanes, self.max_seq, self.kv_dtype, token_state=True,
                                    mesh=mesh_of(self.params), ring=self.ring, windowed=self.windowed)

    def reuse_floor(self, lane: int) -> int:
        """The lowest restart above 0 whose window `lane`'s rings still hold (0: any)."""
        return self.ring_hold.floor(lane)

    def save_prefix(self, lane: int, n: int) -> KVBuffers:
        """A host copy of `lane`'s global layers' KV at positions [0, n), n a multiple of the chunk (`PrefixTier`)."""
        return read_prefix(self.arena.full, lane, n, self.chunk)

    def save_window(self, lane: int, n: int) -> KVBuffers | None:
        """A host copy of `lane`'s rings' window before position n, which a restart at n reads (None without rings),
        taken while the rings still hold it (`reuse_floor`): as a prompt's prefill passes n (prefix_windows.py)."""
        return None if self.arena.rings is None else read_window(self.arena.rings, lane, n, self.cfg.sliding_window - 1)

    def restore_prefix(self, lane: int, kv: KVBuffers, n: int, window: KVBuffers | None = None) -> None:
        """Write positions [0, n) of a host copy (`save_prefix`) into `lane`, n a multiple of the chunk, and with rings
        the window before n (`save_window`): the lane may restart at n, and at no lower boundary."""
        if self.arena.rings is not None and window is None:
            raise ValueError("a lane with rings restarts only from a copy of its window")
        self._wrote([lane, lane], [0, n - 1])
        self.arena = restore_lane(self.arena, lane, kv, n, self.chunk, window, (self.cfg.sliding_window or 1) - 1)
        if window is not None:
            self.ring_hold.restored(lane, n)

    def _wrote(self, lanes: Sequence[int], positions: Sequence[int]) -> None:
        """Rows at `positions` of `lanes` (one pair per row; idle rows left out) are about to write their k/v."""
        self.lane_versions.touch(sorted(set(lanes)))
        for lane in set(lanes):
            at = [p for q, p in zip(lanes, positions, strict=True) if q == lane]
            self.ring_hold.wrote(lane, min(at), max(at))

    def begin(self, lane: int, prompt: Sequence[int], sampling: SamplingParams, stop_ids: frozenset[int],
              lora: int = 0) -> None:
        """A request takes `lane`, before its first prefill chunk: set the lane's LoRA slot (`lora`, 0: the base) and
        write its token state (prompt, stop ids held back by min_tokens, logit bias, allowed tokens); without token
        controls it never reads that state, and nothing runs."""
        if not 0 <= lora <= self.max_loras:
            raise ValueError(f"LoRA slot {lora} is outside [0, {self.max_loras}]")
        self.lane_lora[lane] = lora
        if not sampling.controls:
            return
        vocab = self.cfg.vocab_size
        bad = [t for t in (*prompt, *stop_ids, *(t for t, _ in sampling.logit_bias), *sampling.allowed_token_ids)
               if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        marks, bias = lane_rows(vocab, prompt, stop_ids, sampling.logit_bias, sampling.allowed_token_ids)
        tokens = start_lane(self.arena.tokens, np.int32(lane), marks, bias)
        self.arena = dataclasses.replace(self.arena, tokens=tokens)

    def _prefill(self, lane: int, chunk: PromptChunk, sampling: SamplingParams, return_logits: bool, scored: bool,
                 mask: np.ndarray | None) -> tuple[Sample | None, jax.Array | None, list[Sample]]:
        """One `prefill_chunk` step of `chunk` into `lane` (`ChunkPrefill`)."""
        args = (self.cfg, self.params, self.arena, np.int32(lane), np.int32(chunk.start), chunk.tokens,
                np.int32(len(chunk.piece)), sampling_arrays([(sampling, 0)]), chunk.targets if scored else None,
                penalty_arrays([(sampling, 0)], self.cfg.vocab_size, [mask]), self._adapters(lane))
        kwargs = {"block": self.block, "last": chunk.last, "return_logits": True, "prompt_logprobs": scored,
                  "attention": self.attention}
        if self.lowering is not None:
            self.lowering.append(prefill_chunk.lower(*args, **kwargs))
            return None, None, []
        self._wrote([lane] * self.chunk, range(chunk.start, chunk.start + self.chunk))
        self.arena, out, logits, rows = prefill_chunk(*args, **kwargs)
        sample = read_samples(out)[0] if chunk.last else None
        return sample, logits if return_logits else None, read_samples(rows)[:len(chunk.following)] if scored else []

    def decode(self, rows: Sequence[DecodeRow | None], return_logits: bool = False
               ) -> tuple[list[Sample | None], jax.Array | None]:
        """One wave: rows[i] feeds lane i (None = idle lane). Returns one sample per live lane and, if asked, the
        logits [lanes, vocab] (zeros for idle lanes)."""
        if len(rows) != self.lanes:
            raise ValueError(f"decode needs one row per lane ({self.lanes}), got {len(rows)}")
        live = [i for i, r in enumerate(rows) if r is not None]
        if not live:
            return [None] * self.lanes, None
        return self._wave(rows, next(w for w in self.wave_widths if w >= len(live)), return_logits)

    def _wave(self, rows: Sequence[DecodeRow | None], width: int, return_logits: bool
              ) -> tuple[list[Sample | None], jax.Array | None]:
        """Run `rows` as one `width`-row step: the live lanes first, then idle lanes at their scratch slot."""
        live = [i for i, r in enumerate(rows) if r is not None]
        if not 0 < len(live) <= width or width not in self.wave_widths:
            raise ValueError(f"{len(live)} live lanes cannot run as a wave of width {width} (widths "
                             f"{self.wave_widths})")
        full = width == self.lanes
        order = list(range(self.lanes)) if full else live + [i for i, r in enumerate(rows) if r is None]
        fed, samplers = wave_rows([(i, rows[i]) for i in order[:width]], width)
        out, logits = self._run(fed, samplers, by_lane=not full, picks=False, return_logits=True)
        samples: list[Sample | None] = [None] * self.lanes
        for row, sample in zip(fed, out, strict=True):
            if row.position is not None:
                samples[row.lane] = sample
        if not return_logits:
            return samples, None
        if not full:
            logits = jax.numpy.zeros((self.lanes, logits.shape[1]), logits.dtype).at[np.array(order[:width])].set(
                logits)
        return samples, logits

    def verify(self, rows: Sequence[DecodeRow | None]) -> list[list[Sample] | None]:
        """One wave in which a row with drafts also feeds each draft at the next positions of its lane, every row
        sampled with the request's key at its position (its counter + j), at the narrowest wave width that holds
        them (padding rows write lane 0's scratch slot). Per lane, the samples of its rows in order.

        A row computes alike at every width and reads only its lane's positions up to its own, after every row has
        written its k/v: so each row is the row plain decoding runs at that position after the same tokens."""
        steps = [(lane, dataclasses.replace(r, token=t, position=r.position + j, counter=r.counter + j,
                                            mask=r.mask if j == 0 else None, drafts=()))
                 for lane, r in enumerate(rows) if r is not None for j, t in enumerate((r.token, *r.drafts))]
        if not 0 < len(steps) <= self.verify_rows:
            raise ValueError(f"{len(steps)} rows cannot run as a verify step (at most {self.verify_rows})")
        width = next(w for w in self.wave_widths if w >= len(steps))
        fed, samplers = wave_rows(steps, width)
        out, _ = self._run(fed, samplers, by_lane=True, picks=False, return_logits=True)
        samples: list[list[Sample] | None] = [None] * self.lanes
        for (lane, _), sample in zip(steps, out, strict=False):
            samples[lane] = (samples[lane] or []) + [sample]
        return samples

    def pack(self, pieces: Sequence[PromptPiece], rows: Sequence[DecodeRow | None], sampled: int | None = None
             ) -> list[Sample | None]:
        """One packed step: every piece's prompt tokens and every decode row (rows[i] feeds lane i) as rows of one
        call, at the narrowest pack width that holds them, sampling `sampled` rows (default: the fewest of the width's
        `pack_slots` that hold them). Padding rows feed token 0 into lane 0's scratch slot, idle slots sample row 0
        greedily. Returns, per lane, the sample of its decode row or of its piece that ends its prompt (None
        elsewhere). Pieces of one lane go in order, after `begin`."""
        if not self.prefill_budget:
            raise ValueError("this engine does not pack (prefill_budget 0)")
        if len(rows) != self.lanes:
            raise ValueError(f"pack needs one decode row per lane ({self.lanes}), got {len(rows)}")
        packed = packed_rows(pieces, rows)
        if not packed.rows:
            return [None] * self.lanes
        if len(packed.rows) > self.prefill_budget or len({s.lane for s in packed.sampled}) < len(packed.sampled):
            raise ValueError(f"{len(packed.rows)} rows exceed the prefill budget ({self.prefill_budget}), or a lane "
                             "samples twice")
        width, slots = self._packed_shape(len(packed.rows), len(packed.sampled), sampled)
        fed = [*packed.rows, *[FedRow(0)] * (width - len(packed.rows))]
        samplers: list[SampledRow | None] = [*packed.sampled, *[None] * (slots - len(packed.sampled))]
        out, _ = self._run(fed, samplers, by_lane=True, picks=True, return_logits=False)
        samples: list[Sample | None] = [None] * self.lanes
        for s, sample in zip(packed.sampled, out, strict=False):
            samples[s.lane] = sample
        return samples

    def _packed_shape(self, rows: int, sampling_rows: int, sampled: int | None) -> tuple[int, int]:
        """(rows, sampled rows) of the compiled packed step that runs `rows` rows of which `sampling_rows` sample: the
        narrowest pack width that holds them, and `sampled` or the fewest of its `pack_slots` that hold them."""
        width = next(w for w in self.pack_widths if w >= rows)
        options = pack_slots(width, self.lanes)
        slots = next(n for n in options if n >= sampling_rows) if sampled is None else sampled
        if slots not in options or slots < sampling_rows:
            raise ValueError(f"{sampling_rows} sampled rows cannot run as {slots} of a {width}-row step ({options})")
        return width, slots

    def _run(self, fed: Sequence[FedRow], samplers: Sequence[SampledRow | None], *, by_lane: bool, picks: bool,
             return_logits: bool) -> tuple[list[Sample], jax.Array | None]:
        """One `step_rows` step of the rows `fed`, sampling `samplers` (`rows.step_arrays`). by_lane: the step names
        each row's lane (else row r is lane r: a full-width wave); picks: `samplers` name the rows they sample (else
        every row samples). Returns the samples, one per sampler, and the logits where asked."""
        arrays = step_arrays(fed, samplers, self.scratch_pos, self.block, self.cfg.vocab_size)
        args = (self.cfg, self.params, self.arena, arrays.positions, arrays.tokens, arrays.n_blocks, arrays.sampling,
                arrays.lanes if by_lane else None, arrays.penalties, arrays.picks if picks else None,
                self._adapters(arrays.lanes))
        kwargs = {"block": self.block, "attention": self.attention, "return_logits": return_logits}
        if self.lowering is not None:
            self.lowering.append(step_rows.lower(*args, **kwargs))
            return [None] * len(samplers), None
        live = [r for r in fed if r.position is not None]
        self._wrote([r.lane for r in live], [r.position for r in live])  # idle rows write only scratch slots
        self.arena, out, logits = step_rows(*args, **kwargs)
        return read_samples(out), logits

    def _adapters(self, lanes: int | Sequence[int]) -> np.ndarray | None:
        """The LoRA slot of each of `lanes` (rows of a step; one lane for a prefill chunk), or None where the engine
        serves no adapters (the steps then carry none)."""
        return self.lane_lora[np.asarray(lanes, np.int32)] if self.max_loras else None

    def write_lora(self, slot: int, layers: list[dict]) -> None:
        """Put an adapter into LoRA slot `slot` (1..max_loras): `layers` as `lora.slot_arrays` gives them per layer.
        The params are swapped as one reference, so a step already running keeps the weights it started with."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside [1, {self.max_loras}]")
        self.model = dataclasses.replace(self.model, params=write_adapter(self.params, slot, layers))

    def turn_rows(self, decode_rows: int) -> int:
        """The most rows of a packed turn that carries `decode_rows` decode rows (`warmup.turn_rows`)."""
        return warmup.turn_rows(self, decode_rows)

    def warmup_steps(self) -> list[tuple[str, Callable[[], object]]]:
        """Every step shape the station runs, as (name, run it once): `warmup.warmup_steps`."""
        return warmup.warmup_steps(self)

    def warmup(self) -> None:
        """Compile and run every step the station uses (`warmup_steps`), leaving no request state behind."""
        for _, run in self.warmup_steps():
            run()


def _shapes(lanes: int, row_invariant: bool, attention: str, wave_widths: Sequence[int] | None,
            prefill_budget: int | None) -> tuple[tuple[int, ...], int]:
    """(the decode wave widths, the packed admission budget) of an engine: those given, or the rules' defaults;
    raises ValueError where the rules refuse them."""
    narrow = narrow_waves(row_invariant, attention)
    widths = default_wave_widths(lanes, narrow) if wave_widths is None else tuple(sorted(set(wave_widths)))
    budget = default_prefill_budget(lanes, narrow) if prefill_budget is None else prefill_budget
    if refusal := (widths_refusal(widths, lanes, row_invariant, attention)
                   or budget_refusal(budget, lanes, row_invariant, attention)):
        raise ValueError(refusal)
    return widths, budget


def generate(engine: Engine, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
             stop_ids: frozenset[int] = frozenset(), lane: int = 0, lora: int = 0) -> list[int]:
    """Run one request alone on `lane` (with LoRA slot `lora`): chunked prefill, then decode until a stop id or
    max_new_tokens.

    The stop token is not included. Used by the CLI and as the serial reference in tests. An engine that packs feeds
    the prompt in packed steps of its whole budget, as a station does for a request that runs alone.
    """
    engine.begin(lane, prompt, sampling, stop_ids, lora)
    sample = None
    step = engine.prefill_budget or engine.chunk
    for start in range(0, len(prompt), step):
        if engine.prefill_budget:
            piece = PromptPiece(lane, prompt, start, min(step, len(prompt) - start), sampling)
            sample = engine.pack([piece], [None] * engine.lanes)[lane]
        else:
            sample, _ = engine.prefill(lane, prompt, start, sampling)
    out: list[int] = []
    while sample is not None and sample.token not in stop_ids and len(out) < max_new_tokens:
        out.append(sample.token)
        if len(out) >= max_new_tokens:
            break
        row = DecodeRow(sample.token, len(prompt) + len(out) - 1, sampling, len(out))
        rows: list[DecodeRow | None] = [None] * engine.lanes
        rows[lane] = row
        sample = engine.decode(rows)[0][lane]
    return out

