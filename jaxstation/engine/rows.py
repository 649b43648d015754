"""The host-side rows of a step: how a request samples, what one decode row or prompt piece feeds, and what a row
samples back, with their conversion to and from the device arrays the compiled steps take (one array entry per row).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxstation.engine.constraints import mask_words
from jaxstation.engine.penalties import MAX_LOGIT_BIAS, PenaltyArrays
from jaxstation.engine.sampling import SampleOut, SamplingArrays

SEED_LIMIT = 1 << 32  # seeds are 32-bit on the device
FLOAT32_TINY, FLOAT32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)  # normal float32s


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 are off.

    The token controls (engine/penalties.py) are off at their defaults: presence_penalty and frequency_penalty
    (OpenAI's, over the generated tokens), repetition_penalty (vLLM's, over the prompt and the generated tokens),
    logit_bias ((token id, bias) pairs, each id once), allowed_token_ids (vLLM's: when not empty, every other token is
    masked) and min_tokens (the request's stop ids are held back until it has generated that many).

    Built directly, it checks its bounds itself. A request's values are bounded once, by its API face's types (every
    face's fields hold each one to these bounds or tighter), and `bounded` builds it from them without a second check.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            raise ValueError(f"repetition_penalty must be a positive normal float32, got {self.repetition_penalty}")
        ids = [t for t, _ in self.logit_bias]
        if len(ids) > MAX_LOGIT_BIAS or len(set(ids)) != len(ids) or any(t < 0 for t in ids):
            raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS} distinct token ids >= 0")
        if not all(-100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(t < 0 for t in self.allowed_token_ids):
            raise ValueError("allowed_token_ids must be token ids >= 0")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @classmethod
    def bounded(cls, base: SamplingParams | None = None, **fields: Any) -> SamplingParams:
        """`base` (default: the defaults) with `fields` set, from values a request's own types have already held to
        the bounds `__post_init__` checks: built without checking them again."""
        names = [f.name for f in dataclasses.fields(cls)]
        if unknown := sorted(set(fields) - set(names)):
            raise TypeError(f"SamplingParams has no field {', '.join(unknown)}")
        params = object.__new__(cls)
        for f in dataclasses.fields(cls):
            value = fields[f.name] if f.name in fields else (f.default if base is None else getattr(base, f.name))
            object.__setattr__(params, f.name, value)
        return params

    @property
    def penalized(self) -> bool:
        """Whether a penalty, a logit bias or an allowed-token list is on (min_tokens aside)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.allowed_token_ids)

    @property
    def controls(self) -> bool:
        """Whether any token control is on: the request needs its lane's token state (`Engine.begin`)."""
        return self.penalized or self.min_tokens > 0


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sampled token and its log-probabilities (the model's, before temperature and filters)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class DecodeRow:
    """A live lane's input to a decode wave: the token to feed, its position, and how to sample the next one."""

    token: int
    position: int
    sampling: SamplingParams
    counter: int  # tokens this request has generated so far (folds into its sampling key)
    mask: np.ndarray | None = None  # [words] int32: the tokens a constrained request may take (engine/constraints.py)
    drafts: tuple[int, ...] = ()  # tokens to verify after `token` (speculative decoding: `Runner.verify`)


@dataclasses.dataclass(frozen=True)
class PromptPiece:
    """Part of a lane's prompt for a packed step: prompt[start:start + length] into `lane`. A piece that reaches the
    prompt's end samples the request's first token (from the tokens `mask` allows, when given)."""

    lane: int
    prompt: Sequence[int]
    start: int
    length: int
    sampling: SamplingParams
    mask: np.ndarray | None = None

    @property
    def last(self) -> bool:
        return self.start + self.length >= len(self.prompt)


@dataclasses.dataclass(frozen=True)
class FedRow:
    """A row of a step: `token` fed into `lane` at `position`, or, idle (position None), the lane's scratch slot."""

    lane: int
    token: int = 0
    position: int | None = None


@dataclasses.dataclass(frozen=True)
class SampledRow:
    """A row of a step that samples: its index among the step's rows, its lane, and how it samples."""

    row: int
    lane: int
    sampling: SamplingParams
    counter: int
    mask: np.ndarray | None


@dataclasses.dataclass
class PackedRows:
    """A packed step's rows before padding, and the rows that sample."""

    rows: list[FedRow] = dataclasses.field(default_factory=list)
    sampled: list[SampledRow] = dataclasses.field(default_factory=list)

    def add(self, lane: int, tokens: Sequence[int], start: int) -> None:
        """Rows feeding `tokens` into `lane` at positions start, start + 1, ..."""
        self.rows.extend(FedRow(lane, token, start + i) for i, token in enumerate(tokens))

    def sample_last(self, lane: int, sampling: SamplingParams, counter: int, mask: np.ndarray | None) -> None:
        """The last row added samples the request on `lane`."""
        self.sampled.append(SampledRow(len(self.rows) - 1, lane, sampling, counter, mask))


def packed_rows(pieces: Sequence[PromptPiece], rows: Sequence[DecodeRow | None]) -> PackedRows:
    """The rows of a packed step: every decode row (rows[i] feeds lane i), then every piece's prompt tokens. A piece
    samples where it ends its prompt. Raises ValueError for a piece outside its prompt or on a lane that decodes."""
    packed = PackedRows()
    for lane, r in enumerate(rows):
        if r is not None:
            packed.add(lane, [r.token], r.position)
            packed.sample_last(lane, r.sampling, r.counter, r.mask)
    for p in pieces:
        if p.length < 1 or p.start + p.length > len(p.prompt) or rows[p.lane] is not None:
            raise ValueError(f"piece [{p.start}, {p.start + p.length}) of lane {p.lane} does not fit its prompt "
                             f"({len(p.prompt)} tokens) or the lane also decodes")
        packed.add(p.lane, p.prompt[p.start:p.start + p.length], p.start)
        if p.last:
            packed.sample_last(p.lane, p.sampling, 0, p.mask)
    return packed


def wave_rows(rows: Sequence[tuple[int, DecodeRow | None]], width: int
              ) -> tuple[list[FedRow], list[SampledRow | None]]:
    """The rows of a step where every row samples (a decode wave, a verify step), padded to `width`: each (lane, row)
    feeds its row's token and samples as its request does; a lane without a row, and each padding row (lane 0), idles
    at its scratch slot and samples greedily, unread."""
    padded = [*rows, *[(0, None)] * (width - len(rows))]
    fed = [FedRow(lane) if r is None else FedRow(lane, r.token, r.position) for lane, r in padded]
    samplers = [None if r is None else SampledRow(i, lane, r.sampling, r.counter, r.mask)
                for i, (lane, r) in enumerate(padded)]
    return fed, samplers


@dataclasses.dataclass(frozen=True)
class StepArrays:
    """The host arrays of one compiled step (`steps.step_rows`): per row its position, token and lane, the KV blocks
    that cover the furthest live row, and per sampling slot its sampling, penalties and row."""

    positions: np.ndarray
    tokens: np.ndarray
    lanes: np.ndarray
    n_blocks: np.int32
    sampling: SamplingArrays
    penalties: PenaltyArrays
    picks: np.ndarray


def step_arrays(fed: Sequence[FedRow], samplers: Sequence[SampledRow | None], scratch: int, block: int,
                vocab: int) -> StepArrays:
    """`fed` and `samplers` (None: an idle slot, greedy, unread) as a step's arrays: an idle row at position
    `scratch`, KV blocks of `block` positions, masks of a `vocab`-token vocabulary."""
    per_slot = [None if s is None else (s.sampling, s.counter) for s in samplers]
    return StepArrays(
        positions=np.array([scratch if r.position is None else r.position for r in fed], np.int32),
        tokens=np.array([r.token for r in fed], np.int32),
        lanes=np.array([r.lane for r in fed], np.int32),
        n_blocks=np.int32(max(r.position for r in fed if r.position is not None) // block + 1),
        sampling=sampling_arrays(per_slot),
        penalties=penalty_arrays(per_slot, vocab, [None if s is None else s.mask for s in samplers]),
        picks=np.array([0 if s is None else s.row for s in samplers], np.int32),
    )


def sampling_arrays(rows: Sequence[tuple[SamplingParams, int] | None]) -> SamplingArrays:
    """Per row: its sampling parameters and counter (an idle row samples greedily)."""
    idle = (SamplingParams(), 0)
    filled = [r or idle for r in rows]
    return SamplingArrays(
        temperature=np.array([p.temperature for p, _ in filled], np.float32),
        top_k=np.array([p.top_k for p, _ in filled], np.int32),
        top_p=np.array([p.top_p for p, _ in filled], np.float32),
        min_p=np.array([p.min_p for p, _ in filled], np.float32),
        seed=np.array([p.seed % SEED_LIMIT for p, _ in filled], np.uint32),
        counter=np.array([c for _, c in filled], np.int32),
    )


def penalty_arrays(rows: Sequence[tuple[SamplingParams, int] | None], vocab: int,
                    masks: Sequence[np.ndarray | None]) -> PenaltyArrays:
    """Per row: whether its controls act at this counter (min_tokens only while it holds), their values, and its
    constraint mask, if it has one."""
    idle = (SamplingParams(), 0)
    filled = [r or idle for r in rows]
    mask = np.zeros((len(rows), mask_words(vocab)), np.int32)
    for i, m in enumerate(masks):
        if m is not None:
            mask[i] = m
    return PenaltyArrays(
        active=np.array([p.penalized or c < p.min_tokens for p, c in filled], bool),
        presence=np.array([p.presence_penalty for p, _ in filled], np.float32),
        frequency=np.array([p.frequency_penalty for p, _ in filled], np.float32),
        repetition=np.array([p.repetition_penalty for p, _ in filled], np.float32),
        min_tokens=np.array([p.min_tokens for p, _ in filled], np.int32),
        constrained=np.array([m is not None for m in masks], bool),
        mask=mask,
    )


def read_samples(out: SampleOut) -> list[Sample]:
    """The step's samples, one per sampled row, on the host."""
    host = SampleOut(np.asarray(out.packed))  # one transfer
    tokens, logprob, top_ids, top_lp = host.tokens, host.logprob, host.top_ids, host.top_logprobs
    return [
        Sample(int(tokens[i]), float(logprob[i]), tuple(zip(top_ids[i].tolist(), top_lp[i].tolist(), strict=True)))
        for i in range(len(tokens))
    ]
