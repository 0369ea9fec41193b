"""Stop-string cost per generated token: the automaton (jaxcb.host.output.StopStrings) against the search it
replaced (each stop string searched for in the new text, and every prefix of each tried against the
text's tail to find what to hold back: O(sum of len(s)^2) per token).

    .venv/bin/python -m bench.stop_strings [--stops 16] [--chars 256] [--tokens 2000]

16 stop strings of 256 characters, 4 characters a token, two texts: one the strings keep almost
matching (runs of "a" that each string continues differently) and one unrelated to them (where the old
hold-back tried every prefix of every string each token).
"""

from __future__ import annotations

import argparse
import time

from bench.common import machine
from jaxcb.host.output import StopStrings


def search(text: str, stops: tuple[str, ...], emitted: int) -> tuple[int | None, int]:
    """The replaced code (jaxcb/host/output.py before the automaton): earliest stop, then the hold-back."""
    best = None
    for s in stops:
        i = text.find(s, max(0, emitted - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return best, hold


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stops", type=int, default=16)
    ap.add_argument("--chars", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args()
    stops = tuple("a" * (args.chars - 1) + chr(ord("b") + i) for i in range(args.stops))
    for name, piece in (("near-miss text", "aaaa"), ("unrelated text", "xyz ")):
        pieces = [piece] * args.tokens
        text, emitted = "", 0
        t = time.perf_counter()
        for p in pieces:
            text += p
            cut, hold = search(text, stops, emitted)
            emitted = len(text) - hold
        before = (time.perf_counter() - t) / args.tokens

        automaton, state, text = StopStrings.of(stops), 0, ""
        t = time.perf_counter()
        for p in pieces:
            state, cut = automaton.feed(state, p, len(text))
            text += p
            automaton.held(state)
        after = (time.perf_counter() - t) / args.tokens
        print(f"machine: {machine()}; {args.stops} stop strings of {args.chars} characters, {args.tokens} tokens of "
              f"4 characters, {name}: per token {before * 1e6:.1f} us before (search), {after * 1e6:.2f} us after "
              f"(automaton), {before / after:.0f}x")


if __name__ == "__main__":
    main()
