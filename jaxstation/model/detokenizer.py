"""`IncrementalDetokenizer`: a stream of token ids to text, O(1) amortised per token, never emitting half a UTF-8
character."""

from __future__ import annotations

from jaxstation.model.tokenizer import Tokenizer


def _incomplete_tail(buf: bytes | bytearray) -> int:
    """Length of a trailing, possibly-valid but unfinished UTF-8 sequence at the end of `buf` (0 if none)."""
    n = len(buf)
    for back in range(1, min(3, n) + 1):
        b = buf[n - back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead
            continue
        if b >= 0xF0:
            need = 4 if b <= 0xF4 else 1
        elif b >= 0xE0:
            need = 3
        elif b >= 0xC2:
            need = 2
        else:
            need = 1  # ASCII or an invalid lead: nothing to wait for
        return back if back < need else 0
    return 0


class IncrementalDetokenizer:
    """Streams text from token ids, O(1) amortised per token, never emitting a partial UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._pending = bytearray()
        self._pieces: list[str] = []
        self._text_cache: str | None = ""

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
            self._pieces = [self._text_cache]
        return self._text_cache

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
            self._text_cache = None
        return piece

    def push(self, token_id: int) -> str:
        """Feed one token; return the new text it completes ("" while a character is still incomplete)."""
        tok = self.tokenizer
        if tok.is_special(token_id) and self.skip_special_tokens:
            return ""
        self._pending += tok.token_bytes(token_id)
        keep = _incomplete_tail(self._pending)
        cut = len(self._pending) - keep
        if cut == 0:
            return ""
        piece = self._pending[:cut].decode("utf-8", errors="replace")
        del self._pending[:cut]
        return self._emit(piece)

    def flush(self) -> str:
        """Whatever is left at the end, incomplete bytes decoded with errors="replace"."""
        piece = self._pending.decode("utf-8", errors="replace")
        self._pending.clear()
        return self._emit(piece)
