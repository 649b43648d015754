"""Logprobs and usage in OpenAI's shapes, built from a run's `Sample`s and counts as the protocol's reply models.

Chat completions list each token with its text, logprob, bytes and top alternatives (`ChatLogprobs`); completions
use the legacy columns (`CompletionLogprobs`): tokens, their logprobs, each position's top alternatives by text, and
text offsets. A logprob of -inf is sent as -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

import math

from jaxstation.chat.run import Choice, Run
from jaxstation.engine.rows import Sample
from jaxstation.model.detokenizer import IncrementalDetokenizer
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


def usage(run: Run) -> p.Usage:
    """OpenAI's usage. Each prompt counts once; its cached tokens are the most any of its choices reused."""
    n = run.counts()
    return p.Usage(prompt_tokens=n.prompt, completion_tokens=n.generated, total_tokens=n.prompt + n.generated,
                   prompt_tokens_details=p.PromptTokensDetails(cached_tokens=n.cached))


def echo(run: Run, c: Choice) -> tuple[str, p.CompletionLogprobs | None]:
    """With echo: the prompt's text and, with logprobs, the logprobs of its tokens then the generated ones.

    A prompt token's text_offset is where it starts in the prompt's decoded text (the prompt as sent, when it
    decodes back to itself, as byte-level BPE does)."""
    text = run.req.echo_texts[c.prompt]
    if run.req.logprobs is None:
        return text, None
    prompt = run.req.prompts[c.prompt]
    detok = IncrementalDetokenizer(run.tok, skip_special_tokens=False)
    offsets = []
    for t in prompt:
        offsets.append(len(detok.text))
        detok.push(t)
    shift = len(text)  # generated offsets count from the end of the echoed prompt
    entries: list[tuple[Sample | None, int]] = list(zip([None, *c.prompt_logprobs], offsets, strict=True))
    entries += [(s, off + shift) for s, off in c.logprobs]
    tokens = list(prompt) + [s.token for s, _ in c.logprobs]
    return text, completion_logprobs(run.tok, entries, run.req.logprobs, echo=True, tokens=tokens)


def logprobs_since(run: Run, c: Choice, streaming: bool = False) -> p.ChatLogprobs | p.CompletionLogprobs | None:
    """The logprobs of the tokens not reported yet (a stream's chunk without new tokens gets null)."""
    if run.req.logprobs is None or (streaming and c.lp_sent == len(c.logprobs)):
        return None
    entries, c.lp_sent = c.logprobs[c.lp_sent:], len(c.logprobs)
    if run.req.chat:
        return chat_logprobs(run.tok, entries, run.req.logprobs)
    return completion_logprobs(run.tok, entries, run.req.logprobs, echo=run.req.echo_texts is not None)
