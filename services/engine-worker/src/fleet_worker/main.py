"""Engine worker: announces its node, runs the instances placed on it, publishes node metrics.

Tasks arrive on the FLEET_TASK work queue (`fleet.task.<node_id>`) and are acked once the engine
has accepted them; tokens go back on core NATS `fleet.tok.<request_id>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from nats.aio.msg import Msg

from fleet_bus import consume_tasks
from fleet_proto import (
    CancelRequest,
    LivenessProbe,
    LivenessReply,
    ModelDeleted,
    NodeJoined,
    NodeLeft,
    ServiceKind,
)
from fleet_proto.messages import WorkerTask
from fleet_proto.quality import parse_budget
from fleet_proto.subjects import ALL_CANCELS_SUBJECT, alive_subject, metrics_subject
from fleet_runtime.service import ServiceContext, run
from fleet_store import KV_BUCKET, ObjectStore, StoreError
from fleet_store.kv import KVFolder
from fleet_store.kv_index import KVIndex
from fleet_worker.calibrating import Calibration
from fleet_worker.calibration import MODES as CALIBRATION_MODES
from fleet_worker.calibration import CalibrationStore
from fleet_worker.cancels import RecentCancels, honouring_early_cancels
from fleet_worker.engine_options import KVSettings, parse_engine_options
from fleet_worker.gpu import NvmlReader
from fleet_worker.handoff import HandoffClient, PrefillServer
from fleet_worker.instances import InstanceManager
from fleet_worker.kv_tier import WorkerKV
from fleet_worker.model_cache import ModelCache
from fleet_worker.probe import (
    Overrides,
    network_interfaces,
    node_engines,
    node_id_from,
    node_info,
    node_metrics,
    resolved_ring_host,
)

log = logging.getLogger("fleet_worker")
METRICS_INTERVAL_S = 1.0


async def publish_metrics(
    ctx: ServiceContext,
    node_id: str,
    model_dir: Path,
    manager: InstanceManager,
    kv: WorkerKV,
    overrides: Overrides,
    gpus: NvmlReader | None,
) -> None:
    while True:
        sample = await asyncio.to_thread(node_metrics, node_id, model_dir, overrides, gpus)
        sample = msgspec.structs.replace(
            sample,
            active_requests=manager.active_requests(),
            request_slots=manager.request_slots(),
            running_tokens=manager.running_tokens(),
            queued_tokens=manager.queued_tokens(),
            kv_memory_blocks=kv.memory_blocks(),
            kv_fetched_blocks=kv.blocks_fetched,
            kv_fetched_bytes=kv.bytes_fetched,
            kv_uploaded_blocks=kv.blocks_uploaded,
            kv_uploaded_bytes=kv.bytes_uploaded,
        )
        # During a NATS outage nats-py would buffer the samples and send them all on reconnect:
        # stale, and an outage long enough fills its buffer (then publish raises and the worker
        # stops). Skip them; the next one after the reconnect is current.
        if ctx.bus.nc.is_connected:
            await ctx.bus.publish(metrics_subject(node_id), sample)
        await asyncio.sleep(METRICS_INTERVAL_S)


async def follow_assignments(
    ctx: ServiceContext, manager: InstanceManager, node_id: str, announce: Callable[[], Awaitable[None]]
) -> None:
    async with ctx.follower.listen() as live:
        await manager.reconcile(ctx.follower.state)
        async for _, event in live:
            await manager.reconcile(ctx.follower.state)
            if isinstance(event, ModelDeleted):
                await manager.remove_model(event.model_id)
            elif isinstance(event, NodeLeft) and event.node_id == node_id and event.origin != ctx.service_id:
                # taken for gone while it is running (the scheduler timed out this node's previous
                # process just as this one started): it is here, and routable only once it says so
                log.warning("the cluster took node %s for gone (%s): joining again", node_id, event.reason)
                await announce()


async def main(ctx: ServiceContext) -> None:
    node_id = ctx.node_id = node_id_from(ctx.settings.resolved_node_id())
    model_dir = Path(ctx.settings.state_dir) / "models"
    store = ObjectStore.from_settings(ctx.settings)
    settings = ctx.settings
    overrides = Overrides(settings.node_memory_bytes, settings.node_engines, settings.node_kind)
    gpus = await asyncio.to_thread(NvmlReader.open)  # None without NVML or GPUs: normal
    interfaces = await asyncio.to_thread(network_interfaces)
    ring_host = resolved_ring_host(settings.ring_host, interfaces)

    budget = parse_budget(settings.quality_budget)  # a bad value stops the worker at start

    async def announce() -> None:
        """NodeJoined on start and whenever what the node offers changes (a model got cached)."""
        info = await asyncio.to_thread(
            node_info,
            node_id,
            model_dir,
            overrides,
            cache.complete_models(),
            gpus,
            ring_host=ring_host,
            ring_port_base=settings.ring_port_base,
            calibrations=calibrations.all(),
            quality_budget=budget,
        )
        await ctx.bus.publish_event(NodeJoined(node=info, origin=ctx.service_id, at=time.time()))

    cache = ModelCache(model_dir, settings.model_cache_bytes, on_change=announce)
    if settings.calibration not in CALIBRATION_MODES:
        raise ValueError(
            f"FLEET_CALIBRATION must be one of {', '.join(CALIBRATION_MODES)}, not {settings.calibration!r}"
        )
    calibrations = CalibrationStore(Path(settings.state_dir) / "calibration.json")
    engines = await asyncio.to_thread(node_engines, overrides)
    calibration = Calibration(
        calibrations,
        {e.name: e.version for e in engines},
        settings.calibration,
        announce,
        budget,
        Path(settings.state_dir) / "quality",
    )
    kv_settings = KVSettings(
        str(Path(settings.state_dir) / "kv"), settings.kv_block_size, settings.kv_memory_bytes
    )
    with contextlib.suppress(StoreError):  # the downloader creates it too; serving does not need it
        await asyncio.to_thread(store.ensure_bucket, KV_BUCKET)
    kv = WorkerKV(node_id, store, KVIndex.from_url(settings.redis_url), KVFolder(kv_settings.folder))
    handoff_root = Path(kv_settings.folder) / "handoff"
    shutil.rmtree(handoff_root, ignore_errors=True)  # what a previous run left half-done
    receiver = HandoffClient(ctx.bus, store, handoff_root / "in", settings.handoff_stall_s)
    manager = InstanceManager(
        ctx,
        node_id,
        store,
        cache,
        parse_engine_options(settings.engine_options),
        kv,
        kv_settings,
        receiver,
        calibration,
        settings.stream_interval_ms / 1000,
        settings.drain_grace_s,
    )
    prefill_server = PrefillServer(
        ctx.bus,
        ctx.tracing,
        node_id,
        store,
        handoff_root / "out",
        manager.start_export,
        manager.cancel_export,
        host=settings.handoff_host,
        port=settings.handoff_port,
        advertise=settings.handoff_advertise,
        interfaces=interfaces,
        stall_s=settings.handoff_stall_s,
    )
    await prefill_server.start()
    await announce()

    cancel_decoder = msgspec.json.Decoder(CancelRequest)
    cancels = RecentCancels()  # a cancel may come before its task runs: see fleet_worker.cancels

    async def on_cancel(msg: Msg) -> None:
        try:
            request_id = cancel_decoder.decode(msg.data).request_id
        except msgspec.ValidationError:
            return
        cancels.add(request_id)
        manager.cancel(request_id)

    cancel_sub = await ctx.bus.nc.subscribe(ALL_CANCELS_SUBJECT, cb=on_cancel)

    async def here(probe: LivenessProbe) -> LivenessReply:  # gone with the process: see LivenessProbe
        return LivenessReply(node_id=node_id, running=manager.runs(probe.request_id))

    await ctx.bus.serve(alive_subject(node_id), LivenessProbe, here)
    task_decoder = msgspec.json.Decoder(WorkerTask)
    ctx.spawn(publish_metrics(ctx, node_id, model_dir, manager, kv, overrides, gpus), "node-metrics")
    ctx.spawn(follow_assignments(ctx, manager, node_id, announce), "assignments")
    ctx.spawn(kv.keep_index(), "kv-index")  # rewrites the KV index after a Redis outage
    on_task = honouring_early_cancels(ctx.bus, cancels, manager.on_task, manager.cancel)
    ctx.spawn(consume_tasks(ctx.bus, node_id, task_decoder.decode, on_task), "tasks")

    async def drain() -> None:
        # Out of the cluster first, so nothing more is routed here; then the requests running here
        # finish within the drain grace or move on (their gateways resume them elsewhere), while the
        # worker still takes cancels, answers its liveness probe and reports its metrics.
        with contextlib.suppress(Exception):
            await ctx.bus.publish_event(
                NodeLeft(node_id=node_id, reason="worker stopping", origin=ctx.service_id)
            )
        await manager.leave()

    ctx.on_stop(drain)

    async def leave() -> None:
        await manager.close()  # after a drain: closes what is left (a calibration, a loading instance)
        await cancel_sub.unsubscribe()
        await prefill_server.close()
        await kv.close()
        await cache.close()
        if gpus is not None:
            gpus.close()
        store.close()

    ctx.on_shutdown(leave)


def cli() -> None:
    run(ServiceKind.WORKER, main)
