"""Durable pull consumers on work-queue streams (commands, tasks): at-least-once, acked after handling.

A message is acked only when its handler returns (so after the events it caused are published);
if the handler raises it is nak'ed and redelivered, and a consumer that dies without acking gets
its messages redelivered after ack_wait. While a handler runs, the message is marked in progress so
long work (loading a model) is not redelivered under it.

The consumers are durable (file-backed on the server), so they survive a NATS restart: the loop
keeps fetching through an outage (fetches time out or fail; none of that ends it). A fetch that
JetStream answers with "no responders" (still recovering, or the consumer was deleted) makes it
create the consumer again (idempotent) and bind to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from fleet_bus.cancel import raise_if_cancelling
from fleet_bus.connection import Bus, error_text
from fleet_proto import decode_command
from fleet_proto.commands import Command
from fleet_proto.subjects import CMD_STREAM, TASK_STREAM, command_subject, subject_token, task_subject

log = logging.getLogger("fleet_bus.workqueue")
T = TypeVar("T")
# While NATS is unreachable a fetch fails at once (or times out): pause this long between tries.
FETCH_RETRY_S = 0.25


class Delivery(msgspec.Struct, frozen=True):
    """Where a message stands: its stream sequence and how many times it has been delivered."""

    stream_seq: int
    attempt: int


async def _keep_in_progress(msg: Msg, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        with contextlib.suppress(Exception):
            await msg.in_progress()


async def _handle_one(
    msg: Msg,
    decode: Callable[[bytes], T],
    handler: Callable[[T, Delivery], Awaitable[None]],
    ack_wait_s: float,
    max_deliver: int,
) -> None:
    meta = msg.metadata
    delivery = Delivery(stream_seq=int(meta.sequence.stream), attempt=int(meta.num_delivered))
    try:
        message = decode(msg.data)
    except (TypeError, ValueError) as exc:  # it will never decode: drop it loudly rather than retry forever
        log.error("dropping undecodable message on %s (seq %d): %s", msg.subject, delivery.stream_seq, exc)
        await msg.term()
        return
    heartbeat = asyncio.create_task(_keep_in_progress(msg, ack_wait_s / 3))
    try:
        await handler(message, delivery)
    except asyncio.CancelledError:
        # Shutting down mid-handler: leave it unacked so another consumer gets it.
        raise
    except Exception:
        if delivery.attempt >= max_deliver:
            log.exception(
                "giving up on %s seq %d after %d attempts", msg.subject, delivery.stream_seq, max_deliver
            )
            await msg.term()
        else:
            log.exception("handler failed for %s seq %d, will redeliver", msg.subject, delivery.stream_seq)
            await msg.nak(delay=min(2.0**delivery.attempt, 30.0))
        return
    finally:
        heartbeat.cancel()
    await msg.ack()


async def consume(
    bus: Bus,
    *,
    stream: str,
    durable: str,
    filter_subjects: list[str],
    decode: Callable[[bytes], T],
    handler: Callable[[T, Delivery], Awaitable[None]],
    ack_wait_s: float = 30.0,
    max_deliver: int = 5,
) -> None:
    """Pull messages one at a time and run `handler` on each until cancelled."""
    config = ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
        filter_subjects=filter_subjects,
    )
    await bus.js.add_consumer(stream, config)
    sub = await bus.js.pull_subscribe_bind(durable=durable, stream=stream)
    failing = False
    try:
        while True:
            try:
                msgs = await sub.fetch(1, timeout=1.0)
            except (TimeoutError, NatsTimeoutError):
                raise_if_cancelling()
                continue
            except nats.errors.Error as exc:  # NATS down, JetStream recovering, or the consumer gone
                raise_if_cancelling()
                if bus.nc.is_closed:
                    raise
                if not failing:
                    log.warning("fetching from %s failed, retrying: %s", durable, error_text(exc))
                    failing = True
                await asyncio.sleep(FETCH_RETRY_S)
                if bus.nc.is_connected:  # JetStream said "no responders": create the consumer again
                    sub = await _rebind(bus, stream, config, sub)
                continue
            if failing:
                log.info("fetching from %s works again", durable)
                failing = False
            for msg in msgs:
                await _handle_one(msg, decode, handler, ack_wait_s, max_deliver)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _rebind(bus: Bus, stream: str, config: ConsumerConfig, sub: Any) -> Any:
    """Create the durable consumer (idempotent: it may exist) and bind to it; the old subscription
    when that fails too (the next failed fetch tries again)."""
    try:
        await bus.js.add_consumer(stream, config)
        new = await bus.js.pull_subscribe_bind(durable=config.durable_name, stream=stream)
    except (TimeoutError, nats.errors.Error):
        raise_if_cancelling()
        return sub
    with contextlib.suppress(Exception):
        await sub.unsubscribe()
    return new


async def consume_commands(
    bus: Bus,
    durable: str,
    kinds: tuple[type[Command], ...],
    handler: Callable[[Command, Delivery], Awaitable[None]],
    ack_wait_s: float = 30.0,
) -> None:
    """Consume the commands of `kinds` (each command kind has exactly one consuming service)."""
    subjects = [command_subject(kind) for kind in kinds]
    await consume(
        bus,
        stream=CMD_STREAM.name,
        durable=subject_token(durable),
        filter_subjects=subjects,
        decode=decode_command,
        handler=handler,
        ack_wait_s=ack_wait_s,
    )


async def consume_tasks(
    bus: Bus,
    worker_id: str,
    decode: Callable[[bytes], T],
    handler: Callable[[T, Delivery], Awaitable[None]],
    ack_wait_s: float = 30.0,
) -> None:
    """Consume this worker's tasks from FLEET_TASK (durable per worker, so a restart resumes)."""
    await consume(
        bus,
        stream=TASK_STREAM.name,
        durable=f"worker-{subject_token(worker_id)}",
        filter_subjects=[task_subject(worker_id)],
        decode=decode,
        handler=handler,
        ack_wait_s=ack_wait_s,
    )
