"""Per-caller limits on generation requests: concurrent generations (in this gateway) and a request
rate (a token bucket in Redis, shared by every gateway replica). Both answer 429 with Retry-After.

The rate limit fails open: with Redis unreachable a request is let through and a warning logged (at
most every 30 s), because refusing every request over a dead index would turn a degraded KV cache
into an outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import RedisError

from fleet_bus import error_text
from fleet_gateway.admission import CALLER
from fleet_gateway.auth import IDENTITY
from fleet_gateway.errors import ApiError, Handler

log = logging.getLogger("fleet_gateway.limits")

ENGINE_PATHS = frozenset(  # the requests that take an engine's time: generation and embeddings
    {
        "/v1/embeddings",
        "/api/embed",
        "/api/embeddings",
        "/ollama/api/embed",
        "/ollama/api/embeddings",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/bench/chat/completions",
        "/api/chat",
        "/api/generate",
        "/ollama/api/chat",
        "/ollama/api/generate",
    }
)
RATE_KEY_PREFIX = "fleet:rate:"
WARN_EVERY_S = 30.0

# One atomic step of a token bucket, on Redis' clock (so every replica agrees): refill by the time
# since the last request, take a token if there is one. Returns {allowed, seconds to wait}.
TOKEN_BUCKET = """
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local saved = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(saved[1]) or burst
local at = tonumber(saved[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local allowed, wait = 0, (1 - tokens) / rate
if tokens >= 1 then
  tokens, allowed, wait = tokens - 1, 1, 0
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, tostring(wait)}
"""


class StreamLimiter:
    """Generations in flight per caller, in this process."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._active: dict[str, int] = {}

    def active(self, caller: str) -> int:
        return self._active.get(caller, 0)

    @contextlib.contextmanager
    def slot(self, caller: str) -> Iterator[None]:
        if self.limit and self.active(caller) >= self.limit:
            raise ApiError(
                429,
                f"Too many concurrent requests for this key: at most {self.limit} at a time.",
                code="concurrency_limit",
                headers={"Retry-After": "1"},
            )
        self._active[caller] = self.active(caller) + 1
        try:
            yield
        finally:
            left = self._active[caller] - 1
            if left:
                self._active[caller] = left
            else:
                del self._active[caller]


class RateLimiter:
    """A token bucket per caller in Redis: `rate` requests per second, bursts of `burst`."""

    def __init__(self, redis: aioredis.Redis | None, rate: float, burst: int, timeout_s: float = 0.5) -> None:
        self.rate = rate
        self._timeout_s = timeout_s  # longer than this, Redis counts as unreachable (fail open)
        self.burst = max(burst, 1) if burst else max(int(rate), 1)
        self._redis = redis
        self._script = redis.register_script(TOKEN_BUCKET) if redis is not None and rate > 0 else None
        self._warned_at = -WARN_EVERY_S

    async def check(self, caller: str) -> None:
        """ApiError 429 when the caller's bucket is empty."""
        if self._script is None:
            return
        try:
            allowed, wait = await asyncio.wait_for(
                self._script(keys=[RATE_KEY_PREFIX + caller], args=[self.rate, self.burst]), self._timeout_s
            )
        except (RedisError, OSError) as exc:  # TimeoutError included
            now = time.monotonic()
            if now - self._warned_at >= WARN_EVERY_S:
                self._warned_at = now
                log.warning("rate limiting is off while Redis is unreachable: %s", error_text(exc))
            return
        if not int(allowed):
            retry_after = max(1, round(float(wait) + 0.5))
            raise ApiError(
                429,
                f"Rate limit reached for this key: {self.rate:g} requests per second "
                f"(bursts of {self.burst}). Retry after {retry_after} s.",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(retry_after)},
            )


def limits_middleware(streams: StreamLimiter, rate: RateLimiter):
    """Generation requests take a rate token, then hold a concurrency slot for as long as they run
    (a streamed response runs inside its handler)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "POST" or request.path not in ENGINE_PATHS:
            return await handler(request)
        caller = request.get(IDENTITY, "anonymous")
        CALLER.set(caller)  # the admission queue's fairness is per caller
        await rate.check(caller)
        with streams.slot(caller):
            return await handler(request)

    return middleware
