"""Cancels that come before their task is running, remembered for a while.

The gateway publishes `fleet.cancel.<request_id>` on core NATS the moment its client hangs up, while
the task itself travels through the FLEET_TASK work queue, which the worker pulls one message at a
time, and `InstanceManager.on_task` may still await (a KV prefetch) before the engine has the
request. A cancel in either window finds nothing to cancel; without this the request then ran to
max_tokens for a client that was gone, holding its batch slot all along (the soak found it).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fleet_bus import Bus, Delivery, publish_chunk
from fleet_proto import TokenChunk
from fleet_proto.messages import WorkerTask

# A task waits in the queue behind the ones before it (one fetch each) and the KV prefetch takes a
# few object-store round trips: seconds at worst. Every worker hears every cancel (fleet.cancel.*),
# so the memory is bounded in time and size; a cancel older than this found its task long ago.
REMEMBER_S = 120.0
REMEMBER_MAX = 10_000


class RecentCancels:
    """Request ids cancelled in the last `keep_s` seconds (at most `max_entries` of them)."""

    def __init__(
        self,
        keep_s: float = REMEMBER_S,
        max_entries: int = REMEMBER_MAX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keep_s = keep_s
        self._max = max_entries
        self._clock = clock
        self._at: dict[str, float] = {}  # in the order they came: the oldest first

    def add(self, request_id: str) -> None:
        now = self._clock()
        self._at.pop(request_id, None)
        self._at[request_id] = now
        while self._at:
            oldest, at = next(iter(self._at.items()))
            if now - at < self._keep_s and len(self._at) <= self._max:
                break
            del self._at[oldest]

    def __contains__(self, request_id: str) -> bool:
        at = self._at.get(request_id)
        return at is not None and self._clock() - at < self._keep_s

    def __len__(self) -> int:
        return len(self._at)


def honouring_early_cancels(
    bus: Bus,
    cancels: RecentCancels,
    on_task: Callable[[WorkerTask, Delivery], Awaitable[None]],
    cancel: Callable[[str], None],
) -> Callable[[WorkerTask, Delivery], Awaitable[None]]:
    """`on_task` for tasks whose cancel may already have come: one cancelled while queued is never
    started (its "cancelled" chunk ends the stream, should anyone still read it); one cancelled
    while `on_task` ran is cancelled again once the engine has it."""

    async def handle(task: WorkerTask, delivery: Delivery) -> None:
        if task.request_id in cancels:
            await publish_chunk(bus, TokenChunk(request_id=task.request_id, finish_reason="cancelled"))
            return
        await on_task(task, delivery)
        if task.request_id in cancels:
            cancel(task.request_id)

    return handle
