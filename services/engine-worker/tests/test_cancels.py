"""Cancels that come before their task runs (fleet_worker.cancels), on a real nats-server."""

from __future__ import annotations

import asyncio

import msgspec

from fleet_bus import Bus, Delivery
from fleet_proto import GenerateTask, SamplingParams, TokenChunk
from fleet_worker.cancels import RecentCancels, honouring_early_cancels


def test_recent_cancels_forget_after_a_while_and_beyond_their_size():
    now = [0.0]
    cancels = RecentCancels(keep_s=10, max_entries=3, clock=lambda: now[0])
    cancels.add("a")
    now[0] = 5
    cancels.add("b")
    assert "a" in cancels and "b" in cancels and "c" not in cancels
    now[0] = 11
    assert "a" not in cancels and "b" in cancels  # too old
    cancels.add("c")  # drops "a" on the way
    assert len(cancels) == 2
    for request_id in ("d", "e"):
        cancels.add(request_id)
    assert len(cancels) == 3 and [r for r in "bcde" if r in cancels] == ["c", "d", "e"]  # "b": the oldest


def task(request_id: str) -> GenerateTask:
    return GenerateTask(
        request_id=request_id,
        instance_id="inst-1",
        prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(max_tokens=300),
    )


async def test_a_task_cancelled_while_queued_never_starts_and_one_cancelled_while_starting_stops(fresh_nats):
    bus = await Bus.connect(fresh_nats.url, "cancels-test")
    try:
        tokens = await bus.nc.subscribe("fleet.tok.>")
        cancels, started, cancelled = RecentCancels(), [], []
        gate = asyncio.Event()

        async def on_task(task: GenerateTask, _: Delivery) -> None:
            started.append(task.request_id)
            if task.request_id == "while-starting":
                await gate.wait()  # as InstanceManager.on_task awaits a KV prefetch

        handle = honouring_early_cancels(bus, cancels, on_task, cancelled.append)
        delivery = Delivery(stream_seq=1, attempt=1)

        cancels.add("queued")  # its cancel came before the worker fetched it
        await handle(task("queued"), delivery)
        assert started == [] and cancelled == []
        chunk = msgspec.json.decode((await tokens.next_msg(timeout=2)).data, type=TokenChunk)
        assert (chunk.request_id, chunk.index, chunk.finish_reason) == ("queued", 0, "cancelled")

        starting = asyncio.ensure_future(handle(task("while-starting"), delivery))
        await asyncio.sleep(0.01)
        cancels.add("while-starting")  # the manager's cancel found no engine request yet
        gate.set()
        await starting
        assert started == ["while-starting"] and cancelled == ["while-starting"]

        await handle(task("plain"), delivery)
        assert started[-1] == "plain" and cancelled == ["while-starting"]
    finally:
        await bus.close()
