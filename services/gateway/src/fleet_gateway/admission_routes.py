"""The admission queue over HTTP, and the callers' priorities behind it.

- `GET /admission`: requests waiting per model in this gateway, refusals by reason since it
  started, its limits, and the priorities set.
- `POST /admission/priorities` (admin): `{"key": "<an API key>" | "identity": "key-…", "priority": n}`;
  higher goes first when a model is full (default 0). Kept in Redis, so every gateway replica reads
  the same (each refreshes its copy every few seconds); a key is stored only as its identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import RedisError

from fleet_bus import Bus, error_text
from fleet_gateway.admission import Admission, AdmissionLimits
from fleet_gateway.auth import identity
from fleet_gateway.errors import ApiError
from fleet_proto.messages import AdmissionSample
from fleet_proto.subjects import admission_subject

log = logging.getLogger("fleet_gateway.admission")
PRIORITY_HASH = "fleet:admission:priority"
REFRESH_S = 5.0


class PriorityBody(msgspec.Struct, forbid_unknown_fields=True):
    priority: int
    key: str = ""
    identity: str = ""


class KeyPriorities:
    """Each caller's priority (by identity), as an admin set it; this replica's copy of Redis'."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self.known: dict[str, int] = {}

    def of(self, caller: str) -> int:
        return self.known.get(caller, 0)

    async def refresh(self) -> None:
        raw = await self._redis.hgetall(PRIORITY_HASH)
        self.known = {_text(k): int(v) for k, v in raw.items()}

    async def keep_fresh(self, interval_s: float = REFRESH_S) -> None:
        warned = False
        while True:
            try:
                await self.refresh()
                warned = False
            except (RedisError, OSError, ValueError) as exc:  # the last copy stands meanwhile
                if not warned:
                    log.warning("admission priorities not refreshed: %s", error_text(exc))
                    warned = True
            await asyncio.sleep(interval_s)

    async def set(self, caller: str, priority: int) -> None:
        await self._redis.hset(PRIORITY_HASH, caller, str(priority))
        self.known[caller] = priority


async def publish_samples(bus: Bus, gateway_id: str, admission: Admission, interval_s: float = 1.0) -> None:
    """The queue's depth and refusals for the metrics-collector, once a second."""
    while True:
        if bus.nc.is_connected:  # as node metrics: a sample missed in an outage is not worth queueing
            sample = AdmissionSample(
                gateway_id=gateway_id,
                at=time.time(),
                waiting=admission.waiting(),
                refused=dict(admission.refused),
            )
            with contextlib.suppress(Exception):
                await bus.publish(admission_subject(gateway_id), sample)
        await asyncio.sleep(interval_s)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def admission_routes(
    admission: Admission, limits: AdmissionLimits, priorities: KeyPriorities
) -> list[web.RouteDef]:
    async def get_admission(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "waiting": admission.waiting(),
                "refused": admission.refused,
                "limits": msgspec.to_builtins(limits),
                "priorities": priorities.known,
            }
        )

    async def set_priority(request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=PriorityBody)
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"Invalid body: {exc}") from None
        if bool(body.key) == bool(body.identity):
            raise ApiError(400, "Send either 'key' (an API key) or 'identity' (key-…), not both.")
        caller = identity(body.key) if body.key else body.identity
        try:
            await priorities.set(caller, body.priority)
        except (RedisError, OSError) as exc:
            raise ApiError(
                503, f"Priorities live in Redis, which does not answer: {error_text(exc)}"
            ) from None
        return web.json_response({"identity": caller, "priority": body.priority})

    return [
        web.get("/admission", get_admission),
        web.post("/admission/priorities", set_priority),
    ]
