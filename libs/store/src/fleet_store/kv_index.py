"""The KV block index in Redis: which workers hold a block in memory, and whether object storage has it.

One Redis set per block, `fleet:kv:<fingerprint>:<block_hash>`, whose members are node ids (tier 1:
that worker's engine memory) and `TIER2` (the blob is in `fleet-kv/<fingerprint>/<block_hash>`).
Every write refreshes the key's TTL, so blocks nobody touches age out; a deployment bounds the
index's size with Redis' maxmemory / allkeys-lru. Routing's lookup (`prefix_blocks`) is one Lua
script run in Redis, which walks a prompt's blocks in order and stops where no holder's run goes on:
one round trip whose reply is a few (member, blocks) pairs, however long the prompt. `holders`
(one SMEMBERS per block, in a pipeline) gives every block's holders, gaps included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

TIER2 = "s3"
KEY_PREFIX = "fleet:kv:"
DEFAULT_TTL_S = 24 * 3600
# One key per worker saying "this node's entries are in the index": a Redis restarted empty (or
# flushed) has lost it, which tells the worker to write what it holds again. Outside KEY_PREFIX, so
# summary() does not count it as a block.
NODE_MARKER_PREFIX = "fleet:kv-node:"
# KEYS: a prompt's block keys in order. Returns {member, blocks, ...}: cached_prefix_blocks over the
# blocks' sets, computed where they are. Only members of the first block can have a leading run, so
# later blocks are asked about those still running (SMISMEMBER), and the walk ends once none is.
# Every key in one script must live on one Redis node (no Redis Cluster slots across blocks).
PREFIX_BLOCKS_LUA = """
local first = redis.call('SMEMBERS', KEYS[1])
local running, runs = first, {}
for _, member in ipairs(first) do runs[member] = 1 end
for i = 2, #KEYS do
  if #running == 0 then break end
  local held, still = redis.call('SMISMEMBER', KEYS[i], unpack(running)), {}
  for j, member in ipairs(running) do
    if held[j] == 1 then
      runs[member] = i
      still[#still + 1] = member
    end
  end
  running = still
end
local reply = {}
for _, member in ipairs(first) do
  reply[#reply + 1] = member
  reply[#reply + 1] = runs[member]
end
return reply
"""


def block_key(fingerprint: str, block_hash: str) -> str:
    return f"{KEY_PREFIX}{fingerprint}:{block_hash}"


def node_marker_key(node_id: str) -> str:
    return f"{NODE_MARKER_PREFIX}{node_id}"


def object_key(fingerprint: str, block_hash: str) -> str:
    """The block's blob in the KV bucket."""
    return f"{fingerprint}/{block_hash}"


def leading_run(holders: Sequence[set[str]], member: str) -> int:
    """How many blocks, from the first, `member` holds without a gap (a prefix is only usable whole)."""
    count = 0
    for held_by in holders:
        if member not in held_by:
            break
        count += 1
    return count


def cached_prefix_blocks(holders: Sequence[set[str]]) -> dict[str, int]:
    """Per holder (node ids and TIER2): the leading blocks of the prompt it holds."""
    members = set().union(*holders) if holders else set()
    return {member: run for member in members if (run := leading_run(holders, member))}


class KVIndex:
    def __init__(self, client: aioredis.Redis, ttl_s: int = DEFAULT_TTL_S) -> None:
        self._redis = client
        self._ttl_s = ttl_s
        self._prefix_script: AsyncScript | None = None  # PREFIX_BLOCKS_LUA, registered on first use

    @classmethod
    def from_url(cls, url: str, ttl_s: int = DEFAULT_TTL_S) -> KVIndex:
        return cls(aioredis.from_url(url, socket_connect_timeout=2, socket_timeout=2), ttl_s)

    async def add(self, fingerprint: str, hashes: Sequence[str], member: str) -> None:
        if not hashes:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for block_hash in hashes:
                key = block_key(fingerprint, block_hash)
                pipe.sadd(key, member)
                pipe.expire(key, self._ttl_s)
            await pipe.execute()

    async def remove(self, fingerprint: str, hashes: Sequence[str], member: str) -> None:
        if not hashes:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for block_hash in hashes:
                pipe.srem(block_key(fingerprint, block_hash), member)
            await pipe.execute()

    async def holders(self, fingerprint: str, hashes: Sequence[str]) -> list[set[str]]:
        if not hashes:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for block_hash in hashes:
                pipe.smembers(block_key(fingerprint, block_hash))
            replies = await pipe.execute()
        return [{m.decode() if isinstance(m, bytes) else m for m in reply} for reply in replies]

    async def prefix_blocks(self, fingerprint: str, hashes: Sequence[str]) -> dict[str, int]:
        """cached_prefix_blocks(holders(...)) in one round trip: per holder (node ids and TIER2), the
        leading blocks of the prompt it holds."""
        if not hashes:
            return {}
        if self._prefix_script is None:  # EVALSHA, and EVAL's load again when Redis lost it
            self._prefix_script = self._redis.register_script(PREFIX_BLOCKS_LUA)
        reply = await self._prefix_script(keys=[block_key(fingerprint, h) for h in hashes])
        pairs = zip(reply[::2], reply[1::2], strict=True)
        return {(m.decode() if isinstance(m, bytes) else m): int(run) for m, run in pairs}

    async def summary(self, limit: int = 100_000) -> dict[str, int]:
        """Blocks indexed per holder (node ids and TIER2), scanning at most `limit` keys."""
        counts: dict[str, int] = {"blocks": 0}
        seen = 0
        async for key in self._redis.scan_iter(match=f"{KEY_PREFIX}*", count=1000):
            seen += 1
            if seen > limit:
                break
            counts["blocks"] += 1
            for member in await self._redis.smembers(key):
                name = member.decode() if isinstance(member, bytes) else member
                counts[name] = counts.get(name, 0) + 1
        return counts

    async def mark_node(self, node_id: str) -> None:
        """Record that `node_id`'s entries are written (expires with the blocks' TTL)."""
        await self._redis.set(node_marker_key(node_id), "1", ex=self._ttl_s)

    async def node_marked(self, node_id: str) -> bool:
        return bool(await self._redis.exists(node_marker_key(node_id)))

    async def close(self) -> None:
        await self._redis.aclose()


def tokens_by_holder(blocks: Mapping[str, int], block_size: int) -> dict[str, int]:
    return {member: count * block_size for member, count in blocks.items()}
