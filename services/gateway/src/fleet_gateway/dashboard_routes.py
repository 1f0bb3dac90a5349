"""The dashboard: the page at GET /, its assets at /ui/<file> (shipped in the package, no build
step, no CDN), each node's latest metrics sample, and the node time series it plots (the
metrics-collector's, read from Redis)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import msgspec
import redis.asyncio as aioredis
from aiohttp import web

from fleet_bus import StateFollower
from fleet_gateway.errors import ApiError
from fleet_proto import NodeMetrics
from fleet_store import series

ASSETS = Path(__file__).with_name("dashboard")
SERIES_TIMEOUT_S = 2.0
CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}


def asset(name: str) -> web.FileResponse:
    """One shipped file by plain name (no paths: nothing outside the folder is reachable)."""
    path = ASSETS / name
    if "/" in name or name.startswith(".") or path.suffix not in CONTENT_TYPES or not path.is_file():
        raise ApiError(404, f"no dashboard file {name!r}")
    headers = {"Content-Type": f"{CONTENT_TYPES[path.suffix]}; charset=utf-8", "Cache-Control": "no-cache"}
    return web.FileResponse(path, headers=headers)


def dashboard_routes(
    follower: StateFollower, redis: aioredis.Redis, live_samples: Callable[[], list[NodeMetrics]]
) -> list[web.RouteDef]:
    async def index(_: web.Request) -> web.FileResponse:
        return asset("index.html")

    async def ui(request: web.Request) -> web.FileResponse:
        return asset(request.match_info["name"])

    async def live(_: web.Request) -> web.Response:
        """The latest metrics sample of every live node (memory, CPU, GPUs, load), by node id."""
        samples = {sample.node_id: sample for sample in live_samples()}
        return web.Response(body=msgspec.json.encode(samples), content_type="application/json")

    async def metrics(_: web.Request) -> web.Response:
        return web.json_response({"metrics": series.SERIES})

    async def node_series(request: web.Request) -> web.Response:
        node_id = request.query.get("node", "")
        if node_id not in follower.state.nodes:
            raise ApiError(404, f"unknown node {node_id!r}", param="node")
        try:
            metric, window_s = series.parse_series_query(request.query)
        except series.BadQuery as exc:
            raise ApiError(400, str(exc), param="metric") from None
        try:  # bounded: a Redis that hangs must not hang the dashboard
            points = await asyncio.wait_for(series.read(redis, node_id, metric, window_s), SERIES_TIMEOUT_S)
        except (aioredis.RedisError, OSError) as exc:  # TimeoutError included
            reason = str(exc) or f"no answer within {SERIES_TIMEOUT_S:g} s"
            raise ApiError(503, f"the metrics store (Redis) is unavailable: {reason}") from None
        return web.json_response([[ts, value] for ts, value in points])

    return [
        web.get("/", index),
        web.get("/ui/{name}", ui),
        web.get("/dashboard/live", live),
        web.get("/dashboard/metrics", metrics),
        web.get("/dashboard/series", node_series),
    ]
