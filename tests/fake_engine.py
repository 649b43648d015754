"""A fake Engine for scheduler unit tests: the surface the scheduler uses, with tokens you can compute by hand.

Tokens. A prompt's first token is `(sum(prompt) + seed) % vocab`; feeding token t at position p gives
`(t + p + 1) % vocab`. `expected(prompt, n, seed)` writes out the first n tokens of a request run alone.

KV. Each lane records, per position, who wrote it: ("prefill", token) or ("decode", token). The first token is
computed from the lane's KV, not from the prompt argument, so a request that starts on stale KV gets wrong tokens.
A prefill at `start` > 0 that is not the next chunk of the lane's prompt is a prefix reuse: it is legal only if the
lane's positions [0, start) hold prefill-written KV of exactly prompt[:start] (else an entry in `errors`).
`lane_versions` follows the Engine's contract (a new stamp per write to the lane and on reset). A new prompt must
follow a `begin` of its lane with that prompt. `save_prefix` copies a lane's records of positions [0, n) and
`restore_prefix` writes them into a lane, as the host tier (engine/prefix_tier.py) copies KV.

Recording. `calls` lists every step in order: `("prefill", lane, start, prompt)` or `("decode", ((lane, prompt),
...))` with the prompts of the live rows. `errors` collects protocol violations (chunks out of order, a decode row
whose position, token or counter disagrees with what the lane holds); tests assert it stays empty.

Faults and pauses. `fail_next_prefill` / `fail_next_decode` make the next such step raise RuntimeError("boom").
`fail_next_save` makes the next `save_prefix` raise MemoryError; `fail_next_restore` makes the next `restore_prefix`
write the entry's first chunk into the lane, then raise RuntimeError("restore boom") (a half-written lane).
`hold()` makes every step wait at its start until `step(n)` allows n more or `release()` lets everything run;
`wait_blocked()` returns once the decode thread is parked at that gate. `on_step(kind)`, if set, is called from the
decode thread at the start of each step (after the gate).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import jax
import numpy as np

from jaxstation.engine.prefix_cache import LaneVersions
from jaxstation.engine.rows import DecodeRow, PromptPiece, Sample, SamplingParams

VOCAB = 1000


def first_token(prompt: Sequence[int], seed: int = 0, vocab: int = VOCAB) -> int:
    return (sum(prompt) + seed) % vocab


def next_token(token: int, position: int, vocab: int = VOCAB) -> int:
    return (token + position + 1) % vocab


def expected(prompt: Sequence[int], n: int, seed: int = 0, vocab: int = VOCAB) -> list[int]:
    """The first n tokens the fake generates for `prompt` (no stop ids)."""
    out = [first_token(prompt, seed, vocab)]
    while len(out) < n:
        out.append(next_token(out[-1], len(prompt) + len(out) - 1, vocab))
    return out[:n]


def _sample(token: int) -> Sample:
    return Sample(token, -0.5, ((token, -0.5),))


class _LaneState:
    def __init__(self, prompt: tuple[int, ...], kv: list[tuple[str, int]]) -> None:
        self.prompt = prompt
        self.kv = kv  # per position: (writer, token)
        self.sampled: dict[int, int] = {}  # position -> the token its row sampled (the next position's input)

    @property
    def length(self) -> int:  # positions written
        return len(self.kv)


class FakeEngine:
    arena = SimpleNamespace(rings=None, k=jax.numpy.zeros(0))  # local, one device, no ring: the host tier copies it

    def __init__(self, lanes: int = 2, chunk: int = 4, max_seq: int = 256, vocab: int = VOCAB,
                 step_delay: float = 0.0) -> None:
        self.lanes, self.chunk, self.max_seq, self.vocab = lanes, chunk, max_seq, vocab
        self.block = max_seq
        self.step_delay = step_delay
        self.calls: list[tuple] = []
        self.errors: list[str] = []
        self.resets = 0
        self.lane_versions = LaneVersions(lanes)
        self.admissions: list[tuple[int, int, tuple[int, ...]]] = []  # (lane, start, prompt) of each new prompt
        self.fail_next_prefill = False
        self.fail_next_decode = False
        self.fail_next_save = False
        self.fail_next_restore = False
        self.on_step: Callable[[str], None] | None = None
        self._state: list[_LaneState | None] = [None] * lanes
        self._begun: list[tuple[int, ...] | None] = [None] * lanes  # the prompt `begin` announced, until it starts
        self._cv = threading.Condition()
        self._budget: int | None = None  # None: run freely; else steps allowed before blocking
        self._waiting = False

    # ---- views of the record ------------------------------------------------------------------------------
    @property
    def prefills(self) -> list[tuple[int, int, tuple[int, ...]]]:
        return [c[1:] for c in self.calls if c[0] == "prefill"]

    @property
    def decode_waves(self) -> list[tuple[tuple[int, tuple[int, ...]], ...]]:
        return [c[1] for c in self.calls if c[0] == "decode"]

    def lanes_of(self, prompt: Sequence[int]) -> list[int]:
        """The lanes in which `prompt` started a prefill (fresh or on a reused prefix), in order."""
        return [lane for lane, _, p in self.admissions if p == tuple(prompt)]

    def starts_of(self, prompt: Sequence[int]) -> list[int]:
        """Where each prefill of `prompt` started: 0 fresh, > 0 on a reused prefix."""
        return [start for _, start, p in self.admissions if p == tuple(prompt)]

    # ---- pausing ------------------------------------------------------------------------------------------
    def hold(self) -> None:
        with self._cv:
            self._budget = 0

    def step(self, n: int = 1) -> None:
        with self._cv:
            self._budget = (self._budget or 0) + n
            self._waiting = False  # so wait_blocked waits for the thread to park again
            self._cv.notify_all()

    def release(self) -> None:
        with self._cv:
            self._budget = None
            self._cv.notify_all()

    def wait_blocked(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the decode thread never reached the gate")
                self._cv.wait(left)

    def _gate(self, kind: str) -> None:
        with self._cv:
            while self._budget is not None and self._budget <= 0:
                self._waiting = True
                self._cv.notify_all()
                self._cv.wait(10.0)
            self._waiting = False
            if self._budget is not None:
                self._budget -= 1
        if self.on_step is not None:
            self.on_step(kind)
        if self.step_delay:
            time.sleep(self.step_delay)

    # ---- the Engine surface -------------------------------------------------------------------------------
    token_controls = False
    prefill_budget = 0  # one prefill chunk per turn
    verify_rows = 0  # the rows of a verify step (more than 1: the scheduler may speculate)

    @property
    def wave_widths(self) -> tuple[int, ...]:
        return tuple(w for w in (1, 2, 4, 8, 16, 32) if w < self.lanes) + (self.lanes,)
    decode_turn_rows: int | None = None  # the rows of a packed turn that carries decode rows (None: the budget)

    def turn_rows(self, decode_rows: int) -> int:
        if not decode_rows or self.decode_turn_rows is None:
            return self.prefill_budget
        return max(self.decode_turn_rows, decode_rows + 1)

    def begin(self, lane: int, prompt: Sequence[int], sampling: SamplingParams, stop_ids: frozenset[int],
              lora: int = 0) -> None:
        self._begun[lane] = tuple(prompt)

    def reuse_floor(self, lane: int) -> int:
        return 0

    def save_prefix(self, lane: int, n: int) -> np.ndarray:
        """[n, 2]: per position, 1 where prefill wrote it (else 0), and its token."""
        self.calls.append(("save", lane, n))
        if self.fail_next_save:
            self.fail_next_save = False
            raise MemoryError("no host memory for the copy")
        return np.array([(writer == "prefill", t) for writer, t in self._state[lane].kv[:n]], np.int64)

    def restore_prefix(self, lane: int, kv: np.ndarray, n: int) -> None:
        self.calls.append(("restore", lane, n))
        self.lane_versions.touch([lane])
        written = self.chunk if self.fail_next_restore else n
        self._state[lane] = _LaneState((), [("prefill" if p else "decode", int(t)) for p, t in kv[:written]])
        if self.fail_next_restore:
            self.fail_next_restore = False
            raise RuntimeError("restore boom")

    def reset(self) -> None:
        self.resets += 1
        self.lane_versions.touch(range(self.lanes))
        self._state = [None] * self.lanes

    def prefill(self, lane: int, prompt: Sequence[int], start: int, sampling: SamplingParams,
                return_logits: bool = False, mask: np.ndarray | None = None) -> tuple[Sample | None, None]:
        self._gate("prefill")
        prompt = tuple(prompt)
        self.calls.append(("prefill", lane, start, prompt))
        if self.fail_next_prefill:
            self.fail_next_prefill = False
            raise RuntimeError("boom")
        self.lane_versions.touch([lane])
        if start % self.chunk:
            self.errors.append(f"prefill start {start} not a multiple of {self.chunk}")
        return self._feed(lane, prompt, start, self.chunk, sampling), None

    def _feed(self, lane: int, prompt: tuple[int, ...], start: int, length: int, sampling: SamplingParams
              ) -> Sample | None:
        """Write prompt[start:start + length] into the lane's KV; at the prompt's end, its first token."""
        st = self._state[lane]
        if st is None or st.prompt != prompt or st.length != start or start >= len(prompt):  # a new prompt
            kv = st.kv if st is not None else []
            if kv[:start] != [("prefill", t) for t in prompt[:start]]:
                self.errors.append(f"prefill of lane {lane} at {start} on a prefix the lane does not hold")
                return None
            st = self._state[lane] = _LaneState(prompt, kv[:start])
            self.admissions.append((lane, start, prompt))
            if self._begun[lane] != prompt:
                self.errors.append(f"prefill of a new prompt in lane {lane} without a begin")
            self._begun[lane] = None
        st.kv[start:] = [("prefill", t) for t in prompt[start:start + length]]
        if st.length < len(prompt):
            return None
        st.sampled = {len(prompt) - 1: first_token([t for _, t in st.kv], sampling.seed, self.vocab)}
        return _sample(st.sampled[len(prompt) - 1])

    def decode(self, rows: Sequence[DecodeRow | None], return_logits: bool = False
               ) -> tuple[list[Sample | None], None]:
        self._gate("decode")
        if len(rows) != self.lanes:
            self.errors.append(f"decode got {len(rows)} rows for {self.lanes} lanes")
        live = tuple((i, self._state[i].prompt if self._state[i] else ()) for i, r in enumerate(rows) if r)
        self.calls.append(("decode", live))
        self.lane_versions.touch([i for i, r in enumerate(rows) if r])
        if self.fail_next_decode:
            self.fail_next_decode = False
            raise RuntimeError("boom")
        return self._decode_rows(rows), None

    def pack(self, pieces: Sequence[PromptPiece], rows: Sequence[DecodeRow | None]) -> list[Sample | None]:
        """Prompt pieces and decode rows in one step; recorded as ("pack", ((lane, start, length), ...), (decoding
        lane, ...))."""
        self._gate("pack")
        self.calls.append(("pack", tuple((p.lane, p.start, p.length) for p in pieces),
                           tuple(i for i, r in enumerate(rows) if r)))
        self.lane_versions.touch({p.lane for p in pieces} | {i for i, r in enumerate(rows) if r})
        out = self._decode_rows(rows)
        for p in pieces:
            sample = self._feed(p.lane, tuple(p.prompt), p.start, p.length, p.sampling)
            if sample is not None:
                out[p.lane] = sample
        return out

    def verify(self, rows: Sequence[DecodeRow | None]) -> list[list[Sample] | None]:
        """A decode wave whose rows may carry drafts, each fed at the next position of its lane; recorded as
        ("verify", ((lane, drafts), ...))."""
        self._gate("verify")
        self.calls.append(("verify", tuple((i, r.drafts) for i, r in enumerate(rows) if r)))
        self.lane_versions.touch([i for i, r in enumerate(rows) if r])
        out: list[list[Sample] | None] = [None] * self.lanes
        for i, sample in enumerate(self._decode_rows(rows)):
            if sample is not None:
                out[i] = [sample] + [self._feed_token(i, d, rows[i].position + j) for j, d in
                                     enumerate(rows[i].drafts, 1)]
        return out

    def _decode_rows(self, rows: Sequence[DecodeRow | None]) -> list[Sample | None]:
        """Each live row fed at its position. A row must feed the token the lane sampled at the position before (its
        last token, or an accepted draft's), with the counter of its position."""
        out: list[Sample | None] = []
        for i, row in enumerate(rows):
            if row is None:
                out.append(None)
                continue
            st = self._state[i]
            if st is None or st.length < len(st.prompt):
                self.errors.append(f"decode of lane {i} before its prefill finished")
            elif (row.position > st.length or row.token != st.sampled.get(row.position - 1)
                  or row.counter != row.position - len(st.prompt) + 1):
                self.errors.append(f"lane {i}: row {row} but the lane holds length {st.length} and sampled "
                                   f"{st.sampled.get(row.position - 1)} there")
            out.append(self._feed_token(i, row.token, row.position))
        return out

    def _feed_token(self, lane: int, token: int, position: int) -> Sample:
        """Write `token` at `position` of the lane (dropping what it held from there on) and sample the next."""
        st = self._state[lane]
        nxt = next_token(token, position, self.vocab)
        if st is not None:
            st.kv[position:] = [("decode", token)]
            st.sampled[position] = nxt
        return _sample(nxt)
