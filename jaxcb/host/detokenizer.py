"""Output text from a stream of ids: `IncrementalDetokenizer` turns each sample's new token ids into text
deltas that never split a character spanning several tokens (jaxcb.host.output keeps one per request).

Plain Python, no JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxcb.host.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Text deltas for a growing id list, holding back the bytes of an unfinished character.

    Each call decodes a short window of earlier ids plus the new ones and emits only what the new
    ones add (byte-level merges at the window edge then decode as they do in the whole text); while
    the text ends in U+FFFD, a character split across tokens, nothing is emitted yet.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tok = tokenizer
        self.skip_special = skip_special  # special tokens left out of the text (else their text is shown)
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decoding window
        self.read_offset = 0  # ids before this have been emitted as text
        self.text = ""

    def flush(self) -> str:
        """At the end of the stream: the text still held back (an unfinished character comes out as
        U+FFFD rather than being dropped)."""
        decode = self.tok._tok.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        after = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""

    def add(self, new_ids) -> str:
        self.ids.extend(map(int, new_ids))
        decode = self.tok._tok.decode  # the tokenizers library's own: this runs once per generated token
        before = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        after = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
