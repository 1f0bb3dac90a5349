"""fleet_bus against a real nats-server with JetStream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from fleet_bus import (
    Bus,
    BusUnavailable,
    Delivery,
    RequestFailed,
    StateFollower,
    StreamBroken,
    TokenStreamReader,
    consume_commands,
    ensure_streams,
    publish_chunk,
)
from fleet_local.processes import free_port
from fleet_proto import (
    CancelRequest,
    Command,
    CreateInstance,
    DeleteInstance,
    Instance,
    InstancePlaced,
    InstanceReady,
    NodeLeft,
    ServiceStopped,
    TokenChunk,
    replay,
)
from fleet_proto.subjects import CMD_STREAM, EVT_STREAM, STREAMS, TASK_STREAM


async def connected(url: str, name: str = "test") -> Bus:
    bus = await Bus.connect(url, name)
    await ensure_streams(bus.js)
    return bus


async def test_ensure_streams_is_idempotent_and_sets_retention(fresh_nats):
    bus = await connected(fresh_nats.url)
    try:
        await ensure_streams(bus.js)  # second call: no error, same streams
        await ensure_streams(bus.js)
        names = {info.config.name for info in await bus.js.streams_info()}
        assert {s.name for s in STREAMS} <= names
        assert (await bus.js.stream_info(CMD_STREAM.name)).config.retention == "workqueue"
        assert (await bus.js.stream_info(TASK_STREAM.name)).config.retention == "workqueue"
        assert (await bus.js.stream_info(EVT_STREAM.name)).config.retention == "limits"
        assert await bus.js.key_value("fleet-state") is not None
    finally:
        await bus.close()


async def test_unreachable_nats_is_a_clear_error_within_the_deadline():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(BusUnavailable, match=f"127.0.0.1:{port}"):
        await Bus.connect(f"nats://127.0.0.1:{port}", "test", connect_deadline_s=1.5)
    assert time.monotonic() - started < 5


async def test_command_is_redelivered_when_its_consumer_dies_without_ack(fresh_nats):
    publisher = await connected(fresh_nats.url)
    doomed = await connected(fresh_nats.url, "doomed")
    survivor = await connected(fresh_nats.url, "survivor")
    first_seen = asyncio.Event()

    async def hang(command: Command, delivery: Delivery) -> None:
        first_seen.set()
        await asyncio.Event().wait()  # never returns: the process "dies" while handling

    received: asyncio.Queue[tuple[Command, Delivery]] = asyncio.Queue()

    async def record(command: Command, delivery: Delivery) -> None:
        await received.put((command, delivery))

    command = CreateInstance(command_id="c-1", model_id="m", instance_id="i-1")
    doomed_task = asyncio.create_task(
        consume_commands(doomed, "scheduler", (CreateInstance,), hang, ack_wait_s=1.0)
    )
    try:
        await publisher.publish_command(command)
        await asyncio.wait_for(first_seen.wait(), 5)
        doomed_task.cancel()
        await doomed.nc.close()  # gone without ack
        survivor_task = asyncio.create_task(
            consume_commands(survivor, "scheduler", (CreateInstance,), record, ack_wait_s=1.0)
        )
        got, delivery = await asyncio.wait_for(received.get(), 10)
        assert got == command
        assert delivery.attempt == 2
        # acked now: the work queue is empty, nothing is delivered again
        await asyncio.sleep(1.5)
        assert received.empty()
        assert (await publisher.js.stream_info(CMD_STREAM.name)).state.messages == 0
        survivor_task.cancel()
        await asyncio.gather(survivor_task, return_exceptions=True)
    finally:
        await publisher.close()
        await survivor.close()


async def test_failed_handler_is_retried_and_undecodable_command_is_dropped(fresh_nats):
    bus = await connected(fresh_nats.url)
    attempts: list[int] = []
    done = asyncio.Event()

    async def flaky(command: Command, delivery: Delivery) -> None:
        attempts.append(delivery.attempt)
        if delivery.attempt < 2:
            raise RuntimeError("transient")
        done.set()

    await bus.js.publish("fleet.cmd.delete_instance", b'{"kind":"no_such_command"}')
    await bus.publish_command(DeleteInstance(command_id="c-2", instance_id="i-2"))
    task = asyncio.create_task(consume_commands(bus, "scheduler", (DeleteInstance,), flaky))
    try:
        await asyncio.wait_for(done.wait(), 10)
        assert attempts == [1, 2]
        await asyncio.sleep(0.3)
        assert (await bus.js.stream_info(CMD_STREAM.name)).state.messages == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await bus.close()


async def test_events_are_readable_json_on_fleet_wildcard(fresh_nats):
    bus = await connected(fresh_nats.url)
    watcher = await connected(fresh_nats.url, "watcher")
    try:
        sub = await watcher.nc.subscribe("fleet.>")
        await watcher.nc.flush()  # the server knows the subscription before we publish
        await bus.publish_event(NodeLeft(node_id="n-1", reason="test"))
        msg = await sub.next_msg(timeout=5)
        assert msg.subject == "fleet.evt.node_left"
        assert json.loads(msg.data) == {
            "kind": "node_left",
            "node_id": "n-1",
            "reason": "test",
            "origin": "",
            "at": 0.0,
        }
    finally:
        await watcher.close()
        await bus.close()


async def test_followers_rebuild_the_same_state_from_the_stream(fresh_nats):
    bus = await connected(fresh_nats.url)
    instance = Instance(instance_id="i-1", model_id="m", node_id="n", engine="mlx")
    events = [
        InstancePlaced(instance=instance),
        InstanceReady(instance_id="i-1"),
        ServiceStopped(service_id="x"),
    ]
    try:
        seqs = [await bus.publish_event(e) for e in events]
        first, second = StateFollower(bus), StateFollower(bus)
        await first.start()
        await second.start()
        assert first.state == second.state == replay(zip(seqs, events, strict=True))
        assert first.state.instances["i-1"].status == "ready"
        async with first.listen() as live:
            seq = await bus.publish_event(NodeLeft(node_id="n"))
            got_seq, got = await asyncio.wait_for(anext(live), 5)
        assert (got_seq, got) == (seq, NodeLeft(node_id="n"))
        await first.stop()
        await second.stop()
    finally:
        await bus.close()


async def test_request_reply_and_no_responders(fresh_nats):
    bus = await connected(fresh_nats.url)

    async def echo(request: CancelRequest) -> CancelRequest:
        return CancelRequest(request_id=request.request_id, reason="echo")

    try:
        await bus.serve("fleet.test.echo", CancelRequest, echo)
        reply = await bus.request("fleet.test.echo", CancelRequest(request_id="r"), CancelRequest, 2)
        assert reply == CancelRequest(request_id="r", reason="echo")
        with pytest.raises(RequestFailed, match="nobody serves"):
            await bus.request("fleet.test.nobody", CancelRequest(request_id="r"), CancelRequest, 2)
    finally:
        await bus.close()


async def test_token_stream_in_order_then_stall_and_gap_are_errors(fresh_nats):
    bus = await connected(fresh_nats.url)
    try:
        reader = await TokenStreamReader(bus, "r-1", stall_timeout_s=1.0).open()
        await publish_chunk(bus, TokenChunk(request_id="r-1", index=0, token_ids=(1, 2)))
        await publish_chunk(bus, TokenChunk(request_id="r-1", index=1, token_ids=(3,), finish_reason="stop"))
        assert [c.token_ids for c in [c async for c in reader.chunks()]] == [(1, 2), (3,)]
        await reader.close()

        stalled = await TokenStreamReader(bus, "r-2", stall_timeout_s=0.5).open()
        await publish_chunk(bus, TokenChunk(request_id="r-2", index=0, token_ids=(1,)))
        with pytest.raises(StreamBroken, match="no tokens"):
            [c async for c in stalled.chunks()]
        await stalled.close()

        gapped = await TokenStreamReader(bus, "r-3", stall_timeout_s=1.0).open()
        await publish_chunk(bus, TokenChunk(request_id="r-3", index=1, token_ids=(1,)))
        with pytest.raises(StreamBroken, match="expected 0"):
            [c async for c in gapped.chunks()]
        await gapped.close()
    finally:
        await bus.close()


async def dead() -> bool:
    return False


async def test_token_stream_ends_within_seconds_when_the_producer_is_dead(fresh_nats):
    bus = await connected(fresh_nats.url)
    try:
        reader = await TokenStreamReader(
            bus, "r-4", stall_timeout_s=60, producer_alive=dead, poll_s=0.2
        ).open()
        started = time.monotonic()
        with pytest.raises(StreamBroken, match="stopped responding"):
            [c async for c in reader.chunks()]
        assert time.monotonic() - started < 2
        await reader.close()
    finally:
        await bus.close()


async def test_a_reader_cancelled_while_opening_leaves_the_connection_working(fresh_nats):
    """A client that hangs up while the gateway opens its token stream cancels open() in flush():
    nats-py would leave the cancelled PONG future queued, and resolving it when the PONG comes
    kills the client's read loop (InvalidStateError), so nothing is received any more (the soak
    found it: every request after it failed). Nor may the subscription outlive the reader."""
    bus = await connected(fresh_nats.url)
    try:
        baseline = len(bus.nc._subs)
        for yields in range(8):  # cancel at each await open() passes through, flush's wait included
            opening = asyncio.ensure_future(TokenStreamReader(bus, f"r-{yields}", stall_timeout_s=1).open())
            for _ in range(yields):
                await asyncio.sleep(0)
            opening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await opening
        await asyncio.sleep(0.2)  # the PONGs of the cancelled flushes arrive
        reader = await asyncio.wait_for(TokenStreamReader(bus, "r-after", stall_timeout_s=1).open(), 2)
        await publish_chunk(bus, TokenChunk(request_id="r-after", index=0, finish_reason="stop"))
        assert [c.finish_reason async for c in reader.chunks()] == ["stop"]
        await reader.close()
        assert len(bus.nc._subs) == baseline
    finally:
        await bus.close()


async def collect_chunks(reader: TokenStreamReader) -> list[TokenChunk]:
    return [chunk async for chunk in reader.chunks()]


async def test_a_cancel_that_comes_with_a_chunk_is_not_swallowed(fresh_nats):
    """The gateway's handler is cancelled when its client hangs up; if that lands as a chunk
    arrives, the wait_for inside nats-py's next_msg (Python 3.11) returns the chunk and drops the
    cancel: the reader must still stop (else the request runs to its end for nobody)."""
    bus = await connected(fresh_nats.url)
    try:
        for n in range(40):  # the cancel at each point of the chunk's way in
            reader = await TokenStreamReader(bus, f"r-{n}", stall_timeout_s=5).open()
            reading = asyncio.ensure_future(collect_chunks(reader))
            await asyncio.sleep(0.01)
            await publish_chunk(bus, TokenChunk(request_id=f"r-{n}", index=0, token_ids=(1,)))
            await bus.nc.flush()
            for _ in range(n % 10):
                await asyncio.sleep(0)
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(reading, 1)  # TimeoutError here: the cancel was swallowed
            await reader.close()
    finally:
        await bus.close()


async def test_kv_lock_admits_one_holder_at_a_time(fresh_nats):
    from fleet_bus import kv_lock
    from fleet_bus.locks import lock_key

    a, b = await connected(fresh_nats.url, "a"), await connected(fresh_nats.url, "b")
    order: list[str] = []

    async def hold(bus: Bus, who: str) -> None:
        async with kv_lock(bus, "org/model", who, retry_every_s=0.05):
            order.append(f"{who} in")
            await asyncio.sleep(0.3)
            order.append(f"{who} out")

    try:
        await asyncio.gather(hold(a, "a"), hold(b, "b"))
        assert order in (["a in", "a out", "b in", "b out"], ["b in", "b out", "a in", "a out"])
        assert lock_key("org/model") == lock_key("org/model") != lock_key("org_model")
    finally:
        await a.close()
        await b.close()
