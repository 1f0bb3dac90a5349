"""Clients' requests on this worker's instances: intake, the engine's outputs, cancels.

A task taken from the work queue becomes a `RequestStream` on its instance (refused at once when
the instance is not here or drains), gets its prompt's KV blocks from the shared tier, goes to the
engine (or first through a handoff, disaggregation.py) and streams until its last output. Each
instance's engine outputs are pumped here: to the client's stream, to an export for another worker,
or to one of the worker's own requests (warm-up, calibration).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial

from fleet_bus.trace_context import is_sampled, remote_context
from fleet_proto import EmbedTask, TokenChunk
from fleet_proto.messages import TASK_TTL_S, UNAVAILABLE, GenerationOutput, WorkerTask
from fleet_runtime.tracing import Tracing, now_ns
from fleet_worker.disaggregation import DecodeSide, PrefillSide
from fleet_worker.engines.base import EngineOutput, EngineRequest, KVImport
from fleet_worker.kv_tier import WorkerKV
from fleet_worker.request_stream import Publish, RequestStream
from fleet_worker.request_trace import record_request, start_request_trace
from fleet_worker.running import RunningInstance, reusable_hashes

log = logging.getLogger("fleet_worker")


class RequestServer:
    def __init__(
        self,
        node_id: str,
        instances: Mapping[str, RunningInstance],
        publish: Publish,
        tracing: Tracing,
        prefill_side: PrefillSide,
        decode_side: DecodeSide | None = None,
        kv: WorkerKV | None = None,
        kv_block_size: int = 0,
    ) -> None:
        self._node_id = node_id
        self._instances = instances  # the lifecycle's running instances (read only here)
        self._publish = publish
        self._tracing = tracing
        self._prefill_side = prefill_side
        self._decode_side = decode_side
        self._kv = kv
        self._kv_block_size = kv_block_size

    async def on_task(self, task: WorkerTask) -> None:
        age_s = (time.time_ns() - task.sent_at_ns) / 1e9 if task.sent_at_ns else 0.0
        if age_s > TASK_TTL_S:  # its gateway gave up long ago (this worker was down meanwhile)
            log.warning("task %s is %.0f s old: dropped", task.request_id, age_s)
            error = f"request {task.request_id} waited {age_s:.0f} s for {self._node_id}: dropped"
            await self._publish(
                TokenChunk(request_id=task.request_id, index=0, finish_reason="error", error=error)
            )
            return
        running = self._instances.get(task.instance_id)
        if running is None or not running.accepting:
            error = f"instance {task.instance_id} is not running on {self._node_id}"
            await self._publish(
                TokenChunk(
                    request_id=task.request_id,
                    index=0,
                    finish_reason="error",
                    error=error,
                    error_kind=UNAVAILABLE,
                )
            )
            return
        received = now_ns()
        trace = None
        if is_sampled(parent := remote_context(task.traceparent)):
            trace = start_request_trace(self._tracing, parent, task.sent_at_ns, received)
        stream = RequestStream(task, self._publish, partial(self._ended, running), trace)
        running.add_stream(stream)
        if isinstance(task, EmbedTask):  # no KV, no handoff: its inputs go straight to the engine
            await self.submit(running, stream)
            return
        if self._kv is not None and running.kv_fingerprint and task.block_hashes:
            usable = reusable_hashes(task, self._kv_block_size)
            stream.fetched = await self._kv.prefetch(running.kv_fingerprint, usable)
            if trace is not None:
                trace.kv_fetch = (received, now_ns(), len(stream.fetched))
        if self._decode_side is not None and self._decode_side.receives(running, task):
            receive = self._decode_side.receive(running, stream, self.submit)
            stream.receiving = asyncio.create_task(receive, name=f"handoff-{task.request_id}")
            return
        await self.submit(running, stream)

    async def submit(
        self, running: RunningInstance, stream: RequestStream, kv_import: KVImport | None = None
    ) -> None:
        """The request to its engine, unless its client cancelled it on the way (no cancel is lost
        between intake and the engine)."""
        if stream.cancel_asked:
            await stream.end("cancelled")
            return
        task = stream.task
        request = (
            EngineRequest(request_id=task.request_id, prompt_token_ids=(), embed_inputs=task.inputs)
            if isinstance(task, EmbedTask)
            else EngineRequest(
                request_id=task.request_id,
                prompt_token_ids=task.prompt_token_ids,
                sampling=task.sampling,
                kv_import=kv_import,
                generated_token_ids=task.generated_token_ids,
            )
        )
        if stream.trace is not None:
            stream.trace.submitted_ns = now_ns()
        running.engine.submit(request)
        stream.submitted = True

    def _ended(self, running: RunningInstance, stream: RequestStream, last: GenerationOutput) -> None:
        """A stream's end, whatever ended it: what the worker held for it goes."""
        running.remove_stream(stream.request_id)
        if self._kv is not None:
            self._kv.release(stream.fetched)
        if stream.kv_folder is not None:
            shutil.rmtree(stream.kv_folder, ignore_errors=True)
        if stream.trace is not None:
            record_request(self._tracing, stream.trace, now_ns(), last)

    def cancel(self, request_id: str) -> None:
        for running in self._instances.values():
            stream = running.streams.get(request_id)
            if stream is None:
                continue
            stream.cancel_asked = True
            if stream.receiving is not None:
                stream.receiving.cancel()
            elif stream.submitted:
                with contextlib.suppress(Exception):
                    running.engine.cancel(request_id)

    async def move(self, running: RunningInstance, why: str) -> None:
        """End every stream of the instance with UNAVAILABLE (their gateways resume them elsewhere,
        from the tokens they already have) and stop their work here."""
        if running.streams:
            log.info("%s: %d requests move on (%s)", running.instance.instance_id, len(running.streams), why)
        for stream in list(running.streams.values()):
            self.cancel(stream.request_id)
            await stream.end("error", f"{why}: request {stream.request_id} moves on", UNAVAILABLE)

    async def run_internal(
        self, running: RunningInstance, request: EngineRequest, timeout_s: float
    ) -> EngineOutput:
        """Run one of the worker's own requests on the instance's engine; its final output."""
        done = running.internal[request.request_id] = asyncio.get_running_loop().create_future()
        try:
            running.engine.submit(request)
            return await asyncio.wait_for(done, timeout_s)
        finally:
            running.internal.pop(request.request_id, None)

    async def pump(
        self, running: RunningInstance, on_exit: Callable[[RunningInstance], Awaitable[None]]
    ) -> None:
        """Every output of the instance's engine to its owner; `on_exit` once the engine is gone."""
        async for output in running.engine.outputs():
            if (internal := running.internal.get(output.request_id)) is not None:
                if output.finish_reason and not internal.done():
                    internal.set_result(output)
            elif output.request_id in running.exports:
                self._prefill_side.on_output(running, output)
            elif (stream := running.streams.get(output.request_id)) is not None:
                await stream.send(output)
            else:  # ended already (its engine went on briefly after a cancel)
                log.debug("output for %s, which has ended: dropped", output.request_id)
        await on_exit(running)
