"""Speculative decoding's host side (jaxstation/engine/speculative.py): drafts, acceptance, draft length."""

from __future__ import annotations

import numpy as np
import pytest

from jaxstation.engine.speculative import DraftLength, NgramProposer, accept


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The proposer's rule written out plainly: longest suffix first, its latest earlier occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),  # "1 2 3" seen before: what followed it
    ([1, 2, 3, 9, 7, 2, 3], 2, [9, 7]),  # only "2 3" matches
    ([5, 6, 7, 5, 6, 8, 5, 6], 4, [8, 5, 6]),  # the latest earlier occurrence, cut at the end of the tokens
    ([1, 2, 3, 4], 3, []),  # nothing repeats
    ([7, 7, 7], 5, [7]),  # overlapping occurrences
    ([256, 1, 256, 1], 2, [256, 1]),  # byte patterns that straddle token boundaries do not match
])
def test_ngram_proposals(tokens, k, expected) -> None:
    assert NgramProposer(1, 3).propose(tokens, k) == expected == lookup(tokens, k, 1, 3)


def test_ngram_proposals_equal_the_plain_rule_on_random_text() -> None:
    rng = np.random.default_rng(0)
    proposer = NgramProposer(2, 5)
    for _ in range(300):
        tokens = rng.integers(0, 6, size=int(rng.integers(2, 40))).tolist()
        tokens = [t * 257 for t in tokens]  # ids whose bytes repeat inside a token
        assert proposer.propose(tokens, 4) == lookup(tokens, 4, 2, 5)


def test_a_byte_match_across_token_boundaries_is_skipped() -> None:
    # little-endian, 0x01000000 then 0 are the bytes 00 00 00 01 00 00 00 00, and 256's (00 01 00 00) start at byte 2
    tokens = [0x01000000, 0, 3, 256]
    assert np.asarray(tokens[:2], np.int32).tobytes().find(np.int32(256).tobytes()) == 2
    assert NgramProposer(1, 1).propose(tokens, 2) == [] == lookup(tokens, 2, 1, 1)


def test_bad_ngram_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(3, 2)


@pytest.mark.parametrize("drafts, sampled, tokens", [
    ([4, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7]),  # every draft stands, and the row after the last samples one more
    ([4, 5, 6], [4, 9, 6, 7], [4, 9]),  # the first mismatch's sample ends the run
    ([4, 5, 6], [8, 5, 6, 7], [8]),  # no draft stands: still one token, the one plain decoding samples
    ([], [3], [3]),
])
def test_accept(drafts, sampled, tokens) -> None:
    assert accept(drafts, sampled) == tokens


def test_accept_needs_one_sample_more_than_drafts() -> None:
    with pytest.raises(ValueError, match="3 drafts need 4 samples"):
        accept([1, 2, 3], [1, 2, 3])


def test_draft_length_grows_on_full_acceptance_shrinks_on_misses_and_stops_after_patience() -> None:
    d = DraftLength(k_max=4, patience=2)
    assert (d.k, d.drafting) == (4, True)
    d.update(4, 1)
    assert d.k == 2
    d.update(2, 2)
    assert d.k == 3
    d.update(3, 0)
    assert (d.k, d.drafting) == (1, True)
    d.update(1, 0)
    assert (d.k, d.drafting) == (1, False)
