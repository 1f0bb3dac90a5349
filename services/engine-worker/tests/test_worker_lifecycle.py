"""A worker's instances following State, on fake engines and fake model files (worker_fakes):
what it reports while loading, a crashed engine restarted, an instance deleted or drained, a
failed load reported (none of it needs NATS, S3 or an engine process)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fleet_proto import (
    InstanceDeleted,
    InstanceFailed,
    InstanceLoading,
    InstanceReady,
    InstanceStatus,
    InstanceStatusChanged,
    State,
)
from fleet_proto.messages import UNAVAILABLE
from fleet_runtime.tracing import Tracing
from fleet_worker.calibrating import Calibration, Calibrator
from fleet_worker.disaggregation import PrefillSide
from fleet_worker.lifecycle import Lifecycle
from fleet_worker.running import RunningInstance
from fleet_worker.serving import RequestServer

from .worker_fakes import Chunks, FakeEngine, instance, output, settle, task

pytestmark = pytest.mark.unit


class FakeModelFiles:
    """Model files that are always there at once; records pins."""

    def __init__(self) -> None:
        self.pinned: set[str] = set()

    async def fetch(self, instance, progress):
        self.pinned.add(instance.instance_id)
        return None, Path("/models/m")

    def release(self, instance) -> None:
        self.pinned.discard(instance.instance_id)


class Node:
    def __init__(self, fail_load: str = "", drain_grace_s: float = 5.0) -> None:
        self.events: list = []
        self.engines: list[FakeEngine] = []
        self.files = FakeModelFiles()
        self.state = State()
        self.chunks = Chunks()
        running: dict[str, RunningInstance] = {}
        tracing = Tracing("engine-worker", "test-worker")
        self.server = RequestServer("n1", running, self.chunks.publish, tracing, PrefillSide("n1"))

        async def start_engine(engine, folder, options, timeout_s, on_progress=None, stream_interval_s=0.0):
            if fail_load:
                raise RuntimeError(fail_load)
            if on_progress is not None:
                on_progress(1, 1)
            self.engines.append(FakeEngine(pid=len(self.engines) + 1, answers=True))
            return self.engines[-1]

        async def publish(event) -> None:
            self.events.append(event)

        self.lifecycle = Lifecycle(
            running,
            "n1",
            "engine-worker-1",
            lambda: self.state,
            publish,
            self.files,
            start_engine,
            self.server,
            Calibrator(Calibration(), {}),
            drain_grace_s=drain_grace_s,
        )

    async def place(self, **fields) -> None:
        placed = instance(**fields)
        self.state = State(instances={placed.instance_id: placed})
        await self.lifecycle.reconcile(self.state)

    async def until(self, condition, what: str) -> None:
        for _ in range(200):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"never: {what}; events {self.events}")

    def kinds(self) -> list[str]:
        return [
            f"{type(e).__name__}:{e.status.value}"
            if isinstance(e, InstanceStatusChanged)
            else type(e).__name__
            for e in self.events
        ]


async def test_a_placed_instance_is_loaded_warmed_up_and_reported_ready() -> None:
    node = Node()
    await node.place()
    await node.until(lambda: "i1" in node.lifecycle.running, "running")
    assert node.kinds() == [
        "InstanceStatusChanged:downloading",
        "InstanceLoading",
        "InstanceLoading",  # the engine's weights, all loaded
        "InstanceStatusChanged:warming",
        "InstanceReady",
    ]
    assert all(e.origin == "engine-worker-1" and e.at for e in node.events)
    assert [r.request_id for r in node.engines[0].submitted] == ["warmup-i1"]
    assert node.files.pinned == {"i1"}
    await node.lifecycle.close()
    assert node.engines[0].stopped and not node.files.pinned


async def test_a_crashed_engine_is_reported_and_loaded_again() -> None:
    node = Node()
    await node.place()
    await node.until(lambda: "i1" in node.lifecycle.running, "running")
    node.engines[0].die("killed by signal 9")
    await node.until(lambda: len(node.engines) == 2 and "i1" in node.lifecycle.running, "restarted")
    (failed,) = [e for e in node.events if isinstance(e, InstanceFailed)]
    assert failed.reason.startswith("killed by signal 9; restarting it (restart 1 of")
    assert sum(isinstance(e, InstanceReady) for e in node.events) == 2
    await node.lifecycle.close()


async def test_an_instance_gone_from_state_is_unloaded() -> None:
    node = Node()
    await node.place()
    await node.until(lambda: "i1" in node.lifecycle.running, "running")
    await node.lifecycle.reconcile(State())
    assert not node.lifecycle.running and node.engines[0].stopped and not node.files.pinned
    assert not any(isinstance(e, InstanceFailed) for e in node.events)  # an unload is no crash


async def test_a_draining_instance_finishes_its_requests_then_is_deleted() -> None:
    node = Node()
    await node.place()
    await node.until(lambda: "i1" in node.lifecycle.running, "running")
    engine = node.engines[0]
    engine.answers = False
    await node.server.on_task(task("r1"))
    await node.place(status=InstanceStatus.DRAINING)
    await settle()
    await node.server.on_task(task("r2"))  # refused: it drains
    assert not any(isinstance(e, InstanceDeleted) for e in node.events) and not engine.stopped
    engine.emit(output("r1", 5, done=1), output("r1", done=1, finish="length"))
    await node.until(lambda: any(isinstance(e, InstanceDeleted) for e in node.events), "deleted")
    assert engine.stopped and not engine.cancelled
    assert [c.finish_reason for c in node.chunks.of("r1")] == ["", "length"]
    assert node.chunks.of("r2")[0].finish_reason == "error"


async def serving_r1(node: Node) -> FakeEngine:
    """The node's instance running, with request r1 in its engine; the engine."""
    await node.place()
    await node.until(lambda: "i1" in node.lifecycle.running, "running")
    engine = node.engines[0]
    engine.answers = False
    await node.server.on_task(task("r1"))
    return engine


