"""The instances this worker runs, and the requests on them: one object that wires the worker's
jobs together for main.py.

- lifecycle.py: load, restart and unload the instances placed here (following State);
- calibrating.py: measure this node's engines on the models it serves;
- serving.py: clients' requests (one request_stream.RequestStream each) and the engines' outputs;
- disaggregation.py: receiving a request's KV from a prefill worker, and prefilling for others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fleet_bus import Delivery, publish_chunk
from fleet_proto import ModelCard, PrefillRequest, State, TokenChunk
from fleet_proto.messages import WorkerTask
from fleet_runtime.service import ServiceContext
from fleet_store import ObjectStore
from fleet_worker.calibrating import Calibration, Calibrator
from fleet_worker.disaggregation import DecodeSide, PrefillSide
from fleet_worker.engine_options import KVSettings
from fleet_worker.engine_process import EngineProcess
from fleet_worker.handoff import HandoffClient
from fleet_worker.kv_tier import WorkerKV
from fleet_worker.lifecycle import Lifecycle, ModelFiles
from fleet_worker.model_cache import ModelCache
from fleet_worker.running import RunningInstance
from fleet_worker.serving import RequestServer


class InstanceManager:
    def __init__(
        self,
        ctx: ServiceContext,
        node_id: str,
        store: ObjectStore,
        cache: ModelCache,
        options: dict[str, dict[str, Any]] | None = None,
        kv: WorkerKV | None = None,
        kv_settings: KVSettings | None = None,
        handoffs: HandoffClient | None = None,
        calibration: Calibration | None = None,
        stream_interval_s: float = 0.0,
        drain_grace_s: float = 5.0,
    ) -> None:
        options = options or {}
        block_size = kv_settings.block_size if kv_settings is not None else 0

        async def publish(chunk: TokenChunk) -> None:
            await publish_chunk(ctx.bus, chunk)

        def model_card(model_id: str) -> ModelCard | None:
            return ctx.follower.state.models.get(model_id)

        decode_side = None
        if handoffs is not None:
            decode_side = DecodeSide(handoffs, ctx.tracing, model_card, kv, block_size)
        self._prefill_side = PrefillSide(node_id)
        self._files = ModelFiles(store, cache, node_id)
        self._calibrator = Calibrator(calibration or Calibration(), options)
        running: dict[str, RunningInstance] = {}  # the lifecycle fills it, the server reads it
        self._server = RequestServer(
            node_id, running, publish, ctx.tracing, self._prefill_side, decode_side, kv, block_size
        )
        self._lifecycle = Lifecycle(
            running,
            node_id,
            ctx.service_id,
            lambda: ctx.follower.state,
            ctx.bus.publish_event,
            self._files,
            EngineProcess.start,
            self._server,
            self._calibrator,
            options,
            kv,
            kv_settings,
            stream_interval_s,
            drain_grace_s,
        )

    # -- what the node reports --------------------------------------------------------------------
    def active_requests(self) -> dict[str, int]:
        return {i: r.in_flight() for i, r in self._lifecycle.running.items()}

    def request_slots(self) -> dict[str, int]:
        return {i: r.engine.max_batch_size for i, r in self._lifecycle.running.items()}

    def running_tokens(self) -> dict[str, int]:
        return {i: r.running_tokens() for i, r in self._lifecycle.running.items()}

    def queued_tokens(self) -> dict[str, int]:
        return {i: r.queued_tokens() for i, r in self._lifecycle.running.items()}

    # -- lifecycle ----------------------------------------------------------------------------
    async def reconcile(self, state: State) -> None:
        await self._lifecycle.reconcile(state)

    async def remove_model(self, model_id: str) -> None:
        await self._files.remove_model(model_id)

    async def close(self) -> None:
        await self._calibrator.close()
        await self._lifecycle.close()

    async def leave(self) -> None:
        """Drain every instance (requests finish or move on), then close."""
        await self._calibrator.close()
        await self._lifecycle.leave()

    # -- requests -----------------------------------------------------------------------------
    async def on_task(self, task: WorkerTask, _: Delivery) -> None:
        await self._server.on_task(task)

    def cancel(self, request_id: str) -> None:
        self._server.cancel(request_id)

    def runs(self, request_id: str) -> bool:
        """Whether the request is one of this worker's streams (taken and not ended)."""
        return any(request_id in r.streams for r in self._lifecycle.running.values())

    # -- the prefill side of disaggregation (called by the PrefillServer) -------------------------
    def start_export(self, request: PrefillRequest, folder: Path) -> str:
        return self._prefill_side.start_export(
            self._lifecycle.running.get(request.instance_id), request, folder
        )

    def cancel_export(self, request: PrefillRequest) -> None:
        self._prefill_side.cancel_export(self._lifecycle.running.get(request.instance_id), request)
