"""How often something that failed is tried again: a budget of attempts within a sliding window."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """At most `max_restarts` within `window_s`; a failure beyond that is left failed (a crash loop would
    only hide the reason). Used for a crashed engine (the worker) and a failed pipeline (the scheduler)."""

    max_restarts: int = 3
    window_s: float = 600.0

    def allows(self, restarts: Sequence[float], now: float) -> bool:
        """`restarts`: earlier restart times of the same thing (monotonic)."""
        return len([t for t in restarts if now - t < self.window_s]) < self.max_restarts
