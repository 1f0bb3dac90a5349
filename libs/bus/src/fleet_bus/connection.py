"""A NATS connection with JetStream: connect with a deadline, typed publish, request/reply.

Everything on the wire is JSON encoded by fleet_proto (msgspec), so `nats sub 'fleet.>'` shows it.

Outages: once connected, the client reconnects forever (every RECONNECT_WAIT_S) and nats-py
re-subscribes core subscriptions itself; what nats-py does not restore (JetStream push consumers)
is restored by hooks registered with `on_reconnected` (StateFollower). JetStream publishes wait for
the connection and retry until the bus timeout, with a `Nats-Msg-Id` so that JetStream's duplicate
window drops a retry whose first attempt did land; after the deadline they raise BusUnavailable.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import ConnectionClosedError, NoRespondersError, OutboundBufferLimitError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError
from opentelemetry import context as otel_context

from fleet_bus.auth import NatsAuth, redacted
from fleet_bus.cancel import raise_if_cancelling
from fleet_bus.trace_context import remote_context, trace_headers
from fleet_proto import encode
from fleet_proto.commands import Command
from fleet_proto.subjects import command_subject, event_subject, task_subject

log = logging.getLogger("fleet_bus")
T = TypeVar("T")

# nats-py waits 2 s between reconnect attempts by default; a restarted server is found within this.
RECONNECT_WAIT_S = 0.5
# A server that goes silent without closing the socket (hung host, lost route) is noticed after
# MAX_OUTSTANDING_PINGS unanswered pings (nats-py's default interval is 120 s).
PING_INTERVAL_S = 5
MAX_OUTSTANDING_PINGS = 2
# What nats-py buffers while reconnecting: core publishes (token chunks, acks, subscriptions). It is
# flushed on reconnect; a publish beyond it raises. JetStream publishes never wait in it (see below).
PENDING_BYTES = 8 << 20
# One JetStream publish attempt waits this long for its ack, then it is sent again with the same
# Nats-Msg-Id (a duplicate of a stored message is acknowledged, not stored twice).
PUBLISH_ATTEMPT_S = 1.0
# Pause before retrying a publish that JetStream refused for now (no responders: just restarted).
PUBLISH_RETRY_S = 0.1
CONNECTED_POLL_S = 0.05
# JetStream answered, or nobody did: the message was not stored.
_NOT_STORED = (NoStreamResponseError, NoRespondersError, ServiceUnavailableError, OutboundBufferLimitError)


class BusError(RuntimeError):
    """Base of fleet_bus errors."""


class BusUnavailable(BusError):
    """NATS could not be reached (or refused us) within the connect deadline, or a JetStream publish
    got no acknowledgement within the bus timeout. `maybe_stored` is True only when an attempt was
    sent on a live connection and its ack never came (it may have been stored, or be in nats-py's
    buffer when the connection dropped under it); otherwise nothing was stored and nothing will be:
    publish_js sends nothing while disconnected."""

    def __init__(self, message: str, maybe_stored: bool = False) -> None:
        super().__init__(message)
        self.maybe_stored = maybe_stored


class RequestFailed(BusError):
    """A request got no reply: nobody serves the subject, or it did not answer in time."""


class NoResponders(RequestFailed):
    """Nobody subscribes to the subject: the NATS server said so at once (a process that died lost
    its subscriptions with its connection)."""


class Bus:
    """One service's NATS connection. Create with `await Bus.connect(...)`, end with `await bus.close()`."""

    def __init__(self, nc: Client, timeout_s: float) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=timeout_s)
        self.timeout_s = timeout_s
        self._reconnect_hooks: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._hook_tasks: set[asyncio.Task[None]] = set()
        self.disconnected_at: float | None = None  # monotonic time the current outage began

    def on_reconnected(self, hook: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run `hook()` (as a task) after every reconnect: for state nats-py does not restore itself."""
        self._reconnect_hooks.append(hook)

    def _run_reconnect_hooks(self) -> None:
        # nats-py awaits reconnected_cb inside its reconnect loop: hooks must not block it.
        for hook in self._reconnect_hooks:
            task = asyncio.create_task(hook(), name=f"on-reconnected-{getattr(hook, '__name__', 'hook')}")
            self._hook_tasks.add(task)
            task.add_done_callback(self._hook_done)

    def _hook_done(self, task: asyncio.Task[None]) -> None:
        self._hook_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("reconnect hook %s failed", task.get_name(), exc_info=task.exception())

    async def wait_connected(self, timeout_s: float) -> bool:
        """Wait until the connection is up; False when it is closed or still down after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not self.nc.is_connected:
            if self.nc.is_closed or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(CONNECTED_POLL_S, max(0.0, deadline - time.monotonic())))
        return True

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        *,
        user: str = "",
        password: str = "",
        auth: NatsAuth | None = None,
        connect_deadline_s: float = 10.0,
        timeout_s: float = 5.0,
    ) -> Bus:
        """Connect, retrying with backoff until the deadline; once connected, reconnect forever.
        `auth` (or just `user` and `password`) says how to log in; a URL may carry user:password too."""
        shown = redacted(url)

        async def on_error(exc: Exception) -> None:
            # While reconnecting every failed attempt (2 a second) reports "connection refused":
            # the disconnect warning already said so, keep them out of the log.
            if nc.is_reconnecting and isinstance(exc, OSError | TimeoutError):
                log.debug("nats: reconnect attempt failed: %s", exc)
                return
            log.warning("nats: %s", exc)

        async def on_disconnected() -> None:
            if not (nc.is_closed or nc.is_draining):
                bus.disconnected_at = time.monotonic()
                log.warning("nats: disconnected from %s, reconnecting", shown)

        async def on_reconnected() -> None:
            down = time.monotonic() - bus.disconnected_at if bus.disconnected_at is not None else 0.0
            bus.disconnected_at = None
            log.info("nats: reconnected to %s after %.1f s", shown, down)
            bus._run_reconnect_hooks()

        nc = Client()
        bus = cls(nc, timeout_s)
        options: dict[str, Any] = {
            "servers": [url],
            "name": name,
            "connect_timeout": 2,
            "reconnect_time_wait": RECONNECT_WAIT_S,
            "max_reconnect_attempts": -1,
            "ping_interval": PING_INTERVAL_S,
            "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
            "pending_size": PENDING_BYTES,
            "drain_timeout": 5,
            "error_cb": on_error,
            "disconnected_cb": on_disconnected,
            "reconnected_cb": on_reconnected,
        }
        options |= (auth or NatsAuth(user=user, password=password)).options(url)
        try:
            await asyncio.wait_for(nc.connect(**options), connect_deadline_s)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await nc.close()
            detail = f": {exc}" if str(exc) else ""
            raise BusUnavailable(
                f"cannot reach NATS at {shown} within {connect_deadline_s:.0f} s{detail} "
                "(is nats-server running with JetStream, and are FLEET_NATS_URL/credentials right?)"
            ) from None
        return bus

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.drain()

    # JetStream publishing: returns the stream sequence the message got (BusUnavailable after the
    # bus timeout). A command's id is its Nats-Msg-Id, so even two publishes of one command store it
    # once (within JetStream's 2-minute duplicate window); events and tasks get one id per call.
    async def publish_event(self, event: msgspec.Struct) -> int:
        subject = event_subject(type(event))
        return await self.publish_js(subject, encode(event), uuid.uuid4().hex, f"event {_last(subject)}")

    async def publish_command(self, command: Command) -> int:
        subject = command_subject(type(command))
        what = f"command {_last(subject)} {command.command_id}"
        return await self.publish_js(subject, encode(command), command.command_id, what)

    async def publish_task(self, worker_id: str, task: msgspec.Struct) -> int:
        what = f"the task of request {getattr(task, 'request_id', '?')}"
        return await self.publish_js(task_subject(worker_id), encode(task), uuid.uuid4().hex, what)

    async def publish_js(self, subject: str, payload: bytes, msg_id: str, what: str) -> int:
        """Publish to JetStream until it acknowledges, for at most the bus timeout.

        An attempt is sent only while connected: during an outage the message waits here, not in
        nats-py's reconnect buffer, so once the deadline passes it can never be stored later and
        BusUnavailable truly means "not accepted" (unless an attempt sent on a live connection got
        no ack: then `maybe_stored`). Retries carry the same Nats-Msg-Id, so a retry of an attempt
        that did land is acknowledged as a duplicate and stored once."""
        deadline = time.monotonic() + self.timeout_s
        headers = {"Nats-Msg-Id": msg_id, **trace_headers()}
        maybe_stored = False
        why = "not connected"
        while (remaining := deadline - time.monotonic()) > 0:
            if not self.nc.is_connected:
                if self.nc.is_closed:
                    why = "the connection is closed"
                    break
                await self.wait_connected(remaining)
                continue
            try:
                ack = await self.js.publish(
                    subject, payload, timeout=min(remaining, PUBLISH_ATTEMPT_S), headers=headers
                )
                return int(ack.seq)
            except _NOT_STORED as exc:
                raise_if_cancelling()
                why = _describe(exc)
                await asyncio.sleep(min(PUBLISH_RETRY_S, max(0.0, deadline - time.monotonic())))
            except TimeoutError:  # nats-py's TimeoutError is one too
                raise_if_cancelling()
                maybe_stored = True
                why = "no acknowledgement"
            except ConnectionClosedError:
                why = "the connection is closed"
                break
        if maybe_stored:
            raise BusUnavailable(
                f"the message bus (NATS) did not acknowledge {what} within {self.timeout_s:g} s: "
                "it may or may not have been accepted",
                maybe_stored=True,
            )
        raise BusUnavailable(
            f"the message bus (NATS) is unavailable ({why}): {what} was NOT accepted "
            f"(nothing was stored within {self.timeout_s:g} s); retry later"
        )

    # Core NATS: not persisted.
    async def publish(self, subject: str, message: msgspec.Struct) -> None:
        await self.nc.publish(subject, encode(message), headers=trace_headers() or None)

    async def request(
        self, subject: str, message: msgspec.Struct, reply_type: type[T], timeout_s: float
    ) -> T:
        if not self.nc.is_connected:  # fail now, rather than queue a request that would outlive us
            raise RequestFailed(f"not connected to NATS: no request on {subject}")
        try:
            reply = await self.nc.request(
                subject, encode(message), timeout=timeout_s, headers=trace_headers() or None
            )
        except NoRespondersError:
            raise NoResponders(f"nobody serves {subject}") from None
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
            # the handler's spans are children of the requester's (its traceparent header)
            remote = remote_context(msg.headers)
            token = otel_context.attach(remote) if remote is not None else None
            try:
                request = msgspec.json.decode(msg.data, type=request_type)
                reply = await handler(request)
            except Exception:
                log.exception("handler for %s failed", subject)
                return
            finally:
                if token is not None:
                    otel_context.detach(token)
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


def _last(subject: str) -> str:
    return subject.rsplit(".", 1)[-1]


def error_text(exc: BaseException) -> str:
    """An exception for a log line or an error message: its text, or its type when it has none
    (nats-py's and asyncio's timeouts carry no message; `exc or ...` would print "")."""
    return str(exc) or type(exc).__name__


def _describe(exc: Exception) -> str:
    if isinstance(exc, NoStreamResponseError | NoRespondersError):
        return "JetStream did not answer: no responders"
    return error_text(exc)
