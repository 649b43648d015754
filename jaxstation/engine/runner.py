"""What the scheduler needs of an engine, as a Protocol: the local `Engine` and the mesh's `MeshEngine` both fit it.

The scheduler only ever reads the lane geometry and calls these methods from its one decode thread, so it cannot
tell whether the layers run in this process or across stations. Both runners feed a prompt chunk the same way, so
the prefill calls and the chunk they feed are written once here (`ChunkPrefill`, `PromptChunk`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from jaxstation.engine.prefix_cache import LaneVersions
from jaxstation.engine.rows import DecodeRow, PromptPiece, Sample, SamplingParams


class Runner(Protocol):
    lanes: int
    max_seq: int
    chunk: int  # prompt tokens per prefill step
    block: int  # positions per attention KV block
    scratch_pos: int  # the arena slot idle lanes write to; no request ever uses it
    arena: Any  # device state a caller may wait on (None when the KV lives elsewhere, e.g. on mesh stations)
    lane_versions: LaneVersions  # a new stamp per lane whenever its KV may change: what the prefix cache trusts
    token_controls: bool  # whether it applies SamplingParams' penalties, logit_bias, min_tokens and constraint masks
    prefill_budget: int  # rows per packed admission step (`pack`); 0: prompts enter one `prefill` chunk at a time
    verify_rows: int  # the most rows a `verify` step holds; 0 or 1: it does not speculate
    wave_widths: tuple[int, ...]  # the decode wave widths, the lanes last

    def begin(self, lane: int, prompt: Sequence[int], sampling: SamplingParams, stop_ids: frozenset[int],
              lora: int = 0) -> None:
        """A request takes `lane` (called before its first prefill chunk): set the lane's per-request token state and
        its LoRA slot (0: the base model)."""

    def prefill(self, lane: int, prompt: Sequence[int], start: int, sampling: SamplingParams,
                return_logits: bool = False, mask: np.ndarray | None = None) -> tuple[Sample | None, Any]:
        """Feed prompt[start:start + chunk] into `lane`; at the prompt's end, sample its first token (from those
        `mask` allows, when given)."""

    def prefill_scored(self, lane: int, prompt: Sequence[int], start: int, sampling: SamplingParams,
                       mask: np.ndarray | None = None) -> tuple[Sample | None, list[Sample]]:
        """`prefill`, plus the log-probability of each prompt token in the chunk given the tokens before it."""

    def pack(self, pieces: Sequence[PromptPiece], rows: Sequence[DecodeRow | None]) -> list[Sample | None]:
        """One packed step (only where prefill_budget > 0): the pieces' prompt tokens and the decode rows in one call.
        One sample per lane that decodes or whose piece ends its prompt."""

    def turn_rows(self, decode_rows: int) -> int:
        """(Only where prefill_budget > 0) the most rows of a packed turn that carries `decode_rows` decode rows."""

    def decode(self, rows: Sequence[DecodeRow | None], return_logits: bool = False
               ) -> tuple[list[Sample | None], Any]:
        """One wave: rows[i] feeds lane i (None = idle). One sample per live lane."""

    def verify(self, rows: Sequence[DecodeRow | None]) -> list[list[Sample] | None]:
        """(Only where verify_rows > 1) one wave in which a row with drafts also feeds each draft at the next
        positions of its lane, every row sampled with the request's key at its position. Per lane, the samples of
        its rows in order (None for an idle lane)."""

    def reuse_floor(self, lane: int) -> int:
        """The lowest position above 0 a prefill may restart `lane` at, reading the KV it holds (0: any)."""

    def save_prefix(self, lane: int, n: int) -> Any:
        """(Only where `arena` is local on one device: engine/prefix_tier.py) a host copy of `lane`'s global layers'
        KV at positions [0, n), n a multiple of the chunk."""

    def save_window(self, lane: int, n: int) -> Any:
        """(Only as `save_prefix`, and where `arena.rings` is not None) a host copy of what `lane`'s rings hold of the
        window before position n, while they still hold it."""

    def restore_prefix(self, lane: int, kv: Any, n: int, window: Any = None) -> None:
        """(Only as `save_prefix`) write positions [0, n) of a host copy into `lane`, and with rings the window before
        n (`save_window` at n): the lane may restart at n."""

    def reset(self) -> None:
        """Forget every lane's state after a failed step."""

    def warmup_steps(self) -> list[tuple[str, Callable[[], object]]]:
        """The warm-up as (name, run it once) steps, for start-up phase timing."""

    def warmup(self) -> None:
        """Compile and run every step the runner uses, leaving no request state behind."""


@dataclasses.dataclass(frozen=True)
class PromptChunk:
    """prompt[start:start + chunk] as a prefill step feeds it."""

    start: int
    piece: tuple[int, ...]  # the prompt tokens it feeds
    tokens: np.ndarray  # [chunk] int32: the piece, zero past the prompt's end
    last: bool  # it reaches the prompt's end, so it samples the first token
    following: tuple[int, ...]  # each row's next prompt token, where it has one (what a scored prefill scores)

    @classmethod
    def of(cls, prompt: Sequence[int], start: int, chunk: int) -> PromptChunk:
        """The chunk of `prompt` at `start`, which must be a multiple of `chunk`."""
        if start % chunk:
            raise ValueError(f"prefill start {start} is not a multiple of the chunk {chunk}")
        piece = tuple(prompt[start:start + chunk])
        tokens = np.zeros(chunk, np.int32)
        tokens[:len(piece)] = piece
        return cls(start, piece, tokens, start + len(piece) >= len(prompt), tuple(prompt[start + 1:start + 1 + chunk]))

    @property
    def targets(self) -> np.ndarray:
        """[chunk] int32: `following`, zero past it."""
        targets = np.zeros(len(self.tokens), np.int32)
        targets[:len(self.following)] = self.following
        return targets


class ChunkPrefill:
    """`prefill` and `prefill_scored` over a runner's `_prefill`, which feeds one `PromptChunk` and scores its rows
    where asked."""

    chunk: int

    def prefill(self, lane: int, prompt: Sequence[int], start: int, sampling: SamplingParams,
                return_logits: bool = False, mask: np.ndarray | None = None) -> tuple[Sample | None, Any]:
        """Feed prompt[start:start + chunk] into `lane`. When that reaches the prompt's end, sample its first token
        (from the tokens `mask` [words] allows, when given), and return the logits if asked.

        `start` must be a multiple of the chunk; chunks of one prompt go in order, after `begin`.
        """
        sample, logits, _ = self._prefill(lane, PromptChunk.of(prompt, start, self.chunk), sampling, return_logits,
                                          False, mask)
        return sample, logits

    def prefill_scored(self, lane: int, prompt: Sequence[int], start: int, sampling: SamplingParams,
                       mask: np.ndarray | None = None) -> tuple[Sample | None, list[Sample]]:
        """`prefill`, and for every prompt position p in (start, start + chunk] the model's log-probability of
        prompt[p] given prompt[:p], with its top alternatives (one Sample each, in order; token is prompt[p])."""
        sample, _, scored = self._prefill(lane, PromptChunk.of(prompt, start, self.chunk), sampling, False, True,
                                          mask)
        return sample, scored

    def _prefill(self, lane: int, chunk: PromptChunk, sampling: SamplingParams, return_logits: bool, scored: bool,
                 mask: np.ndarray | None) -> tuple[Sample | None, Any, list[Sample]]:
        """Feed `chunk` into `lane`: (the first token's sample where it is the last, the logits where asked, the
        scored rows where `scored`)."""
        raise NotImplementedError
