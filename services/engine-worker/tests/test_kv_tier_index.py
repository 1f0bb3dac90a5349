"""WorkerKV keeps the Redis KV index true across a Redis outage: a Redis of the test's own is killed
(SIGKILL, by PID) while an engine reports blocks, then restarted empty; the worker writes what it
holds again, and only that (blocks evicted meanwhile leave the index)."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path

import pytest

from fleet_local.processes import pid_alive
from fleet_local.servers import restart, start_redis
from fleet_store import ObjectStore
from fleet_store.kv import KVFolder
from fleet_store.kv_index import TIER2, KVIndex
from fleet_worker.engines.base import KVChanges
from fleet_worker.kv_tier import WorkerKV


@pytest.fixture
def own_redis(tmp_path: Path):
    """A Redis of the test's own: killed within its first 60 s it has saved nothing (`--save 60 1`),
    so a restart comes back empty (the worst case)."""
    handle = start_redis(tmp_path / "redis")
    yield handle
    handle.stop()


async def holders(url: str, fingerprint: str, hashes: list[str]) -> list[set[str]]:
    """Read the index on a fresh connection (a pooled one would fail once after a Redis restart)."""
    index = KVIndex.from_url(url)
    try:
        return await index.holders(fingerprint, hashes)
    finally:
        await index.close()


async def settled(kv: WorkerKV) -> None:
    """Let the background index writes of on_engine_changes finish."""
    for _ in range(50):
        if not kv._uploads:
            return
        await asyncio.sleep(0.02)


async def test_the_index_is_rewritten_once_redis_is_back(own_redis, tmp_path: Path) -> None:
    fingerprint = uuid.uuid4().hex
    store = ObjectStore("127.0.0.1:9")  # never called: no block is written to the folder
    kv = WorkerKV("w1", store, KVIndex.from_url(own_redis.url), KVFolder(tmp_path / "kv"))
    try:
        assert await kv.resync_index()  # a fresh worker marks its entries as present
        kv.on_engine_changes(fingerprint, KVChanges(in_memory=("a", "b")))
        await settled(kv)
        assert await holders(own_redis.url, fingerprint, ["a", "b"]) == [{"w1"}, {"w1"}]

        os.killpg(own_redis.pid, signal.SIGKILL)
        while pid_alive(own_redis.pid, own_redis.started_at):
            await asyncio.sleep(0.02)
        kv.on_engine_changes(fingerprint, KVChanges(in_memory=("c",), evicted=("a",)))
        await settled(kv)
        assert not await kv.resync_index()  # Redis is down: still stale, and no exception

        back = restart(own_redis)
        own_redis.pid, own_redis.started_at = back.pid, back.started_at
        assert await holders(own_redis.url, fingerprint, ["a", "b", "c"]) == [set(), set(), set()]  # empty
        assert await kv.resync_index()
        assert await holders(own_redis.url, fingerprint, ["a", "b", "c"]) == [set(), {"w1"}, {"w1"}]
        assert await kv.resync_index()  # in sync now: one EXISTS, nothing rewritten
    finally:
        await kv.close()
        store.close()


async def test_a_redis_restarted_empty_is_noticed_without_a_failed_write(own_redis, tmp_path: Path) -> None:
    """No index write failed (the worker was idle during the outage): the missing node marker tells."""
    fingerprint = uuid.uuid4().hex
    store = ObjectStore("127.0.0.1:9")
    kv = WorkerKV("w2", store, KVIndex.from_url(own_redis.url), KVFolder(tmp_path / "kv"))
    reader = KVIndex.from_url(own_redis.url)
    try:
        kv.on_engine_changes(fingerprint, KVChanges(in_memory=("x",)))
        await settled(kv)
        assert await kv.resync_index()
        await reader._redis.flushall()  # what a restart without persistence leaves
        keeper = asyncio.create_task(kv.keep_index(interval_s=0.05))
        try:
            for _ in range(100):
                if await reader.holders(fingerprint, ["x"]) == [{"w2"}]:
                    break
                await asyncio.sleep(0.02)
            assert await reader.holders(fingerprint, ["x"]) == [{"w2"}]
        finally:
            keeper.cancel()
        assert (await reader.summary()).get(TIER2, 0) == 0 and (await reader.summary())["blocks"] == 1
    finally:
        await kv.close()
        await reader.close()
        store.close()
