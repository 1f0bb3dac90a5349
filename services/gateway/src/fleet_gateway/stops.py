"""Stop strings over streamed text: emit what can no longer become a stop, cut at the first stop.

The "first" stop is the one that ends first in the text (ties: the one that starts first), because
that is the one a streaming reader sees complete first; this keeps the result independent of how
the text was split into chunks. The stop string itself is not emitted (OpenAI semantics).
"""

from __future__ import annotations

from collections.abc import Iterable


def find_first_stop(text: str, stops: Iterable[str]) -> tuple[int, int] | None:
    """(start, end) of the stop occurrence that ends first in `text` (ties: starts first), or None."""
    best: tuple[int, int] | None = None
    for stop in stops:
        if not stop:
            continue
        start = text.find(stop)
        if start < 0:
            continue
        end = start + len(stop)
        if best is None or (end, start) < (best[1], best[0]):
            best = (start, end)
    return best


def cut_at_first_stop(text: str, stops: Iterable[str]) -> tuple[str, bool]:
    """The whole-text reference: `text` up to the first stop (excluded), and whether one was found."""
    found = find_first_stop(text, stops)
    return (text, False) if found is None else (text[: found[0]], True)


class StopMatcher:
    """Feeds streamed text through stop strings; pure, one per request."""

    def __init__(self, stops: Iterable[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._held = ""
        self._stopped = False
        self.hit: str | None = None  # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """The text now safe to emit, and whether a stop string was hit (then nothing more is emitted)."""
        if self._stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        # Held text never contains a whole stop, and no stop can start before it (it is the
        # longest suffix that is a stop prefix), so searching the buffer is enough.
        found = find_first_stop(buffer, self._stops)
        if found is not None:
            self._stopped = True
            self._held = ""
            self.hit = buffer[found[0] : found[1]]
            return buffer[: found[0]], True
        hold = self._longest_stop_prefix_suffix(buffer)
        cut = len(buffer) - hold
        self._held = buffer[cut:]
        return buffer[:cut], False

    def flush(self) -> str:
        """At the end of generation: the held-back text (it can no longer become a stop)."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
