"""Bounded recent time series of node metrics in Redis: one list per node and metric (written by the
metrics-collector, read by it and by the gateway's dashboard).

Each list holds "<ts> <value>" entries, oldest first, trimmed to the last `MAX_POINTS` and expiring
`TTL_S` after the last write, so a node that is gone stops costing memory. Keys and encoding are pure
helpers; `record` and `read` are the only I/O.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

import redis.asyncio as aioredis

from fleet_proto import NodeMetrics

KEY_PREFIX = "fleet:series"
MAX_POINTS = 3600  # 1 h at 1 Hz
TTL_S = 2 * 3600
MAX_WINDOW_S = 24 * 3600.0
DEFAULT_WINDOW_S = 300.0

# metric name -> how to read it from a NodeMetrics sample
METRICS: dict[str, Callable[[NodeMetrics], float]] = {
    "memory_used_bytes": lambda s: s.memory_used_bytes,
    "memory_available_bytes": lambda s: s.memory_available_bytes,
    "cpu_percent": lambda s: s.cpu_percent,
    "disk_free_bytes": lambda s: s.disk_free_bytes,
    "active_requests": lambda s: sum(s.active_requests.values()),
    "running_tokens": lambda s: sum(s.running_tokens.values()),
    "queued_tokens": lambda s: sum(s.queued_tokens.values()),
}


def series_key(node_id: str, metric: str) -> str:
    return f"{KEY_PREFIX}:{node_id}:{metric}"


def encode_point(ts: float, value: float) -> str:
    return f"{ts:.3f} {value!r}"


def decode_point(raw: bytes | str) -> tuple[float, float] | None:
    text = raw.decode() if isinstance(raw, bytes) else raw
    try:
        ts, value = text.split(" ", 1)
        return float(ts), float(value)
    except ValueError:
        return None


def sample_points(sample: NodeMetrics) -> dict[str, float]:
    """Every tracked metric of one sample, as numbers."""
    return {name: float(get(sample)) for name, get in METRICS.items()}


def in_window(points: list[tuple[float, float]], window_s: float, now: float) -> list[tuple[float, float]]:
    start = now - window_s
    return [p for p in points if p[0] >= start]


async def record(
    redis: aioredis.Redis,
    node_id: str,
    sample: NodeMetrics,
    *,
    max_points: int = MAX_POINTS,
    ttl_s: int = TTL_S,
) -> None:
    """Append the sample (at its own timestamp) to each metric's list, trim it and renew its expiry."""
    pipe = redis.pipeline(transaction=False)
    for metric, value in sample_points(sample).items():
        key = series_key(node_id, metric)
        pipe.rpush(key, encode_point(sample.at, value))
        pipe.ltrim(key, -max_points, -1)
        pipe.expire(key, ttl_s)
    await pipe.execute()


async def read(
    redis: aioredis.Redis, node_id: str, metric: str, window_s: float, *, now: float | None = None
) -> list[tuple[float, float]]:
    """Points of the last `window_s` seconds (relative to `now`, default the local clock), oldest first."""
    raw = await redis.lrange(series_key(node_id, metric), 0, -1)
    points = [p for p in map(decode_point, raw) if p is not None]
    return in_window(points, window_s, time.time() if now is None else now)


class BadQuery(ValueError):
    pass


def parse_series_query(query: Mapping[str, str]) -> tuple[str, float]:
    """(metric, window_s) from `?metric=...&window=...`; BadQuery says what is wrong."""
    metric = query.get("metric", "")
    if metric not in METRICS:
        raise BadQuery(f"unknown metric {metric!r}; one of: {', '.join(sorted(METRICS))}")
    raw = query.get("window")
    if raw is None:
        return metric, DEFAULT_WINDOW_S
    try:
        window = float(raw)
    except ValueError:
        raise BadQuery(f"bad window {raw!r}: seconds expected") from None
    if not math.isfinite(window) or window <= 0 or window > MAX_WINDOW_S:
        raise BadQuery(f"bad window {raw!r}: must be in (0, {MAX_WINDOW_S:g}] seconds")
    return metric, window
