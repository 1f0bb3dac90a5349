"""A NATS connection with JetStream: connect with a deadline, typed publish, request/reply.

Everything on the wire is JSON encoded by fleet_proto (msgspec), so `nats sub 'fleet.>'` shows it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from fleet_proto import encode
from fleet_proto.subjects import command_subject, event_subject, task_subject

log = logging.getLogger("fleet_bus")
T = TypeVar("T")


class BusError(RuntimeError):
    """Base of fleet_bus errors."""


class BusUnavailable(BusError):
    """NATS could not be reached (or refused us) within the connect deadline."""


class RequestFailed(BusError):
    """A request got no reply: nobody serves the subject, or it did not answer in time."""


class Bus:
    """One service's NATS connection. Create with `await Bus.connect(...)`, end with `await bus.close()`."""

    def __init__(self, nc: Client, timeout_s: float) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=timeout_s)
        self.timeout_s = timeout_s

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        *,
        user: str = "",
        password: str = "",
        connect_deadline_s: float = 10.0,
        timeout_s: float = 5.0,
    ) -> Bus:
        """Connect, retrying with backoff until the deadline; once connected, reconnect forever."""

        async def on_error(exc: Exception) -> None:
            log.warning("nats: %s", exc)

        async def on_disconnected() -> None:
            if not (nc.is_closed or nc.is_draining):
                log.warning("nats: disconnected from %s, reconnecting", url)

        async def on_reconnected() -> None:
            log.info("nats: reconnected to %s", url)

        nc = Client()
        options: dict[str, Any] = {
            "servers": [url],
            "name": name,
            "connect_timeout": 2,
            "reconnect_time_wait": 0.5,
            "max_reconnect_attempts": -1,
            "drain_timeout": 5,
            "error_cb": on_error,
            "disconnected_cb": on_disconnected,
            "reconnected_cb": on_reconnected,
        }
        if user:
            options |= {"user": user, "password": password}
        try:
            await asyncio.wait_for(nc.connect(**options), connect_deadline_s)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await nc.close()
            detail = f": {exc}" if str(exc) else ""
            raise BusUnavailable(
                f"cannot reach NATS at {url} within {connect_deadline_s:.0f} s{detail} "
                "(is nats-server running with JetStream, and are FLEET_NATS_URL/credentials right?)"
            ) from None
        return cls(nc, timeout_s)

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.drain()

    # JetStream publishing: returns the stream sequence the message got.
    async def publish_event(self, event: msgspec.Struct) -> int:
        ack = await self.js.publish(event_subject(type(event)), encode(event))
        return int(ack.seq)

    async def publish_command(self, command: msgspec.Struct) -> int:
        ack = await self.js.publish(command_subject(type(command)), encode(command))
        return int(ack.seq)

    async def publish_task(self, worker_id: str, task: msgspec.Struct) -> int:
        ack = await self.js.publish(task_subject(worker_id), encode(task))
        return int(ack.seq)

    # Core NATS: not persisted.
    async def publish(self, subject: str, message: msgspec.Struct) -> None:
        await self.nc.publish(subject, encode(message))

    async def request(
        self, subject: str, message: msgspec.Struct, reply_type: type[T], timeout_s: float
    ) -> T:
        try:
            reply = await self.nc.request(subject, encode(message), timeout=timeout_s)
        except NoRespondersError:
            raise RequestFailed(f"nobody serves {subject}") from None
        except NatsTimeoutError:
            raise RequestFailed(f"no reply on {subject} within {timeout_s} s") from None
        return msgspec.json.decode(reply.data, type=reply_type)

    async def serve(
        self,
        subject: str,
        request_type: type[T],
        handler: Callable[[T], Awaitable[msgspec.Struct]],
        queue: str = "",
    ) -> Subscription:
        """Answer requests on `subject` (a queue group spreads them over replicas)."""

        async def on_request(msg: Msg) -> None:
            try:
                request = msgspec.json.decode(msg.data, type=request_type)
                reply = await handler(request)
            except Exception:
                log.exception("handler for %s failed", subject)
                return
            await msg.respond(encode(reply))

        return await self.nc.subscribe(subject, queue=queue, cb=on_request)

    @asynccontextmanager
    async def subscription(self, subject: str, message_type: type[T]) -> AsyncIterator[AsyncIterator[T]]:
        """Subscribe for the duration of a `async with`; yields an iterator of decoded messages."""
        sub = await self.nc.subscribe(subject)

        async def messages() -> AsyncIterator[T]:
            async for msg in sub.messages:
                yield msgspec.json.decode(msg.data, type=message_type)

        try:
            yield messages()
        finally:
            await sub.unsubscribe()
