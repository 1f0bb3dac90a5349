"""Pure helpers of the HTTP API: query validation and the /api/nodes view."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from fleet_proto import NodeMetrics


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
