"""Stop strings over streamed text (jaxstation/openai/stops.py), piece by piece as tokens arrive."""

from __future__ import annotations

import pytest

from jaxstation.chat.stops import scan_stops


def stream(pieces: list[str], stops: tuple[str, ...], include_stop: bool = False) -> tuple[list[str], str | None]:
    """What each piece shows, and the stop string that ended the text (None: none did), fed as a choice does."""
    held, shown = "", []
    for k, piece in enumerate(pieces):
        out, held, stopped = scan_stops(held + piece, stops, include_stop, armed=True, final=k == len(pieces) - 1)
        shown.append(out)
        if stopped:
            return shown, stopped
    return shown, None


@pytest.mark.parametrize("pieces, stops, include, shown, stopped", [
    (["Hel", "lo wor", "ld"], ("lo w",), False, ["He", "l"], "lo w"),  # "l" held, then "lo w" is seen
    (["Hel", "lo wor", "ld"], ("lo w",), True, ["He", "llo w"], "lo w"),
    (["ab", "c", "d"], ("cx",), False, ["ab", "", "cd"], None),  # "c" held, then shown when "d" rules it out
    (["a\\n", "\\n", "b"], ("\\n\\n", "\\n"), False, ["a"], "\\n"),  # the earliest stop string wins
    (["xy", "zx", "y"], ("zxy", "zx"), True, ["xy", "zx"], "zx"),  # of those starting there, the longest found
    (["tail", "ca"], ("cat",), False, ["tail", "ca"], None),  # the final text holds nothing back
])
def test_scan_stops(pieces, stops, include, shown, stopped) -> None:
    assert stream(pieces, stops, include) == (shown, stopped)


def test_an_unarmed_choice_is_not_ended_by_a_stop_string() -> None:
    assert scan_stops("Paris. Paris", (" Paris",), False, armed=False, final=False) == ("Paris. Paris", "", None)
    assert scan_stops("Paris. Paris", (" Paris",), False, armed=True, final=False) == ("Paris.", "", " Paris")
