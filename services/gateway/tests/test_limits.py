"""Per-caller limits: the concurrency count (pure) and the token bucket on a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from fleet_gateway.errors import ApiError
from fleet_gateway.limits import RateLimiter, StreamLimiter
from fleet_gateway.sampling import RequestLimits, SamplingAsk, to_sampling
from fleet_local.servers import ServerHandle


def test_a_caller_holds_at_most_limit_slots_and_gets_them_back():
    limiter = StreamLimiter(2)
    with limiter.slot("a"), limiter.slot("a"):
        with pytest.raises(ApiError) as refused, limiter.slot("a"):
            pass
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
        with limiter.slot("b"):  # another caller has its own count
            assert limiter.active("b") == 1
    assert limiter.active("a") == 0
    with pytest.raises(RuntimeError), limiter.slot("a"):  # a failing request frees its slot too
        raise RuntimeError("boom")
    assert limiter.active("a") == 0


def test_no_limit_means_unlimited():
    limiter = StreamLimiter(0)
    with limiter.slot("a"), limiter.slot("a"), limiter.slot("a"):
        assert limiter.active("a") == 3


async def test_the_token_bucket_allows_bursts_then_refills_at_the_rate(redis_server: ServerHandle):
    client = aioredis.from_url(redis_server.url)
    try:
        limiter = RateLimiter(client, rate=5.0, burst=3)
        caller = f"test-{id(limiter)}"
        for _ in range(3):
            await limiter.check(caller)
        with pytest.raises(ApiError) as refused:
            await limiter.check(caller)
        assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
        assert int(refused.value.headers["Retry-After"]) >= 1
        await limiter.check("someone-else")  # buckets are per caller
        await asyncio.sleep(0.25)  # 5/s: one token back after 0.2 s
        await limiter.check(caller)
        with pytest.raises(ApiError):
            await limiter.check(caller)
    finally:
        await client.aclose()


async def test_rate_limiting_fails_open_when_redis_is_unreachable():
    from fleet_local.processes import free_port

    client = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    try:
        limiter = RateLimiter(client, rate=1.0, burst=1)
        for _ in range(3):
            await limiter.check("anyone")  # nothing refused: a dead index must not be an outage
    finally:
        await client.aclose()


def test_operator_limits_are_400_naming_the_limit_and_the_context():
    limits = RequestLimits(max_prompt_tokens=100, max_completion_tokens=50)
    with pytest.raises(ApiError) as long_prompt:
        to_sampling(SamplingAsk(), [2], 2048, 101, limits)
    assert long_prompt.value.status == 400 and long_prompt.value.code == "prompt_too_long"
    assert "at most 100 prompt tokens" in long_prompt.value.message and "2048" in long_prompt.value.message
    with pytest.raises(ApiError) as greedy:
        to_sampling(
            SamplingAsk(max_tokens=51, max_tokens_param="max_completion_tokens"), [2], 2048, 10, limits
        )
    assert greedy.value.param == "max_completion_tokens" and "at most 50 tokens" in greedy.value.message
    assert to_sampling(SamplingAsk(), [2], 2048, 10, limits).max_tokens == 50  # the default is capped
    assert to_sampling(SamplingAsk(max_tokens=50), [2], 2048, 100, limits).max_tokens == 50


def test_embeddings_are_limited_like_generation():
    from fleet_gateway.limits import ENGINE_PATHS

    assert {"/v1/embeddings", "/api/embed", "/api/embeddings", "/v1/chat/completions"} <= ENGINE_PATHS
    assert "/v1/models" not in ENGINE_PATHS
