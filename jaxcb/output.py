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
import logging
import time
from typing import Callable

from jaxcb.request import FinishReason, Request, TokenEvent
from jaxcb.tokenizer import IncrementalDetokenizer

EventCallback = Callable[[TokenEvent], None]
log = logging.getLogger("jaxcb.output")


@dataclasses.dataclass
class OutputStream:
    detok: IncrementalDetokenizer | None
    seed: int  # the request's sampling seed (drawn at submission when none was given)
    callback: EventCallback | None
    text: str = ""
    emitted: int = 0  # chars of `text` already sent


class Outputs:
    """The output streams of the live requests, keyed by Request.key."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
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

    def new_stream(self, seed: int, callback: EventCallback | None) -> OutputStream:
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        return OutputStream(detok, seed, callback)

    def open(self, r: Request, stream: OutputStream) -> None:
        self.streams[r.key] = stream

    def __contains__(self, r: Request) -> bool:
        return r.key in self.streams

    def seed(self, r: Request) -> int:
        return self.streams[r.key].seed

    def on_token(self, r: Request, token: int, logprobs, reason: FinishReason | None,
                 events: list[TokenEvent]) -> FinishReason | None:
        """r's new token (already appended to its output): its text delta, or its final event.
        `reason` is the scheduler's finish, if any; returns the finish, a stop string's included."""
        p, stream = r.params, self.streams[r.key]
        if stream.detok is not None:
            piece = stream.detok.add([token])  # always: keeps the detokenizer's window aligned
            if reason is not FinishReason.STOP:  # a stop token's text is never shown
                stream.text += piece
        cut = _find_stop(stream.text, p.stop, stream.emitted)
        if cut is not None:
            stream.text = stream.text[:cut]
            reason = FinishReason.STOP
        queue_s = None
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
            queue_s = (r.first_scheduled_time or r.first_token_time) - r.arrival_time
        if reason is not None:
            self.close(r, reason, events, new_tokens=(token,), logprobs=logprobs, queue_s=queue_s)
            return reason
        safe = len(stream.text) - _held_back(stream.text, p.stop)
        delta, stream.emitted = stream.text[stream.emitted:safe], max(stream.emitted, safe)
        _emit(TokenEvent(r.request_id, (token,), delta, False, None, logprobs, len(r.prompt_ids),
                         len(r.output_ids), queue_s=queue_s, num_cached_tokens=r.num_cached_tokens,
                         index=r.sample_index), stream, events, self._undelivered)
        return None

    def close(self, r: Request, reason: FinishReason, events: list[TokenEvent], new_tokens=(), logprobs=None,
              error: str | None = None, queue_s: float | None = None) -> None:
        """r's final event: the text still held back (up to any stop string) and the finish reason."""
        stream = self.streams.pop(r.key)
        if stream.detok is not None and reason is not FinishReason.STOP:
            stream.text += stream.detok.flush()  # a character cut off by the end is not dropped
        _emit(TokenEvent(r.request_id, tuple(new_tokens), stream.text[stream.emitted:], True, reason, logprobs,
                         len(r.prompt_ids), len(r.output_ids), error, queue_s,
                         num_cached_tokens=r.num_cached_tokens, index=r.sample_index), stream, events, self._undelivered)


def _emit(event: TokenEvent, stream: OutputStream, events: list[TokenEvent], undelivered: list) -> None:
    events.append(event)
    if stream.callback is not None:
        undelivered.append((stream.callback, event))


def _find_stop(text: str, stops: tuple[str, ...], emitted: int) -> int | None:
    """Index where the earliest stop string starts (searching only where a new match can be)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, emitted - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that could still grow into a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold
