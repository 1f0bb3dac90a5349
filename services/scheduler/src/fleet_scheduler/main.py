"""Scheduler service: the cluster's only decision maker (placement and routing arrive with issue 3/4).

For now it keeps State from the event stream and holds the Redis connection the KV index will use.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from fleet_proto import ServiceKind
from fleet_runtime.service import ServiceContext, run


async def main(ctx: ServiceContext) -> None:
    client = aioredis.from_url(ctx.settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
    await client.ping()  # fail at start, with the URL in the error, rather than later

    async def check_redis() -> None:
        await client.ping()

    ctx.health_checks["redis"] = check_redis
    ctx.on_shutdown(client.aclose)


def cli() -> None:
    run(ServiceKind.SCHEDULER, main)
