"""Pure helpers of the HTTP API: query validation and the /api/nodes view."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

from fleet_metrics.series import MAX_WINDOW_S, METRICS
from fleet_proto import NodeMetrics

DEFAULT_WINDOW_S = 300.0


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


def nodes_view(live: Mapping[str, Any], latest: Mapping[str, NodeMetrics]) -> list[dict[str, Any]]:
    """The live nodes (State's NodeInfo by id), each with its latest metrics sample or None."""
    return [
        {
            "node_id": node_id,
            "info": msgspec.to_builtins(info),
            "metrics": msgspec.to_builtins(latest[node_id]) if node_id in latest else None,
        }
        for node_id, info in sorted(live.items())
    ]
