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


class TransferRate:
    """Bytes per second of the current phase, smoothed (exponential moving average); pure."""

    def __init__(self, smoothing: float = 0.3) -> None:
        self.smoothing = smoothing
        self._phase: DownloadPhase | None = None
        self._last: tuple[int, float] | None = None
        self.bytes_per_s = 0.0

    def update(self, phase: DownloadPhase, done: int, now: float) -> float:
        if phase != self._phase or self._last is None or done < self._last[0]:
            self._phase, self._last, self.bytes_per_s = phase, (done, now), 0.0
            return 0.0
        last_done, last_at = self._last
        if now > last_at:
            current = (done - last_done) / (now - last_at)
            self.bytes_per_s = (
                current
                if not self.bytes_per_s
                else (self.smoothing * current + (1 - self.smoothing) * self.bytes_per_s)
            )
            self._last = (done, now)
        return self.bytes_per_s


def eta_seconds(done: int, total: int, bytes_per_s: float) -> float:
    """Seconds left at the current rate; -1 when unknown."""
    if total <= 0 or bytes_per_s <= 0 or done >= total:
        return 0.0 if total > 0 and done >= total else -1.0
    return (total - done) / bytes_per_s
