"""Output processing: a request's sampled tokens become what its caller sees.

Plain Python, no JAX. Each live request (each sample of an n > 1 request) has an `OutputStream`: its
incremental detokenizer, its text so far and how much of it was sent. Text that could still grow into
a stop string is held back until it cannot; a stop string ends the request and is never sent, nor is
anything after it. Events go into the step's list and are handed to the requests' callbacks by
`deliver()` once the step's bookkeeping is done (so a caller that sees its final event also sees its
pages freed); a failing callback never fails the step. The scheduler decides the finishes it can see from token ids (stop tokens, EOS,
length); this module adds the stop strings, which need the text.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable

from jaxcb.host.embedding import pooled_vector
from jaxcb.host.request import FinishReason, Request, TokenEvent
from jaxcb.host.detokenizer import IncrementalDetokenizer

EventCallback = Callable[[TokenEvent], None]
log = logging.getLogger("jaxcb.host.output")


@dataclasses.dataclass
class OutputStream:
    detok: IncrementalDetokenizer | None
    seed: int  # the request's sampling seed (drawn at submission when none was given)
    callback: EventCallback | None
    text: str = ""
    emitted: int = 0  # chars of `text` already sent
    stop_state: int = 0  # where `text` has taken the request's StopStrings automaton
    started: bool = False  # an event was sent (the first carries the prompt's logprobs)


class Outputs:
    """The output streams of the live requests, keyed by Request.key."""

    def __init__(self, tokenizer, clock=time.monotonic):
        self.tokenizer = tokenizer
        self._clock = clock  # the engine's (first-token times)
        self.streams: dict[tuple[str, int], OutputStream] = {}
        self._undelivered: list[tuple[EventCallback, TokenEvent]] = []

    def deliver(self) -> None:
        """Hand this step's events to their callbacks, in the order they were made."""
        pending, self._undelivered = self._undelivered, []
        for callback, event in pending:
            try:
                callback(event)
            except Exception:  # noqa: BLE001 - a broken listener must not fail the step for others
                log.exception("event callback for %s failed", event.request_id)

    def new_stream(self, seed: int, callback: EventCallback | None, skip_special: bool = True) -> OutputStream:
        detok = IncrementalDetokenizer(self.tokenizer, skip_special) if self.tokenizer is not None else None
        return OutputStream(detok, seed, callback)

    def open(self, r: Request, stream: OutputStream) -> None:
        self.streams[r.key] = stream

    def __contains__(self, r: Request) -> bool:
        return r.key in self.streams

    def seed(self, r: Request) -> int:
        return self.streams[r.key].seed

    @staticmethod
    def _prompt_logprobs(r: Request, stream: OutputStream) -> tuple | None:
        """What the request's next event carries of its prompt's logprobs: all of them on its first
        event (entry p: prompt token p + 1's), when they were asked for; else None."""
        first, stream.started = not stream.started, True
        return tuple(r.prompt_logprobs) if first and r.params.prompt_logprobs is not None else None

    def on_token(self, r: Request, token: int, logprobs, reason: FinishReason | None,
                 events: list[TokenEvent], stop_token: bool | None = None) -> FinishReason | None:
        """r's new token (already appended to its output): its text delta, or its final event.
        `reason` is the scheduler's finish, if any; returns the finish, a stop string's included.
        `stop_token`: the token ended the request and its text is not shown (default: reason is STOP,
        an end-of-sequence or stop token; a structured output's last token is shown)."""
        p, stream = r.params, self.streams[r.key]
        hide = reason is FinishReason.STOP if stop_token is None else stop_token
        piece = ""
        if stream.detok is not None:
            piece = stream.detok.add([token])  # always: keeps the detokenizer's window aligned
            if hide:  # a stop token's text is never shown
                piece = ""
            stream.text += piece
        cut = None
        stops = StopStrings.of(p.stop) if p.stop else None
        if stops is not None and piece:
            stream.stop_state, cut = stops.feed(stream.stop_state, piece, len(stream.text) - len(piece))
        # What ended it (vLLM's stop_reason): a stop token id, or a stop string; None for the others.
        stop_reason = token if reason is FinishReason.STOP and token in p.stop_token_ids else None
        if reason is FinishReason.REPETITION:
            stop_reason = "repetition_detected"  # (vLLM's)
        if cut is not None and len(r.output_ids) >= p.min_tokens:  # (before min_tokens a stop string goes by)
            # the stop string that starts there (the shortest, if several: it was complete first)
            stop_reason = min((s for s in p.stop if stream.text.startswith(s, cut)), key=len)
            if p.include_stop_str_in_output:
                cut += len(stop_reason)
            stream.text = stream.text[:cut]
            reason = FinishReason.STOP
        queue_s = None
        if r.first_token_time is None:
            r.first_token_time = self._clock()
            queue_s = (r.first_scheduled_time or r.first_token_time) - r.arrival_time
        if reason is not None:
            self.close(r, reason, events, new_tokens=(token,), logprobs=logprobs, queue_s=queue_s,
                       flush=not hide and cut is None, stop_reason=stop_reason)
            return reason
        safe = len(stream.text) - (stops.held(stream.stop_state) if stops is not None else 0)
        delta, stream.emitted = stream.text[stream.emitted:safe], max(stream.emitted, safe)
        _emit(TokenEvent(r.request_id, (token,), delta, False, None, logprobs, len(r.prompt_ids),
                         len(r.output_ids), queue_s=queue_s, num_cached_tokens=r.num_cached_tokens,
                         index=r.sample_index, prompt_logprobs=self._prompt_logprobs(r, stream)),
              stream, events, self._undelivered)
        return None

    def close(self, r: Request, reason: FinishReason, events: list[TokenEvent], new_tokens=(), logprobs=None,
              error: str | None = None, queue_s: float | None = None, flush: bool | None = None,
              stop_reason: int | str | None = None, request_error: bool = False) -> None:
        """r's final event: the text still held back (up to any stop string) and the finish reason.
        `flush`: add what the detokenizer still holds (default: unless the request stopped); `stop_reason`:
        the stop token id or stop string that ended it."""
        stream = self.streams.pop(r.key)
        if stream.detok is not None and (reason is not FinishReason.STOP if flush is None else flush):
            stream.text += stream.detok.flush()  # a character cut off by the end is not dropped
        _emit(TokenEvent(r.request_id, tuple(new_tokens), stream.text[stream.emitted:], True, reason, logprobs,
                         len(r.prompt_ids), len(r.output_ids), error, queue_s,
                         num_cached_tokens=r.num_cached_tokens, index=r.sample_index,
                         prompt_logprobs=self._prompt_logprobs(r, stream), stop_reason=stop_reason,
                         request_error=request_error, embedding=pooled_vector(r)),
              stream, events, self._undelivered)


