"""Logprobs in OpenAI's two shapes, built from the station's `Sample`s as the protocol's reply models.

Chat completions list each token with its text, logprob, bytes and top alternatives (`ChatLogprobs`); completions
use the legacy columns (`CompletionLogprobs`): tokens, their logprobs, each position's top alternatives by text, and
text offsets. A logprob of -inf is sent as -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

import math

from jaxstation.engine.rows import Sample
from jaxstation.model.tokenizer import Tokenizer
from jaxstation.openai import protocol as p


def finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def token_text(tok: Tokenizer, token: int) -> str:
    return tok.token_bytes(token).decode("utf-8", errors="replace")


def chat_logprobs(tok: Tokenizer, entries: list[tuple[Sample, int]], k: int) -> p.ChatLogprobs:
    """Each entry's token with its top `k` alternatives."""

    def one(token: int, lp: float) -> dict:
        raw = tok.token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": finite(lp), "bytes": list(raw)}

    return p.ChatLogprobs(content=[p.TokenLogprob(**one(s.token, s.logprob),
                                                  top_logprobs=[p.TopLogprob(**one(t, lp)) for t, lp in s.top[:k]])
                                   for s, _ in entries])


def completion_logprobs(tok: Tokenizer, entries: list[tuple[Sample | None, int]], k: int, echo: bool,
                        tokens: list[int] | None = None) -> p.CompletionLogprobs:
    """The legacy shape. An entry without a Sample (echo's first prompt token) has null logprobs.

    With echo, each position's top_logprobs holds its own token, then the top max(k, 1) (so the model's top-1 is
    always there and a duplicate text keeps the top one's logprob)."""
    tokens = tokens if tokens is not None else [s.token for s, _ in entries]

    def top(s: Sample | None) -> dict[str, float] | None:
        if s is None:
            return None
        alternatives = s.top[:max(k, 1)] if echo else s.top[:k]
        head = [(s.token, s.logprob)] if echo else []
        return {token_text(tok, t): finite(lp) for t, lp in head + list(alternatives)}

    return p.CompletionLogprobs(tokens=[token_text(tok, t) for t in tokens],
                                token_logprobs=[None if s is None else finite(s.logprob) for s, _ in entries],
                                top_logprobs=[top(s) for s, _ in entries], text_offset=[off for _, off in entries])
