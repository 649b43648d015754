"""Drafts from a draft model: a second, smaller model with the target's vocabulary, on an Engine of its own.

The draft engine has its own KV arena and one lane per target lane; a request's drafts come from its lane there, so
drafting never touches the target's arena and the target's tokens are verified exactly as with any other proposer
(engine/speculative.py): they are plain decoding's, whatever the draft model says. A draft step that fails drafts
nothing that turn and rebuilds the draft arena: the target decodes on as without drafts, with the same tokens. The
decode thread owns the draft engine, as it owns the target's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxstation.engine import warmup
from jaxstation.engine.engine import Engine
from jaxstation.engine.rows import DecodeRow, PromptPiece, SamplingParams
from jaxstation.engine.speculative import Ask

log = logging.getLogger(__name__)
GREEDY = SamplingParams()


class DraftModel:
    """Greedy drafts from a draft model's engine (see the module docstring); a `Proposer` for `Speculation`."""

    def __init__(self, engine: Engine, observe: Callable[[float], None] | None = None) -> None:
        """observe: given each drafting round's seconds (e.g. a step-time histogram's)."""
        if not engine.prefill_budget:
            raise ValueError("a draft engine catches up in packed steps: it needs a prefill budget")
        self.engine = engine
        self.observe = observe
        # per lane: the tokens fed, by position. The decode thread's, as the draft engine is (the loader's in warm-up)
        self.written: list[list[int]] = [[] for _ in range(engine.lanes)]

    def propose_batch(self, asks: Sequence[Ask], room: int) -> dict[int, list[int]]:
        """k tokens for each ask (oldest first) while `room` lasts, drafted together."""
        ks = {}
        for lane, _, k in asks:
            ks[lane] = max(0, min(k, room))
            room -= ks[lane]
        asks = [(lane, tokens, ks[lane]) for lane, tokens, _ in asks if ks[lane]]
        if not asks:
            return {}
        t0 = time.perf_counter()
        try:
            drafts = self._draft(asks)
        except Exception:  # drafts never change a token: the turn goes on without them
            log.exception("draft step failed; rebuilding the draft arena")
            self.engine.reset()
            self.written = [[] for _ in range(self.engine.lanes)]
            return {}
        if self.observe is not None:
            self.observe(time.perf_counter() - t0)
        return drafts

    def _draft(self, asks: Sequence[Ask]) -> dict[int, list[int]]:
        """One drafting round, k tokens an ask, greedy: a catch-up in packed steps that samples each lane's first draft
        (`_catch_up`), then k - 1 decode waves over the lanes still drafting, each feeding the last draft and sampling
        the next. A lane's arena then holds the tokens it was fed (`written`)."""
        drafts = self._catch_up({lane: tokens for lane, tokens, _ in asks})
        for j in range(1, max(k for _, _, k in asks)):  # feed draft j at the position after the tokens' j - 1
            rows: list[DecodeRow | None] = [None] * self.engine.lanes
            for lane, tokens, k in asks:
                if k > j:
                    rows[lane] = DecodeRow(drafts[lane][-1], len(tokens) + j - 1, GREEDY, 0)
            samples, _ = self.engine.decode(rows)
            for lane, sample in enumerate(samples):
                if sample is not None:
                    drafts[lane].append(sample.token)
        for lane, tokens, _ in asks:
            self.written[lane] = [*tokens, *drafts[lane][:-1]]
        return drafts

    def _catch_up(self, tokens: dict[int, Sequence[int]]) -> dict[int, list[int]]:
        """Feed each lane its tokens past the prefix its arena holds, in packed steps of the engine's budget (oldest
        lane first); per lane, the first draft: the sample after its last token. A request's first round feeds its
        whole prompt this way; later rounds feed what the target generated since, usually one to k + 1 tokens."""
        fed = {lane: self.held(lane, t) for lane, t in tokens.items()}
        drafts: dict[int, list[int]] = {}
        while len(drafts) < len(tokens):
            budget, pieces = self.engine.prefill_budget, []
            for lane, t in tokens.items():
                if lane not in drafts and budget > 0:
                    pieces.append(PromptPiece(lane, t, fed[lane], min(len(t) - fed[lane], budget), GREEDY))
                    budget -= pieces[-1].length
            samples = self.engine.pack(pieces, [None] * self.engine.lanes)
            for p in pieces:
                fed[p.lane] += p.length
                if p.last:
                    drafts[p.lane] = [samples[p.lane].token]
        return drafts

    def warmup_steps(self) -> list[tuple[str, Callable[[], object]]]:
        """The draft engine's warm-up steps that drafting runs (decode waves and packed steps), named draft_*, after
        the one that compiles their programs."""
        steps = self.engine.warmup_steps()
        drafting = [(f"draft_{name}", run) for name, run in steps if name.startswith(("decode", "pack"))]
        return warmup.with_programs(self.engine, drafting, "draft_programs")

    def held(self, lane: int, tokens: Sequence[int]) -> int:
        """How many of `tokens` the lane's arena holds (at most all but the last, which the catch-up feeds). Position
        p holds the k/v of the tokens it was last fed up to p (`written`), so the positions before the first that
        differs from `tokens` are valid, and the rest are overwritten before anything reads them: a new request on
        the lane reuses the prefix it shares with the last one."""
        n = min(len(self.written[lane]), len(tokens) - 1)
        differ = np.flatnonzero(np.asarray(self.written[lane][:n]) != np.asarray(tokens[:n]))
        n = int(differ[0]) if differ.size else n
        return n if n >= self.engine.reuse_floor(lane) else 0
