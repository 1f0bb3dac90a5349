"""The token stream of one request on core NATS `fleet.tok.<request_id>` (worker -> gateway).

Core NATS keeps order per publisher but does not persist, so the reader checks chunk indexes and
gives up with a clear error when chunks stop arriving (a worker that died mid-stream).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from nats.aio.subscription import Subscription

from fleet_bus.cancel import raise_if_cancelling
from fleet_bus.connection import Bus, BusError
from fleet_proto import TokenChunk, encode
from fleet_proto.subjects import token_subject


class StreamBroken(BusError):
    """The token stream stalled or lost a chunk."""


_decoder = msgspec.json.Decoder(TokenChunk)


async def publish_chunk(bus: Bus, chunk: TokenChunk) -> None:
    await bus.nc.publish(token_subject(chunk.request_id), encode(chunk))


async def _assumed_alive() -> bool:
    return True


class TokenStreamReader:
    """Subscribe before the task is published (`await reader.open()`), then iterate the chunks."""

    def __init__(
        self,
        bus: Bus,
        request_id: str,
        stall_timeout_s: float,
        producer_alive: Callable[[], Awaitable[bool]] | None = None,
        poll_s: float = 1.0,
    ) -> None:
        """`producer_alive` is asked every `poll_s` without a chunk: a dead worker ends the stream
        within seconds, while a live one may take up to `stall_timeout_s` (a long prefill)."""
        self._bus = bus
        self.request_id = request_id
        self._stall_timeout_s = stall_timeout_s
        self._producer_alive = producer_alive or _assumed_alive
        self._poll_s = poll_s
        self._sub: Subscription | None = None

    async def open(self) -> TokenStreamReader:
        self._sub = await self._bus.nc.subscribe(token_subject(self.request_id))
        try:
            # Registered at the server before any worker can publish. Shielded: a client that
            # hangs up cancels us here, and nats-py (2.16) would cancel the PONG future it queued;
            # resolving that one when the PONG comes raises in its read loop, which then stops
            # for good (nothing more is received on the connection, every later request fails).
            await asyncio.shield(self._bus.nc.flush())
        except BaseException:
            await self.close()  # cancelled or failed: the caller never gets a reader to close
            raise
        return self

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        """Chunks in order until the one with finish_reason; StreamBroken on a gap or a stall."""
        assert self._sub is not None, "open() first"
        expected = 0
        last_chunk_at = time.monotonic()
        while True:
            try:
                msg = await self._sub.next_msg(timeout=min(self._poll_s, self._stall_timeout_s))
            except TimeoutError:
                raise_if_cancelling()
                if not await self._producer_alive():
                    raise StreamBroken(
                        f"the worker running request {self.request_id} stopped responding"
                    ) from None
                if time.monotonic() - last_chunk_at >= self._stall_timeout_s:
                    raise StreamBroken(
                        f"no tokens for request {self.request_id} in {self._stall_timeout_s:.0f} s"
                    ) from None
                continue
            # A cancel (the client hung up) that came as the chunk did is swallowed by the
            # wait_for inside nats-py's next_msg (Python 3.11): the chunk is returned and the task
            # goes on as if never cancelled, so the request ran to its end for nobody.
            raise_if_cancelling()
            last_chunk_at = time.monotonic()
            chunk = _decoder.decode(msg.data)
            if chunk.index != expected:
                raise StreamBroken(
                    f"request {self.request_id}: chunk {chunk.index} arrived, expected {expected}"
                )
            expected += 1
            yield chunk
            if chunk.finish_reason:
                return
