"""Splitting streamed text at a pair of tags, holding back any tail that could be a tag's start."""

from __future__ import annotations

from dataclasses import dataclass, field

OUTSIDE, INSIDE, ENTER, EXIT = "outside", "inside", "enter", "exit"


def partial_tag_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass
class TagSplitter:
    """Pieces of a stream between `open_tag` and `close_tag`: (OUTSIDE | INSIDE, text), and ENTER /
    EXIT marks where a tag was. A tag cut across pushes is held back until it is whole (or flushed)."""

    open_tag: str
    close_tag: str
    inside: bool = False
    _buffer: str = field(default="", repr=False)

    def push(self, text: str) -> list[tuple[str, str]]:
        self._buffer += text
        pieces: list[tuple[str, str]] = []
        while True:
            tag = self.close_tag if self.inside else self.open_tag
            kind = INSIDE if self.inside else OUTSIDE
            at = self._buffer.find(tag)
            if at < 0:
                keep = partial_tag_suffix(self._buffer, tag)
                ready, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
                if ready:
                    pieces.append((kind, ready))
                return pieces
            if at:
                pieces.append((kind, self._buffer[:at]))
            pieces.append((EXIT if self.inside else ENTER, ""))
            self._buffer = self._buffer[at + len(tag) :]
            self.inside = not self.inside

    def flush(self) -> list[tuple[str, str]]:
        """What is held back, as text of the current side (the stream ended)."""
        rest, self._buffer = self._buffer, ""
        return [(INSIDE if self.inside else OUTSIDE, rest)] if rest else []
