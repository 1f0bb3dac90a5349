"""The collector's series writer: points reach Redis; a Redis that does not answer costs one failed
call per interval (the batch is dropped, logged once), never an exception, and writes resume."""

from __future__ import annotations

import logging
import time
import uuid

import redis.asyncio as aioredis

from fleet_local.processes import free_port
from fleet_metrics.main import SeriesWriter
from fleet_proto import NodeMetrics
from fleet_store import series


def sample(node_id: str) -> NodeMetrics:
    return NodeMetrics(
        node_id=node_id,
        at=time.time(),
        memory_used_bytes=1,
        memory_available_bytes=2,
        cpu_percent=5.0,
        disk_free_bytes=3,
    )


async def test_points_are_written(redis_server) -> None:
    client = aioredis.from_url(redis_server.url)
    node = f"n-{uuid.uuid4().hex[:8]}"
    try:
        writer = SeriesWriter(client)
        await writer.flush([], {node: sample(node)})
        assert [v for _, v in await series.read(client, node, "cpu_percent", 60)] == [5.0]
        assert not writer.failing
    finally:
        await client.aclose()


async def test_an_unreachable_redis_drops_the_batch_and_logs_once(caplog) -> None:
    dead = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=2)
    writer = SeriesWriter(dead)
    try:
        with caplog.at_level(logging.WARNING, logger="fleet_metrics"):
            for _ in range(3):
                await writer.flush([], {f"n{i}": sample(f"n{i}") for i in range(50)})
        assert writer.failing
        assert len([r for r in caplog.records if "series writes to Redis fail" in r.message]) == 1
    finally:
        await dead.aclose()
