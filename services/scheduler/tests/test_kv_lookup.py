"""The KV index reads of routing: cached prefixes from a real Valkey, and a clear "routed by load
only" when Redis does not answer (a closed port), without raising and within the lookup budget."""

from __future__ import annotations

import time
import uuid

from fleet_local.processes import free_port
from fleet_proto import RouteRequest
from fleet_scheduler.main import KVLookup
from fleet_store.kv_index import TIER2, KVIndex


def request(fingerprint: str, hashes: tuple[str, ...]) -> RouteRequest:
    return RouteRequest(
        request_id="r1", model_id="m", prompt_tokens=700, block_hashes=hashes, kv_fingerprint=fingerprint
    )


async def test_cached_prefixes_come_from_the_index(redis_server) -> None:
    fingerprint = uuid.uuid4().hex
    index = KVIndex.from_url(redis_server.url, ttl_s=60)
    try:
        await index.add(fingerprint, ["h1", "h2"], "w1")
        await index.add(fingerprint, ["h1"], TIER2)
        lookup = KVLookup(index, block_size=256)
        assert await lookup.cached_prefixes(request(fingerprint, ("h1", "h2"))) == ({"w1": 512}, 256, "")
        assert await lookup.cached_prefixes(request("", ())) == ({}, 0, "")  # no hashes: no lookup
        assert not lookup.failing
    finally:
        await index.close()


async def test_without_redis_routing_says_it_went_by_load_only() -> None:
    index = KVIndex.from_url(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    lookup = KVLookup(index, block_size=256)
    try:
        began = time.monotonic()
        cached, tier2, why = await lookup.cached_prefixes(request(uuid.uuid4().hex, ("h1",)))
        assert time.monotonic() - began < 1.0
        assert (cached, tier2) == ({}, 0)
        assert why.startswith("KV index unavailable (") and why.endswith("): routed by load only"), why
        assert lookup.failing
    finally:
        await index.close()
