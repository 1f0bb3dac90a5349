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

from fleet_proto import NodeMetrics, RequestStats
from fleet_proto.messages import EMBED_TASK

KEY_PREFIX = "fleet:series"
MAX_POINTS = 3600  # 1 h at 1 Hz
TTL_S = 2 * 3600
MAX_WINDOW_S = 24 * 3600.0
DEFAULT_WINDOW_S = 300.0


def _gpu_utilization(sample: NodeMetrics) -> float | None:
    reported = [g.utilization_ratio for g in sample.gpus if g.utilization_ratio >= 0]
    return sum(reported) / len(reported) if reported else None


# metric name -> how to read it from a NodeMetrics sample (None: the node does not report it)
METRICS: dict[str, Callable[[NodeMetrics], float | None]] = {
    "memory_used_bytes": lambda s: s.memory_used_bytes,
    "memory_available_bytes": lambda s: s.memory_available_bytes,
    "cpu_percent": lambda s: s.cpu_percent,
    "disk_free_bytes": lambda s: s.disk_free_bytes,
    "active_requests": lambda s: sum(s.active_requests.values()),
    "running_tokens": lambda s: sum(s.running_tokens.values()),
    "queued_tokens": lambda s: sum(s.queued_tokens.values()),
    "gpu_utilization": _gpu_utilization,
}


def _embedding(r: RequestStats) -> bool:
    return r.task == EMBED_TASK


# metric name -> how to read it from a finished request's stats (a point per request, on its node);
# an embedding request has its own (no tokens generated, no prefix cache)
REQUEST_METRICS: dict[str, Callable[[RequestStats], float | None]] = {
    "ttft_s": lambda r: r.ttft_s if r.completion_tokens > 0 and r.ttft_s >= 0 else None,
    "decode_tokens_per_s": lambda r: 1.0 / r.tpot_s if r.completion_tokens > 1 and r.tpot_s > 0 else None,
    "kv_hit_ratio": lambda r: (
        min(r.prefix_cached_tokens, r.prompt_tokens) / r.prompt_tokens
        if r.prompt_tokens > 0 and not _embedding(r)
        else None
    ),
    "embedding_latency_s": lambda r: r.total_s if _embedding(r) and r.total_s >= 0 else None,
    "embedding_inputs_per_s": lambda r: r.inputs / r.total_s if _embedding(r) and r.total_s > 0 else None,
    # a point per request that moved here from a dead or draining instance: how many times it moved
    "migrations": lambda r: float(r.migrations) if r.migrations else None,
}
SERIES = sorted({*METRICS, *REQUEST_METRICS})


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


def _points(readers: Mapping[str, Callable], item) -> dict[str, float]:
    values = {name: read(item) for name, read in readers.items()}
    return {name: float(value) for name, value in values.items() if value is not None}


def sample_points(sample: NodeMetrics) -> dict[str, float]:
    """Every tracked metric the sample reports, as numbers."""
    return _points(METRICS, sample)


def request_points(stats: RequestStats) -> dict[str, float]:
    """Every request metric the stats allow (no TTFT without a token, no rate without two)."""
    return _points(REQUEST_METRICS, stats)


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
    await _append(redis, node_id, sample.at, sample_points(sample), max_points, ttl_s)


async def record_request(
    redis: aioredis.Redis,
    stats: RequestStats,
    at: float,
    *,
    max_points: int = MAX_POINTS,
    ttl_s: int = TTL_S,
) -> None:
    """Append a finished request's points (at `at`, when it finished) to its node's lists."""
    await _append(redis, stats.node_id, at, request_points(stats), max_points, ttl_s)


async def _append(
    redis: aioredis.Redis, node_id: str, at: float, points: dict[str, float], max_points: int, ttl_s: int
) -> None:
    pipe = redis.pipeline(transaction=False)
    for metric, value in points.items():
        key = series_key(node_id, metric)
        pipe.rpush(key, encode_point(at, value))
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
    if metric not in SERIES:
        raise BadQuery(f"unknown metric {metric!r}; one of: {', '.join(SERIES)}")
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
