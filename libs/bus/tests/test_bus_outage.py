"""fleet_bus across a NATS restart: a real nats-server (file storage) SIGKILLed by PID and started
again on the same port with the same JetStream store dir (fleet_local.servers.restart)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from fleet_bus import (
    Bus,
    BusUnavailable,
    Delivery,
    RequestFailed,
    StateFollower,
    consume_commands,
    ensure_streams,
)
from fleet_local.processes import pid_alive
from fleet_local.servers import ServerHandle, restart, start_nats
from fleet_proto import Command, CreateInstance, DeleteInstance, NodeLeft, decode_event, replay
from fleet_proto.subjects import CMD_STREAM, EVT_STREAM

RESUME_LIMIT_S = 5.0


class Nats:
    """One nats-server that a test can kill and bring back; the latest process is stopped at the end."""

    def __init__(self, root: Path) -> None:
        self.handle: ServerHandle = start_nats(root)

    @property
    def url(self) -> str:
        return self.handle.url

    def kill(self) -> None:
        os.kill(self.handle.pid, signal.SIGKILL)
        for _ in range(200):
            if not pid_alive(self.handle.pid, self.handle.started_at):
                return
            time.sleep(0.01)
        raise AssertionError(f"nats-server {self.handle.pid} survived SIGKILL")

    async def restart(self) -> float:
        """Start it again (same port and store); returns the monotonic time it answered /healthz."""
        self.handle = await asyncio.to_thread(restart, self.handle)
        return time.monotonic()

    def stop(self) -> None:
        self.handle.stop()


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[Nats]:
    server = Nats(tmp_path / "nats")
    yield server
    server.stop()


@pytest.fixture
async def connect(nats: Nats) -> AsyncIterator:
    buses: list[Bus] = []

    async def make(name: str, timeout_s: float = 5.0) -> Bus:
        bus = await Bus.connect(nats.url, name, timeout_s=timeout_s)
        await ensure_streams(bus.js)
        buses.append(bus)
        return bus

    yield make
    for bus in buses:
        if not bus.nc.is_closed:
            await bus.nc.close()


async def until_disconnected(bus: Bus, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while bus.nc.is_connected:
            await asyncio.sleep(0.01)


async def until_acked(bus: Bus) -> None:
    """Until the command work queue is empty: every command handled so far was acked."""
    async with asyncio.timeout(5):
        while (await bus.js.stream_info(CMD_STREAM.name)).state.messages:
            await asyncio.sleep(0.05)


async def test_a_command_published_during_a_short_outage_is_stored_once_when_nats_is_back(nats, connect):
    bus = await connect("publisher", timeout_s=5.0)
    command = CreateInstance(command_id="cmd-outage-1", model_id="m", instance_id="inst-1")
    nats.kill()
    await until_disconnected(bus)
    started = time.monotonic()
    publishing = asyncio.create_task(bus.publish_command(command))
    await asyncio.sleep(0.5)
    assert not publishing.done()  # it waits for NATS, not in nats-py's buffer
    back = await nats.restart()
    seq = await asyncio.wait_for(publishing, 5)
    print(
        f"published {time.monotonic() - back:.2f} s after NATS was back ({time.monotonic() - started:.2f} s)"
    )
    assert time.monotonic() - started < bus.timeout_s
    # a retry of the same command (same command_id = Nats-Msg-Id) is a duplicate: stored once
    assert await bus.publish_command(command) == seq
    assert (await bus.js.stream_info(CMD_STREAM.name)).state.messages == 1


async def test_past_the_deadline_a_publish_is_refused_clearly_and_never_lands_later(nats, connect):
    bus = await connect("publisher", timeout_s=1.5)
    nats.kill()
    await until_disconnected(bus)
    started = time.monotonic()
    with pytest.raises(BusUnavailable, match="NOT accepted") as refused:
        await bus.publish_command(DeleteInstance(command_id="cmd-refused", instance_id="inst-x"))
    took = time.monotonic() - started
    print(f"refused after {took:.2f} s: {refused.value}")
    assert 1.4 <= took < 3.0
    assert not refused.value.maybe_stored
    assert "cmd-refused" in str(refused.value) and "message bus" in str(refused.value)
    with pytest.raises(RequestFailed, match="not connected"):  # requests fail at once, not queued
        await bus.request("fleet.route", NodeLeft(node_id="n"), NodeLeft, timeout_s=1.0)
    await nats.restart()
    assert await bus.wait_connected(5)
    await asyncio.sleep(0.5)  # anything nats-py had buffered is flushed by now
    assert (await bus.js.stream_info(CMD_STREAM.name)).state.messages == 0


async def test_the_state_follower_resumes_without_missing_or_repeating_an_event(nats, connect):
    follower_bus, publisher = await connect("follower"), await connect("publisher")
    follower = StateFollower(follower_bus)
    await publisher.publish_event(NodeLeft(node_id="before-start", origin="t"))
    await follower.start()
    try:
        for n in range(3):
            await publisher.publish_event(NodeLeft(node_id=f"before-{n}", origin="t"))
        await follower.wait_for(lambda s: s.last_seq == 4, 5)
        nats.kill()
        await until_disconnected(follower_bus)
        back = await nats.restart()
        assert await publisher.wait_connected(5)
        last = 0
        for n in range(3):  # possibly before the follower has reconnected: it must still get them
            last = await publisher.publish_event(NodeLeft(node_id=f"after-{n}", origin="t"))
        await follower.wait_for(lambda s: s.last_seq == last, RESUME_LIMIT_S)
        print(f"the follower had every event {time.monotonic() - back:.2f} s after NATS was back")
        await follower.check()  # healthy: subscribed again
        assert follower.resumes == 1
        events = []
        sub = await publisher.js.pull_subscribe(EVT_STREAM.subjects[0], stream=EVT_STREAM.name)
        for msg in await sub.fetch(last, timeout=5):
            events.append((int(msg.metadata.sequence.stream), msg.data))
        assert [seq for seq, _ in events] == list(range(1, last + 1))
        assert follower.state == replay([(seq, decode_event(data)) for seq, data in events])
    finally:
        await follower.stop()


async def test_a_command_consumer_keeps_running_through_the_outage(nats, connect):
    consumer_bus, publisher = await connect("consumer"), await connect("publisher")
    handled: asyncio.Queue[Command] = asyncio.Queue()

    async def handle(command: Command, _: Delivery) -> None:
        await handled.put(command)

    consuming = asyncio.create_task(
        consume_commands(consumer_bus, "outage-test", (CreateInstance, DeleteInstance), handle)
    )
    try:
        await publisher.publish_command(DeleteInstance(command_id="c-before", instance_id="i"))
        assert (await asyncio.wait_for(handled.get(), 5)).command_id == "c-before"
        await until_acked(publisher)
        nats.kill()
        await asyncio.sleep(1.5)  # fetches fail and time out meanwhile
        assert not consuming.done()
        back = await nats.restart()
        assert await publisher.wait_connected(5)
        await publisher.publish_command(DeleteInstance(command_id="c-after", instance_id="i"))
        assert (await asyncio.wait_for(handled.get(), RESUME_LIMIT_S)).command_id == "c-after"
        print(f"a command published after the restart was handled {time.monotonic() - back:.2f} s after")
        assert handled.empty() and not consuming.done()
    finally:
        consuming.cancel()
        await asyncio.gather(consuming, return_exceptions=True)


async def test_a_command_consumer_creates_its_consumer_again_when_jetstream_lost_it(connect):
    """A fetch JetStream answers with "no responders" (the durable consumer was deleted, e.g. its
    stream recreated) does not end the loop: it creates the consumer again and goes on."""
    consumer_bus, publisher = await connect("consumer"), await connect("publisher")
    handled: asyncio.Queue[Command] = asyncio.Queue()

    async def handle(command: Command, _: Delivery) -> None:
        await handled.put(command)

    consuming = asyncio.create_task(consume_commands(consumer_bus, "lost-test", (DeleteInstance,), handle))
    try:
        await publisher.publish_command(DeleteInstance(command_id="c-before", instance_id="i"))
        assert (await asyncio.wait_for(handled.get(), 5)).command_id == "c-before"
        await until_acked(publisher)  # else the new consumer rightly delivers it again
        await publisher.js.delete_consumer(CMD_STREAM.name, "lost-test")
        await publisher.publish_command(DeleteInstance(command_id="c-after", instance_id="i"))
        assert (await asyncio.wait_for(handled.get(), 5)).command_id == "c-after"
        assert not consuming.done()
    finally:
        consuming.cancel()
        await asyncio.gather(consuming, return_exceptions=True)


async def test_wait_connected_gives_up_at_its_deadline_and_at_once_when_closed(nats, connect):
    bus = await connect("waiter")
    assert await bus.wait_connected(0.1)
    nats.kill()
    await until_disconnected(bus)
    started = time.monotonic()
    assert not await bus.wait_connected(0.3)
    assert 0.25 <= time.monotonic() - started < 1.0
    await bus.nc.close()
    started = time.monotonic()
    assert not await bus.wait_connected(5)
    assert time.monotonic() - started < 0.2
    with pytest.raises(BusUnavailable, match="closed"):
        await bus.publish_event(NodeLeft(node_id="n", origin="t"))
