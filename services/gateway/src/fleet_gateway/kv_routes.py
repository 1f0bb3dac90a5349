"""GET /kv: the shared KV cache at a glance (blocks per tier from the Redis index, per-node tier
traffic from the nodes' metrics)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from aiohttp import web

from fleet_bus import error_text
from fleet_proto import NodeMetrics
from fleet_store.kv_index import TIER2, KVIndex

INDEX_TIMEOUT_S = 2.0


def kv_view(
    block_size: int, summary: dict[str, int] | None, error: str, nodes: Iterable[NodeMetrics]
) -> dict:
    """Pure: the /kv body."""
    per_node = {
        n.node_id: {
            "memory_blocks": n.kv_memory_blocks,
            "fetched_blocks": n.kv_fetched_blocks,
            "fetched_bytes": n.kv_fetched_bytes,
            "uploaded_blocks": n.kv_uploaded_blocks,
            "uploaded_bytes": n.kv_uploaded_bytes,
        }
        for n in sorted(nodes, key=lambda n: n.node_id)
    }
    index: dict[str, object] = {"available": summary is not None}
    if summary is not None:
        index |= {
            "blocks": summary.get("blocks", 0),
            "object_storage_blocks": summary.get(TIER2, 0),
            "memory_blocks_by_node": {k: v for k, v in summary.items() if k not in ("blocks", TIER2)},
        }
    else:
        index["error"] = error
    return {"block_size": block_size, "index": index, "nodes": per_node}


def kv_routes(
    index: KVIndex, block_size: int, nodes: Callable[[], Iterable[NodeMetrics]]
) -> list[web.RouteDef]:
    async def get_kv(_: web.Request) -> web.Response:
        summary, error = None, ""
        try:
            summary = await asyncio.wait_for(index.summary(), INDEX_TIMEOUT_S)
        except Exception as exc:  # the index is advisory: say why it is missing, serve the rest
            error = f"KV index (Redis) unavailable: {error_text(exc)}"
        return web.json_response(kv_view(block_size, summary, error, nodes()))

    return [web.get("/kv", get_kv)]
