"""Speculative decoding's host side: proposing drafts by prompt lookup, accepting them, and sizing the next draft.

A lane that speculates feeds its last token and k drafted tokens as k + 1 rows at consecutive positions of one step,
and every row is sampled with the request's own key at its position, as plain decoding samples that position. Row j's
sample is the token plain decoding would produce after the first j drafts, so the drafts are accepted while each
equals the sample before it (`accept`); the first mismatch's sample is the next token, and a step always yields at
least one token. The tokens are then those of plain decoding by construction, whatever was drafted. Proposers answer
`propose_batch` for the requests of one step at once: prompt lookup (`NgramProposer`) or a draft model
(engine/draft.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

Ask = tuple[int, Sequence[int], int]  # (lane, the request's tokens so far, the most tokens it may draft)


class Proposer(Protocol):
    def propose_batch(self, asks: Sequence[Ask], room: int) -> dict[int, list[int]]:
        """Drafts for the `asks` (oldest request first), `room` tokens in all: lane -> its drafts, none empty."""


class LookupProposer:
    """A proposer that drafts for each request from its own tokens alone (`propose`), oldest first, each taking what
    it proposes from the room left."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, asks: Sequence[Ask], room: int) -> dict[int, list[int]]:
        drafts = {}
        for lane, tokens, k in asks:
            if min(k, room) > 0 and (proposed := self.propose(tokens, min(k, room))):
                drafts[lane] = proposed
                room -= len(proposed)
        return drafts


@dataclasses.dataclass(frozen=True)
class NgramProposer(LookupProposer):
    """Prompt lookup over a request's tokens, as vLLM's and llama.cpp's n-gram modes: the longest suffix of its tokens
    (prompt and output), from `max_n` tokens down to `min_n`, found earlier in them; the tokens that followed its
    latest earlier occurrence are the draft."""

    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {self.min_n} and {self.max_n}")

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` (n from max_n
        down to min_n) that occurs earlier; [] when none does."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        data = np.asarray(tokens, np.int32).tobytes()  # 4 bytes a token: rfind at C speed, kept to token boundaries
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = data[-4 * n:]
            end = len(data) - 4  # a match must end before the last token, so that something follows it
            while (at := data.rfind(suffix, 0, end)) >= 0:
                if at % 4 == 0:
                    start = at // 4 + n
                    return list(tokens[start:start + k])
                end = at + 4 * n - 1
        return []


@dataclasses.dataclass(frozen=True)
class Speculation:
    """How a scheduler speculates: the proposer, the most tokens a request drafts a step (`k`), and how many steps in
    a row that accept nothing end a request's drafting (`patience`)."""

    proposer: Proposer = NgramProposer()
    k: int = 4
    patience: int = 4
    rows: int = 4  # drafts may widen a wave to this many rows; past it, they only fill the rows its width pads

    def verify_cap(self, live: int, wave_widths: tuple[int, ...], verify_rows: int) -> int:
        """The rows a verify step of `live` decode rows may hold: the width their plain wave has anyway, or `rows` if
        more, and never more than `verify_rows`. A wider wave costs far more (a 1 + 7 row step costs about four 1-row
        steps here, a 1 + 3 row one under two), so drafts widen only narrow waves."""
        width = next((w for w in wave_widths if w >= live), live)
        return min(verify_rows, max(width, self.rows))

    def draft_length(self) -> DraftLength:
        return DraftLength(self.k, self.patience)


def accept(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verify step yields: `sampled[j]` is row j's sample (row 0 feeds the lane's last token, row j its
    draft j - 1), so draft j stands while it equals `sampled[j]`; the run ends with the first sample that differs
    from its draft, or with the sample after the last draft."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} samples, got {len(sampled)}")
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return list(sampled[:n + 1])


@dataclasses.dataclass
class DraftLength:
    """How many tokens a request drafts next: up to `k_max`, grown by one after a step that accepted every draft,
    cut to one more than what was accepted otherwise; after `patience` steps in a row that accepted nothing, none."""

    k_max: int
    patience: int = 4
    k: int = 0
    misses: int = 0

    def __post_init__(self) -> None:
        self.k = self.k or self.k_max

    @property
    def drafting(self) -> bool:
        return self.misses < self.patience

    def update(self, drafted: int, accepted: int) -> None:
        """Fold in a verify step that drafted `drafted` tokens and accepted `accepted` of them."""
        if drafted == 0:
            return
        self.misses = 0 if accepted else self.misses + 1
        self.k = min(self.k_max, self.k + 1) if accepted == drafted else max(1, accepted + 1)
