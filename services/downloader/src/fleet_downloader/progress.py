"""Progress reporting: the callback type staging calls, and the rate limit on progress events."""

from __future__ import annotations

from collections.abc import Callable

from fleet_proto import DownloadPhase

StageProgress = Callable[[DownloadPhase, int, int], None]
"""Called with (phase, done_bytes, total_bytes) as staging moves; may be called from any thread."""

MIN_INTERVAL_S = 0.5


class Throttle:
    """Decides which progress updates become events: a phase change always, else one per interval.

    Pure (the caller passes the clock), so it is tested without sleeping.
    """

    def __init__(self, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.min_interval_s = min_interval_s
        self._phase: DownloadPhase | None = None
        self._last_at = 0.0

    def allow(self, phase: DownloadPhase, now: float) -> bool:
        if phase != self._phase or now - self._last_at >= self.min_interval_s:
            self._phase, self._last_at = phase, now
            return True
        return False
