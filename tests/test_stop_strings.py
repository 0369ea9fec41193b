"""Stop strings (jaxcb.host.output.StopStrings): the automaton fed the text piece by piece finds what a
search of the whole text finds (the earliest-starting stop string) and holds back exactly the tail
that could still grow into one; its cost per character does not grow with the strings' length."""

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcb.host.output import StopStrings


def reference(text: str, stops: tuple[str, ...]) -> tuple[int | None, int]:
    """(where the earliest stop string starts, or None; the longest tail of text that is a proper
    prefix of a stop string), by brute force."""
    found = [i for s in stops if (i := text.find(s)) >= 0]
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return (min(found) if found else None), hold


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text("abc", min_size=1, max_size=6), min_size=1, max_size=5).map(tuple),
       pieces=st.lists(st.text("abcd", max_size=5), max_size=12))
def test_the_automaton_agrees_with_a_search_of_the_whole_text(stops, pieces):
    automaton = StopStrings(stops)
    state, text = 0, ""
    for piece in pieces:
        state, cut = automaton.feed(state, piece, len(text))
        text += piece
        want_cut, want_hold = reference(text, stops)
        if want_cut is not None:
            # The first piece that completes a stop string reports the earliest one in the text.
            assert cut == want_cut
            return
        assert cut is None
        assert automaton.held(state) == want_hold


def test_cost_per_character_does_not_grow_with_the_strings():
    """16 stop strings of 256 characters that every new character keeps almost matching: the time per
    character stays within a small factor of one short stop string's."""

    def per_char(stops):
        automaton = StopStrings(stops)
        text = "a" * 20000
        t = time.perf_counter()
        state = 0
        for i in range(0, len(text), 4):
            state, cut = automaton.feed(state, text[i:i + 4], i)
            assert cut is None
        return (time.perf_counter() - t) / len(text)

    long = tuple("a" * 255 + chr(ord("b") + i) for i in range(16))
    short = ("b",)
    assert per_char(long) < 10 * per_char(short) + 2e-6
