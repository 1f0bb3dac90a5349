"""Incremental detokenization: text deltas from a growing token stream.

The prefix-offset method (as in TGI and vLLM): decode a short window that ends at the new tokens,
and diff it against the same window without them. Decoding a window rather than the whole text keeps
each step cheap; starting the window at an emitted boundary keeps the result equal to decoding all
tokens at once. Text is held back while it ends in U+FFFD, i.e. in the middle of a UTF-8 character
whose bytes are spread over several byte-level tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """A `tokenizers.Tokenizer` or a `ChatTokenizer`."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """One per request: push() token ids as they arrive, flush() at the end. Special tokens give no text."""

    def __init__(self, tokenizer: Decoder, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window: the previous emitted boundary
        self._read_offset = 0  # tokens before this have been emitted

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""

    def _delta(self, *, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            return ""  # maybe an unfinished character: wait for its next bytes
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def push(self, token_ids: Iterable[int]) -> str:
        """Add tokens; the newly completed text (possibly empty)."""
        before = len(self._ids)
        self._ids.extend(token_ids)
        if len(self._ids) == before:
            return ""
        return self._delta(final=False)

    def flush(self) -> str:
        """At the end of the stream: text still held back (an incomplete character decodes as U+FFFD)."""
        return self._delta(final=True)
