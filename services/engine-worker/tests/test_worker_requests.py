"""Requests on a worker's instance, without an engine process or NATS (fakes from worker_fakes):
each request's chunks are numbered by its RequestStream alone, in order, whoever produced them
(the engine, or a prefill worker's first token); its end releases what it held; a cancel is never
lost between intake and the engine; both sides of a handoff."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from fleet_proto import PrefillPlan, PrefillRequest, SamplingParams
from fleet_proto.messages import TASK_TTL_S, UNAVAILABLE
from fleet_runtime.tracing import Tracing
from fleet_store.handoff import decode_chunk, read_folder
from fleet_worker.calibration import warm_up_request
from fleet_worker.disaggregation import DecodeSide, PrefillSide, export_request_id
from fleet_worker.running import RunningInstance
from fleet_worker.serving import RequestServer

from .worker_fakes import Chunks, FakeEngine, FakeHandoffs, FakeKV, instance, output, settle, task

pytestmark = pytest.mark.unit

TRACING = Tracing("engine-worker", "test-worker")


class Worker:
    """One instance on a fake engine behind a RequestServer (with a fake KV tier and handoffs)."""

    def __init__(self, engine: str = "mlx", handoffs: FakeHandoffs | None = None, **fields) -> None:
        self.engine = FakeEngine()
        self.kv = FakeKV()
        self.chunks = Chunks()
        self.running = RunningInstance(instance(engine=engine, **fields), self.engine, kv_fingerprint="fp")
        self.prefill_side = PrefillSide("n1")
        decode = DecodeSide(handoffs, TRACING, lambda _: None, self.kv, 4) if handoffs is not None else None
        self.server = RequestServer(
            "n1", {"i1": self.running}, self.chunks.publish, TRACING, self.prefill_side, decode, self.kv, 4
        )
        self.exited: list[RunningInstance] = []

    async def start_pump(self) -> None:
        async def on_exit(running: RunningInstance) -> None:
            self.exited.append(running)

        self.pump = asyncio.create_task(self.server.pump(self.running, on_exit))


async def test_chunks_are_numbered_in_order_and_the_end_releases_what_the_request_held() -> None:
    worker = Worker()
    await worker.start_pump()
    await worker.server.on_task(task("r1", prompt=9, block_hashes=("a", "b", "c")))
    assert [r.request_id for r in worker.engine.submitted] == ["r1"]
    assert worker.running.queued_tokens() == 9 and worker.running.running_tokens() == 0
    assert not worker.running.idle.is_set()
    worker.engine.emit(output("r1", 5, done=1), output("r1", 6, done=2))
    await settle()
    assert worker.running.running_tokens() == 9 + 2 and worker.running.queued_tokens() == 0
    # a turn routed to its history: waiting, it weighs what routing expected it to compute
    await worker.server.on_task(task("r2", prompt=100, expected_cached_tokens=96))
    assert worker.running.queued_tokens() == 4
    worker.engine.emit(output("r2", 5, done=1))
    await settle()
    assert worker.running.queued_tokens() == 0 and worker.running.running_tokens() == 9 + 2 + 100 + 1
    worker.engine.emit(output("r2", 6, done=2, finish="length"))
    worker.engine.emit(output("r1", 7, done=3, finish="length"), output("r1", 8, done=4))
    await settle()
    chunks = worker.chunks.of("r1")
    assert [(c.index, c.token_ids, c.finish_reason) for c in chunks] == [
        (0, (5,), ""),
        (1, (6,), ""),
        (2, (7,), "length"),
    ]  # the output after the end is dropped
    assert worker.kv.released == [Path("/kv/a"), Path("/kv/b")]  # blocks of the first 8 prompt tokens
    assert worker.running.in_flight() == 0 and worker.running.idle.is_set()


async def test_a_task_for_an_instance_not_here_or_draining_ends_at_once() -> None:
    worker = Worker()
    await worker.server.on_task(task("r1", instance_id="elsewhere"))
    worker.running.draining = object()  # type: ignore[assignment]
    await worker.server.on_task(task("r2"))
    assert [(c.request_id, c.index, c.finish_reason) for c in worker.chunks.sent] == [
        ("r1", 0, "error"),
        ("r2", 0, "error"),
    ]
    assert "not running on n1" in worker.chunks.sent[0].error and not worker.engine.submitted
    assert {c.error_kind for c in worker.chunks.sent} == {UNAVAILABLE}  # the gateway moves them on


async def test_a_task_its_gateway_gave_up_on_long_ago_is_dropped() -> None:
    worker = Worker()
    stale = time.time_ns() - int((TASK_TTL_S + 60) * 1e9)
    await worker.server.on_task(task("r1", sent_at_ns=stale))
    await worker.server.on_task(task("r2", sent_at_ns=time.time_ns()))
    assert [r.request_id for r in worker.engine.submitted] == ["r2"]
    [dropped] = worker.chunks.of("r1")
    assert dropped.finish_reason == "error" and "dropped" in dropped.error


async def test_a_continuation_reaches_the_engine_with_the_tokens_already_sent() -> None:
    worker = Worker()
    await worker.server.on_task(task("r1-m1", generated_token_ids=(5, 6)))
    [submitted] = worker.engine.submitted
    assert submitted.generated_token_ids == (5, 6) and submitted.prompt_token_ids == tuple(range(1, 9))


async def test_moving_an_instances_streams_ends_each_as_unavailable_and_cancels_its_work() -> None:
    worker = Worker()
    await worker.start_pump()
    await worker.server.on_task(task("r1"))
    worker.engine.emit(output("r1", 5, done=1))
    await settle()
    await worker.server.move(worker.running, "worker n1 is stopping")
    worker.engine.emit(output("r1", 6, done=2))  # after the move: dropped
    await settle()
    chunks = worker.chunks.of("r1")
    assert [(c.index, c.token_ids, c.finish_reason, c.error_kind) for c in chunks] == [
        (0, (5,), "", ""),
        (1, (), "error", UNAVAILABLE),
    ]
    assert "worker n1 is stopping" in chunks[-1].error
    assert worker.engine.cancelled == ["r1"] and worker.running.idle.is_set()


async def test_a_cancel_while_the_kv_is_fetched_is_not_lost() -> None:
    worker = Worker()
    worker.kv.gate.clear()

    intake = asyncio.create_task(worker.server.on_task(task("r1", block_hashes=("a",))))
    await settle()
    worker.server.cancel("r1")  # the engine does not have it yet
    worker.kv.gate.set()
    await intake
    assert not worker.engine.submitted and not worker.engine.cancelled
    assert [(c.index, c.finish_reason) for c in worker.chunks.of("r1")] == [(0, "cancelled")]
    assert worker.kv.released == [Path("/kv/a")] and worker.running.idle.is_set()


async def test_a_cancel_after_submission_goes_to_the_engine() -> None:
    worker = Worker()
    await worker.server.on_task(task("r1"))
    worker.server.cancel("r1")
    worker.server.cancel("unknown")
    assert worker.engine.cancelled == ["r1"]


async def test_the_workers_own_requests_get_their_final_output_and_no_chunks() -> None:
    worker = Worker()
    await worker.start_pump()
    waiting = asyncio.create_task(worker.server.run_internal(worker.running, warm_up_request("w"), 5))
    await settle()
    worker.engine.emit(output("w", 1, done=1), output("w", done=1, finish="length"))
    final = await waiting
    assert final.finish_reason == "length" and not worker.chunks.sent and not worker.running.internal


async def test_the_pump_reports_the_engines_exit_after_its_last_outputs() -> None:
    worker = Worker()
    await worker.start_pump()
    await worker.server.on_task(task("r1"))
    worker.engine.emit(output("r1", done=0, finish="error", error="engine died"))
    worker.engine.die()
    await worker.pump
    assert worker.exited == [worker.running]
    assert worker.chunks.of("r1")[-1].error == "engine died"


# -- the decode side of a handoff ---------------------------------------------------------------
PLAN = PrefillPlan(instance_id="p1", worker_id="w2", transport="stream")


async def test_a_prefill_workers_first_token_is_chunk_0_and_the_engine_goes_on_from_it() -> None:
    handoffs = FakeHandoffs(first_token=42)
    worker = Worker(engine="llamacpp", handoffs=handoffs)
    await worker.start_pump()
    await worker.server.on_task(task("r1", prefill=PLAN))
    await settle()
    assert [(c.index, c.token_ids) for c in worker.chunks.of("r1")] == [(0, (42,))]
    assert not worker.engine.submitted  # the KV is still on its way
    assert worker.running.running_tokens() == 8 + 1
    handoffs.arrived.set()
    await settle()
    (submitted,) = worker.engine.submitted
    assert submitted.kv_import is not None and submitted.kv_import.first_token == 42
    worker.engine.emit(output("r1", 43, done=2), output("r1", done=2, finish="length"))
    await settle()
    chunks = worker.chunks.of("r1")
    assert [c.index for c in chunks] == [0, 1, 2] and chunks[1].token_ids == (43,)
    assert chunks[-1].handoff is not None and chunks[-1].handoff.bytes == 1000
    assert handoffs.asked == [("r1", 0, "")]  # llama.cpp keeps its own KV: no wire dtype


async def test_a_remote_prefills_progress_goes_out_before_the_first_token() -> None:
    handoffs = FakeHandoffs(progress=(3, 6))
    worker = Worker(handoffs=handoffs)
    await worker.start_pump()
    await worker.server.on_task(task("r1", prefill=PLAN))
    await settle()
    progress = [(c.index, c.prefilled_tokens, c.token_ids) for c in worker.chunks.of("r1")]
    assert progress == [(0, 3, ()), (1, 6, ())]
    handoffs.arrived.set()
    await settle()
    worker.engine.emit(output("r1", 43, done=1), output("r1", done=1, finish="length"))
    await settle()
    assert [c.index for c in worker.chunks.of("r1")] == [0, 1, 2, 3]


async def test_a_failed_handoff_after_the_first_token_prefills_here_from_that_token() -> None:
    handoffs = FakeHandoffs(first_token=42, failure="the prefill worker went away")
    handoffs.arrived.set()
    worker = Worker(engine="llamacpp", handoffs=handoffs)
    await worker.server.on_task(task("r1", prefill=PLAN))
    await settle()
    (submitted,) = worker.engine.submitted
    assert submitted.kv_import is not None and (
        submitted.kv_import.folder,
        submitted.kv_import.first_token,
    ) == (
        "",
        42,
    )
    worker.engine.emit(output("r1", done=1, finish="length"))
    await worker.start_pump()
    await settle()
    last = worker.chunks.of("r1")[-1]
    assert (last.index, last.handoff.fallback) == (1, "the prefill worker went away")


async def test_a_cancel_while_the_kv_travels_ends_the_stream_after_the_token_it_sent() -> None:
    handoffs = FakeHandoffs(first_token=42)
    worker = Worker(engine="llamacpp", handoffs=handoffs)
    await worker.server.on_task(task("r1", prefill=PLAN, block_hashes=("a", "b")))
    await settle()
    worker.server.cancel("r1")
    await settle()
    assert [(c.index, c.finish_reason) for c in worker.chunks.of("r1")] == [(0, ""), (1, "cancelled")]
    assert not worker.engine.submitted and not worker.engine.cancelled
    assert worker.kv.released == [Path("/kv/a")] and worker.running.idle.is_set()


async def test_an_engine_gone_while_the_kv_travelled_ends_the_request_with_an_error() -> None:
    handoffs = FakeHandoffs()
    worker = Worker(engine="mlx", handoffs=handoffs)
    await worker.server.on_task(task("r1", prefill=PLAN))
    worker.engine.die()
    handoffs.arrived.set()
    await settle()
    (chunk,) = worker.chunks.of("r1")
    assert (chunk.index, chunk.finish_reason) == (0, "error") and "exited" in chunk.error


async def test_the_handoff_starts_after_the_prefix_this_node_holds() -> None:
    handoffs = FakeHandoffs()
    worker = Worker(engine="mlx", handoffs=handoffs)
    worker.kv.held_blocks = 1
    await worker.server.on_task(task("r1", prompt=12, prefill=PLAN, block_hashes=("a", "b")))
    await settle()
    assert handoffs.asked == [("r1", 4, "")]


# -- the prefill side ---------------------------------------------------------------------------
def prefill_request(handoff_id: str = "h1", **fields) -> PrefillRequest:
    return PrefillRequest(
        handoff_id=handoff_id, request_id="r9", instance_id="i1", prompt_token_ids=(1, 2, 3), **fields
    )


@pytest.mark.parametrize(
    ("engine", "role", "why"),
    [("echo", "both", "cannot prefill"), ("mlx", "decode", "only decodes")],
)
def test_an_export_is_refused_by_an_engine_or_role_that_cannot_prefill(
    engine: str, role: str, why: str
) -> None:
    worker = Worker(engine=engine, role=role)
    assert why in worker.prefill_side.start_export(worker.running, prefill_request(), Path("/out"))
    assert "not running" in worker.prefill_side.start_export(None, prefill_request(), Path("/out"))
    assert not worker.engine.submitted


async def test_an_export_runs_one_greedy_token_unless_the_engine_samples_the_first(tmp_path: Path) -> None:
    worker = Worker(engine="vllm")
    asked = SamplingParams(temperature=0.7, max_tokens=50)
    assert worker.prefill_side.start_export(worker.running, prefill_request(sampling=asked), tmp_path) == ""
    (submitted,) = worker.engine.submitted
    assert submitted.request_id == export_request_id("h1")
    assert (submitted.sampling.temperature, submitted.sampling.max_tokens) == (0.7, 1)
    assert submitted.export is not None and submitted.export.sample_first
    assert worker.running.queued_tokens() == 3 and not worker.running.idle.is_set()
    mlx = Worker(engine="mlx")
    mlx.prefill_side.start_export(mlx.running, prefill_request(sampling=asked), tmp_path)
    assert mlx.engine.submitted[0].sampling.temperature == 0.0
    worker.prefill_side.cancel_export(worker.running, prefill_request())
    assert worker.engine.cancelled == [export_request_id("h1")]


async def test_an_export_that_ends_short_tells_its_reader(tmp_path: Path) -> None:
    worker = Worker(engine="mlx")
    await worker.start_pump()
    worker.prefill_side.start_export(worker.running, prefill_request(), tmp_path)
    worker.engine.emit(output(export_request_id("h1"), done=0, finish="error", error="out of memory"))
    await settle()
    assert not worker.running.exports and worker.running.idle.is_set() and not worker.chunks.sent
    (chunk,) = [decode_chunk(blob, "h1") for blob in read_folder(tmp_path)]
    assert (chunk.kind, chunk.reason) == ("error", "out of memory")
