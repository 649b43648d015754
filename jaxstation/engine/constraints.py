"""Structured outputs: a request held to a JSON schema, a regex, a choice of strings or a grammar, token by token.

The constraint engine is llguidance (the library behind vLLM's and llama.cpp's `guidance` backend): it reads the
model's `tokenizer.json`, compiles a JSON schema in about a millisecond, and writes each step's allowed tokens as a
bitmask of 32-bit words (token t is bit t % 32 of word t // 32). It brings no other dependency.

Threads. `Grammars.compile` runs on the request's handler thread, never the decode thread, and under a time limit,
so a slow or bad constraint is a 400 and never stalls a wave. A compiled `Constraint` rides on its Job; the decode
thread asks it for its mask before a step and feeds it the sampled token after. The device masks the row's logits
(engine/penalties.py), so the choice among the allowed tokens is the model's and the sampler's, and a row's bits
never depend on another row.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Literal

import llguidance
import numpy as np

from jaxstation.model.tokenizer import Tokenizer

WORD_BITS = 32  # tokens per mask word
# between two JSON tokens: a newline and an indent, not a padding run (a small model would pad until max_tokens)
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,12}"
COMPILE_TIMEOUT_S = 5.0
Kind = Literal["json", "regex", "choice", "grammar"]


def mask_words(vocab: int) -> int:
    return (vocab + WORD_BITS - 1) // WORD_BITS


def token_bits(tokens: Iterable[int], vocab: int) -> np.ndarray:
    """A mask [words] int32 with the bits of `tokens` set."""
    bits = np.zeros(mask_words(vocab) * WORD_BITS, np.uint8)
    bits[np.fromiter(tokens, np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


class ConstraintError(ValueError):
    """A constraint that cannot be compiled: `field` is the request field it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


class ConstraintFailed(Exception):
    """A constrained request that cannot go on: no token is allowed, or the grammar refused a token. `field` is the
    request field the constraint came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class ConstraintSpec:
    """What a request asks its output to match, and the request field that asked (errors name it).

    json: a JSON schema (a dict; {"type": "object"} for any object); regex: a pattern the whole output matches;
    choice: one of a list of strings; grammar: a Lark grammar, or GBNF as llama.cpp writes it."""

    kind: Kind
    value: Any
    field: str

    def grammar(self) -> str:
        """The llguidance grammar definition. Raises ConstraintError for a value that is not one."""
        try:
            if self.kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    self.value, overrides={"whitespace_pattern": JSON_WHITESPACE})
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.value)
            if self.kind == "choice":
                return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
            return llguidance.grammar_from("grammar", self.value)
        except (ValueError, TypeError) as e:
            raise ConstraintError(self.field, f"{self.field}: {e}") from None


class Constraint:
    """One request's position in its grammar (an llguidance matcher), advanced by each generated token.

    The grammar decides where the output ends: EOS is allowed only where the grammar accepts, and a grammar that can go
    no further ends its request ("stop") without a sampled EOS. A row left with no token to choose (a grammar that only
    accepts EOS while min_tokens holds it back, or an allowed_token_ids list outside the grammar) ends its request with
    `ConstraintFailed`, before the step, so no masked-out token is ever sampled."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, field: str) -> None:
        self._matcher, self.vocab, self.field = matcher, vocab, field
        self._limits: tuple[np.ndarray | None, np.ndarray | None] | None = None  # (stop ids, allowed ids) as masks

    def copy(self) -> Constraint:
        """A constraint at the same position, advanced on its own (one per choice of a request)."""
        return Constraint(self._matcher.deep_copy(), self.vocab, self.field)

    @property
    def finished(self) -> bool:
        """The grammar can go no further: the output is complete."""
        return self._matcher.is_stopped()

    def fill(self, row: np.ndarray) -> None:
        """Write the tokens allowed next into row [words] int32 (C-contiguous). Raises ConstraintFailed, whatever
        goes wrong: the decode thread fails this request, never the wave."""
        try:
            self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        except Exception as e:
            raise ConstraintFailed(self.field, f"the {self.field} constraint failed: {e}") from None
        if self._matcher.is_error():
            raise ConstraintFailed(self.field, f"the {self.field} constraint failed: {self._matcher.get_error()}")

    def next_mask(self, generated: int, min_tokens: int, stop_ids: Iterable[int], allowed: Sequence[int]
                  ) -> np.ndarray:
        """The mask [words] int32 of the request's next token: what the grammar allows, less its stop ids while
        min_tokens holds them (fewer than min_tokens generated) and anything outside its allowed_token_ids (when it
        names them). Raises ConstraintFailed if no token is left."""
        if self._limits is None:
            self._limits = (token_bits(stop_ids, self.vocab) if min_tokens else None,
                            token_bits(allowed, self.vocab) if allowed else None)
        held, only = self._limits
        mask = np.zeros(mask_words(self.vocab), np.int32)
        self.fill(mask)
        if held is not None and generated < min_tokens:
            mask &= ~held
        if only is not None:
            mask &= only
        if not mask.any():
            raise ConstraintFailed(self.field, f"the {self.field} constraint allows no token after {generated} "
                                   "generated (min_tokens or allowed_token_ids may rule out all it allows)")
        return mask

    def advance(self, token: int) -> None:
        """Take the sampled token. Raises ConstraintFailed if the grammar refuses it."""
        try:
            ok = self._matcher.consume_token(token)
        except Exception as e:
            raise ConstraintFailed(self.field, f"the {self.field} constraint failed: {e}") from None
        if not ok:
            raise ConstraintFailed(self.field, f"the {self.field} constraint refused token {token}: "
                                               f"{self._matcher.get_error()}")


class Grammars:
    """Compiles constraints for one model's tokenizer. llguidance's tokenizer (built from the vocabulary in about
    0.4 s) is built on the first compile, under a lock, so a station that never sees a constraint never pays for it.
    Compiling is thread-safe, and each compile runs on a thread of its own so that a compile past `timeout_s` is
    answered at once; its thread finishes it in the background and ends, holding up no later compile."""

    def __init__(self, tokenizer: Tokenizer, vocab: int, eos_ids: Iterable[int],
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self._source, self.vocab, self.eos_ids = tokenizer, vocab, sorted(eos_ids)
        self.timeout_s = timeout_s
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._source.backend.to_str(), n_vocab=self.vocab,
                                                         eos_token=self.eos_ids)
            return self._tokenizer

    def compile(self, spec: ConstraintSpec) -> Constraint:
        """The constraint at its start. Raises ConstraintError naming spec.field: an invalid or unsupported schema,
        regex or grammar (with llguidance's reason), or a compile past the time limit (which the one-off tokenizer
        build does not count against)."""
        grammar = spec.grammar()
        self.tokenizer()
        future: Future = Future()
        threading.Thread(target=self._compile_into, args=(grammar, future), name="grammar-compile",
                         daemon=True).start()
        try:
            matcher = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise ConstraintError(spec.field, f"{spec.field}: compiling the constraint took longer than "
                                              f"{self.timeout_s:g} s") from None
        if matcher.is_error():
            raise ConstraintError(spec.field, f"{spec.field}: {matcher.get_error()}")
        return Constraint(matcher, self.vocab, spec.field)

    def _compile_into(self, grammar: str, future: Future) -> None:
        """Answer `future` with the grammar's matcher (its own compile thread)."""
        try:
            future.set_result(self._matcher(grammar))
        except Exception as e:
            future.set_exception(e)

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        """The matcher, with its first mask computed once: a grammar that cannot start fails here, not in a wave."""
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()
        return matcher