async def test_requests_still_running_after_the_drain_grace_move_on() -> None:
    node = Node(drain_grace_s=0.05)
    engine = await serving_r1(node)
    engine.emit(output("r1", 5, done=1))
    await node.place(status=InstanceStatus.DRAINING)
    await node.until(lambda: any(isinstance(e, InstanceDeleted) for e in node.events), "deleted")
    chunks = node.chunks.of("r1")
    assert [(c.token_ids, c.finish_reason, c.error_kind) for c in chunks] == [
        ((5,), "", ""),
        ((), "error", UNAVAILABLE),  # its gateway resumes it elsewhere after token 5
    ]
    assert "deleted" in chunks[-1].error and engine.cancelled == ["r1"] and engine.stopped


async def test_a_stopping_worker_moves_its_requests_and_says_its_instances_are_placed_again() -> None:
    node = Node(drain_grace_s=0.05)
    engine = await serving_r1(node)
    await node.lifecycle.leave()
    assert [(c.finish_reason, c.error_kind) for c in node.chunks.of("r1")] == [("error", UNAVAILABLE)]
    placed = [e for e in node.events if isinstance(e, InstanceStatusChanged) and e.status == "placed"]
    assert [e.instance_id for e in placed] == ["i1"]  # not routed to until this worker loads it again
    assert engine.stopped and not node.lifecycle.running
    await node.lifecycle.reconcile(node.state)  # the instance is still placed here: not loaded again
    await settle()
    assert len(node.engines) == 1 and not node.lifecycle.running


async def test_a_failed_load_is_reported_with_its_reason() -> None:
    node = Node(fail_load="not enough memory for the weights")
    await node.place()
    await node.until(lambda: any(isinstance(e, InstanceFailed) for e in node.events), "failed")
    (failed,) = [e for e in node.events if isinstance(e, InstanceFailed)]
    assert failed.reason == "not enough memory for the weights" and failed.origin == "engine-worker-1"
    assert not node.lifecycle.running and not node.files.pinned
    assert isinstance(node.events[0], InstanceStatusChanged) and isinstance(node.events[1], InstanceLoading)