def _top(result, row: int, n: int) -> tuple:
    """Sampled row `row`'s n best tokens, from the sampler's output: ((token id, logprob), ...)."""
    return tuple(zip(result.top_ids[row, :n].tolist(), result.top_logprobs[row, :n].tolist()))


def token_logprobs(result, row: int, n: int) -> tuple:
    """What a sampled token's event carries of logprobs: ((its logprob, its row's n best),)."""
    return ((float(result.logprobs[row]), _top(result, row, n)),)


def take_prompt_logprobs(chunk, result) -> None:
    """A scoring chunk's prompt positions, each scored by a sample row of the step (`chunk.score_rows`,
    jaxcb.host.batch), onto its request's prompt_logprobs: (logprob, rank, n best) per position; a
    position scored before a preemption is kept."""
    r, n = chunk.request, chunk.request.params.prompt_logprobs
    for p, row in enumerate(chunk.score_rows, start=chunk.score_first):
        if p == len(r.prompt_logprobs):
            r.prompt_logprobs.append((float(result.logprobs[row]), int(result.ranks[row]), _top(result, row, n)))


def _emit(event: TokenEvent, stream: OutputStream, events: list[TokenEvent], undelivered: list) -> None:
    events.append(event)
    if stream.callback is not None:
        undelivered.append((stream.callback, event))


class StopStrings:
    """A request's stop strings as an Aho-Corasick automaton over characters, fed the text as it grows:
    each new character costs amortised constant time, however many and however long the stop strings
    (re-searching the text for each string cost O(sum of len(s)^2) per token). A state is a node of the
    trie of the strings: the longest tail of the text so far that is a prefix of one of them, so its
    depth is the text that must be held back (it could still grow into a stop string)."""

    def __init__(self, stops: tuple[str, ...]):
        self.next: list[dict[str, int]] = [{}]
        self.depth = [0]
        ends = [0]  # the length of the stop string that ends at a node (0: none)
        for s in stops:
            node = 0
            for c in s:
                if c not in self.next[node]:
                    self.next.append({})
                    self.depth.append(self.depth[node] + 1)
                    ends.append(0)
                    self.next[node][c] = len(self.next) - 1
                node = self.next[node][c]
            ends[node] = len(s)
        # Failure links in breadth-first order; `match[n]`: the longest stop string that ends at n's
        # text (n's own, else its failure's), i.e. the earliest-starting match ending here.
        self.fail = [0] * len(self.next)
        self.match = list(ends)
        queue = list(self.next[0].values())
        for node in queue:
            for c, child in self.next[node].items():
                f = self.fail[node]
                while f and c not in self.next[f]:
                    f = self.fail[f]
                self.fail[child] = self.next[f][c] if c in self.next[f] and self.next[f][c] != child else 0
                self.match[child] = ends[child] or self.match[self.fail[child]]
                queue.append(child)

    @staticmethod
    @functools.lru_cache(maxsize=512)
    def of(stops: tuple[str, ...]) -> "StopStrings":
        """The automaton for these strings, built once however many requests and samples use them."""
        return StopStrings(stops)

    def feed(self, state: int, piece: str, at: int) -> tuple[int, int | None]:
        """Feeds `piece`, which starts at index `at` of the text: (the new state, the index where the
        earliest stop string that ends inside `piece` starts, or None)."""
        cut = None
        nxt, fail, match = self.next, self.fail, self.match
        for i, c in enumerate(piece):
            while state and c not in nxt[state]:
                state = fail[state]
            state = nxt[state].get(c, 0)
            if match[state]:
                start = at + i - match[state] + 1
                cut = start if cut is None else min(cut, start)
        return state, cut

    def held(self, state: int) -> int:
        return self.depth[state]
