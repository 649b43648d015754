"""Stop strings over streamed text: what of a choice's text may be shown now, and what must wait because it could be
the start of a stop string that the next tokens complete (a stop string may span token boundaries)."""

from __future__ import annotations


def holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def scan_stops(pending: str, stops: tuple[str, ...], include_stop: bool, armed: bool, final: bool
               ) -> tuple[str, str, str | None]:
    """(the text to show, the text held back, the stop string that ended the choice or None) for `pending`, the text
    not shown yet. Unless `armed` (the choice has its min_tokens: vLLM's rule), no stop string ends it; the earliest one
    found does, and of those starting there the longest, cut out unless `include_stop`. At the `final` text nothing
    is held."""
    found = [(i, -len(s)) for s in stops if (i := pending.find(s)) >= 0] if armed else []
    if found:
        cut, longest = min(found)
        return pending[:cut - longest if include_stop else cut], "", pending[cut:cut - longest]
    keep = 0 if final or not stops else holdback(pending, stops)
    return pending[:len(pending) - keep], pending[len(pending) - keep:], None
