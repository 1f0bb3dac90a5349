"""The KV block index: pure prefix counting, and the Redis sets against a real Valkey server."""

from __future__ import annotations

import uuid

from fleet_store.kv_index import (
    TIER2,
    KVIndex,
    block_key,
    cached_prefix_blocks,
    leading_run,
    tokens_by_holder,
)


def test_only_an_unbroken_leading_run_counts() -> None:
    holders = [{"w1", TIER2}, {"w1", TIER2}, {TIER2}, {"w1"}]
    assert leading_run(holders, "w1") == 2
    assert cached_prefix_blocks(holders) == {"w1": 2, TIER2: 3}
    assert tokens_by_holder({"w1": 2}, 256) == {"w1": 512}
    assert cached_prefix_blocks([]) == {}


async def test_index_round_trip_on_valkey(redis_server) -> None:
    index = KVIndex.from_url(redis_server.url, ttl_s=60)
    fingerprint = uuid.uuid4().hex
    try:
        await index.add(fingerprint, ["h1", "h2"], "w1")
        await index.add(fingerprint, ["h1"], TIER2)
        assert await index.holders(fingerprint, ["h1", "h2", "h3"]) == [{"w1", TIER2}, {"w1"}, set()]
        await index.remove(fingerprint, ["h1"], "w1")
        assert await index.holders(fingerprint, ["h1"]) == [{TIER2}]
        ttl = await index._redis.ttl(block_key(fingerprint, "h2"))
        assert 0 < ttl <= 60
        summary = await index.summary()
        assert summary["blocks"] >= 2 and summary[TIER2] >= 1
    finally:
        await index.close()


async def test_prefix_blocks_folds_the_holders_in_redis(redis_server) -> None:
    """The Lua script answers as cached_prefix_blocks over holders(): gaps, members joining late,
    blocks nobody holds; and again after Redis forgot the script (EVALSHA falls back to loading it)."""
    index = KVIndex.from_url(redis_server.url, ttl_s=60)
    fingerprint = uuid.uuid4().hex
    hashes = [f"h{i}" for i in range(6)]
    try:
        await index.add(fingerprint, hashes[:4], "w1")
        await index.add(fingerprint, hashes[:2], TIER2)
        await index.add(fingerprint, hashes[1:5], "w2")  # not on the first block: no leading run
        await index.add(fingerprint, [hashes[5]], "w1")  # after w1's gap: not counted
        expected = cached_prefix_blocks(await index.holders(fingerprint, hashes))
        assert expected == {"w1": 4, TIER2: 2}
        assert await index.prefix_blocks(fingerprint, hashes) == expected
        assert await index.prefix_blocks(fingerprint, hashes[:1]) == {"w1": 1, TIER2: 1}
        assert await index.prefix_blocks(fingerprint, ["nobody", *hashes]) == {}
        assert await index.prefix_blocks(fingerprint, []) == {}
        await index._redis.script_flush()
        assert await index.prefix_blocks(fingerprint, hashes) == expected
    finally:
        await index.close()
