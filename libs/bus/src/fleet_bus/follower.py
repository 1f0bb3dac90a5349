"""Follow FLEET_EVT with an ordered consumer and fold every event into State with fleet_proto.apply.

Every service keeps its own StateFollower: the event stream is the truth, State is derived.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy

from fleet_bus.connection import Bus
from fleet_proto import Event, State, UnknownEventError, apply, decode_event
from fleet_proto.subjects import EVT_STREAM

log = logging.getLogger("fleet_bus.follower")

# A listener that falls this far behind is dropped rather than slowing the follower down.
LISTENER_QUEUE_SIZE = 1024


class StateFollower:
    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self.state = State()
        self._sub: Subscription | None = None
        self._changed = asyncio.Condition()
        self._listeners: set[asyncio.Queue[tuple[int, Event] | None]] = set()

    async def start(self, catch_up_timeout_s: float = 30.0) -> None:
        """Subscribe from the first retained event and return once the events present now are applied."""
        info = await self._bus.js.stream_info(EVT_STREAM.name)
        target = int(info.state.last_seq)
        self._sub = await self._bus.js.subscribe(
            EVT_STREAM.subjects[0],
            stream=EVT_STREAM.name,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
            cb=self._on_message,
        )
        await self.wait_for(lambda state: state.last_seq >= target, catch_up_timeout_s)

    async def stop(self) -> None:
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
