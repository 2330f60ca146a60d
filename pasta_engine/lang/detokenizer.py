"""Incremental detokenization: token ids in, text deltas out (one per token)."""

from __future__ import annotations

from typing import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one delta per pushed token.

    Byte-level BPE tokens can end in the middle of a UTF-8 character and SentencePiece drops a
    leading space when a slice is decoded alone, so each delta is the difference between
    decoding a short window of recent ids with and without the new ones (the scheme of vLLM's
    ``detokenize_incrementally``). A token that ends inside a character yields ``""`` and its
    text arrives with a later token; :meth:`flush` returns what is still held back.

    Args:
        decode: ``ids -> str``; special tokens must be decoded to their text.
    """

    def __init__(self, decode: Decode):
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this have been emitted

    def push(self, token_id: int) -> str:
        """Append one token id; return the text it completes (possibly empty)."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text of ids not yet emitted (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]
