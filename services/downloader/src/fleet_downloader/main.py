"""Downloader service: owns the object-storage buckets models and KV blobs are staged in.

Fetching and converting models (DownloadModel commands) arrives with issue 3/5.
"""

from __future__ import annotations

import asyncio

from fleet_proto import ServiceKind
from fleet_runtime.service import ServiceContext, run
from fleet_store import ObjectStore, ensure_buckets


async def main(ctx: ServiceContext) -> None:
    store = ObjectStore.from_settings(ctx.settings)
    await asyncio.to_thread(ensure_buckets, store)  # also fails fast on a wrong endpoint or key

    async def check_store() -> None:
        await asyncio.to_thread(store.check)

    ctx.health_checks["s3"] = check_store

    async def close_store() -> None:
        store.close()

    ctx.on_shutdown(close_store)


def cli() -> None:
    run(ServiceKind.DOWNLOADER, main)
