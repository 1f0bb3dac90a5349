"""Follow FLEET_EVT with an ordered consumer and fold every event into State with fleet_proto.apply.

Every service keeps its own StateFollower: the event stream is the truth, State is derived.

Across a NATS outage: the ordered consumer is ephemeral (in memory on the server), so a restarted
server has forgotten it and nats-py would notice only after two missed idle heartbeats (10-20 s).
The follower re-subscribes on every reconnect from the event after the last one it applied, and a
seq it already has is skipped, so no event is missed or applied twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy

from fleet_bus.cancel import raise_if_cancelling
from fleet_bus.connection import Bus, error_text
from fleet_proto import Event, State, UnknownEventError, apply, decode_event
from fleet_proto.subjects import EVT_STREAM

log = logging.getLogger("fleet_bus.follower")

# A listener that falls this far behind is dropped rather than slowing the follower down.
LISTENER_QUEUE_SIZE = 1024
# After a reconnect, creating the consumer again is retried this often until JetStream answers.
RESUBSCRIBE_RETRY_S = 0.2


class StateFollower:
    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self.state = State()
        self._sub: Subscription | None = None
        self._changed = asyncio.Condition()
        self._listeners: set[asyncio.Queue[tuple[int, Event] | None]] = set()
        self._stopped = False
        self._resuming: asyncio.Task[None] | None = None
        self.resumes = 0  # re-subscriptions after reconnects

    async def start(self, catch_up_timeout_s: float = 30.0) -> None:
        """Subscribe from the first retained event and return once the events present now are applied."""
        info = await self._bus.js.stream_info(EVT_STREAM.name)
        target = int(info.state.last_seq)
        self._sub = await self._subscribe()
        self._bus.on_reconnected(self._on_reconnected)
        await self.wait_for(lambda state: state.last_seq >= target, catch_up_timeout_s)

    async def _subscribe(self) -> Subscription:
        """An ordered push consumer from the event after the last applied one (all, at first)."""
        after = self.state.last_seq
        config = (
            ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after + 1)
            if after
            else ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        )
        return await self._bus.js.subscribe(
            EVT_STREAM.subjects[0],
            stream=EVT_STREAM.name,
            ordered_consumer=True,
            config=config,
            cb=self._on_message,
        )

    async def _on_reconnected(self) -> None:
        if self._stopped:
            return
        if self._resuming is not None:  # reconnected again while resuming: start over
            self._resuming.cancel()
        self._resuming = asyncio.current_task()
        try:
            await self._resume()
        finally:
            if self._resuming is asyncio.current_task():
                self._resuming = None

    async def _resume(self) -> None:
        """Replace the consumer the server may have lost; retried until JetStream answers (it may
        still be recovering its streams) or the connection closes."""
        old, self._sub = self._sub, None
        if old is not None:
            with contextlib.suppress(Exception):
                await old.unsubscribe()
        warned = False
        while not self._stopped and not self._bus.nc.is_closed:
            if not await self._bus.wait_connected(RESUBSCRIBE_RETRY_S):
                continue  # down again: a request now would wait in nats-py's buffer, then time out
            try:
                sub = await self._subscribe()
            except (TimeoutError, nats.errors.Error) as exc:
                raise_if_cancelling()
                if not warned:
                    log.warning("following events again failed, retrying: %s", error_text(exc))
                    warned = True
                await asyncio.sleep(RESUBSCRIBE_RETRY_S)
                continue
            if self._stopped:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
                return
            self._sub = sub
            self.resumes += 1
            log.info("following events again after seq %d", self.state.last_seq)
            return

    async def check(self) -> None:
        """Health check: raises while the follower has no consumer (after a reconnect, until the
        consumer is created again)."""
        if self._sub is None:
            raise ConnectionError("not following events (re-subscribing after a NATS reconnect)")

    async def stop(self) -> None:
        self._stopped = True
        if self._resuming is not None:
            self._resuming.cancel()
            self._resuming = None
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        for queue in list(self._listeners):
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)

    async def _on_message(self, msg: Msg) -> None:
        seq = int(msg.metadata.sequence.stream)
        if seq <= self.state.last_seq:
            return  # the ordered consumer restarted and redelivered what we have
        try:
            event = decode_event(msg.data)
        except UnknownEventError as exc:
            log.warning("skipping event seq %d on %s: %s", seq, msg.subject, exc)
            return
        async with self._changed:
            # Checked again under the lock: after a resume the old and the new consumer can both
            # deliver the same seq (each callback runs in its own task), and apply() refuses a repeat.
            if seq <= self.state.last_seq:
                return
            self.state = apply(self.state, event, seq)
            self._changed.notify_all()
        for queue in list(self._listeners):
            try:
                queue.put_nowait((seq, event))
            except asyncio.QueueFull:
                log.warning("dropping a slow event listener")
                self._listeners.discard(queue)
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
                queue.put_nowait(None)

    async def wait_for(self, predicate: Callable[[State], bool], timeout_s: float) -> State:
        """Wait until `predicate(state)` holds; raise TimeoutError after timeout_s."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: predicate(self.state))
            return self.state

    @asynccontextmanager
    async def listen(self) -> AsyncIterator[AsyncIterator[tuple[int, Event]]]:
        """Live (seq, event) pairs applied from now on, for as long as the `async with` lasts."""
        queue: asyncio.Queue[tuple[int, Event] | None] = asyncio.Queue(LISTENER_QUEUE_SIZE)
        self._listeners.add(queue)

        async def items() -> AsyncIterator[tuple[int, Event]]:
            while (item := await queue.get()) is not None:
                yield item

        try:
            yield items()
        finally:
            self._listeners.discard(queue)
