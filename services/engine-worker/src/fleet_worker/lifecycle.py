"""The instances placed on this worker: load them, restart them when their engine crashes, drain
and unload them when deleted or moved.

The worker follows State like every service and acts on the instances placed on its node (exo's
worker pattern): the scheduler decides, the worker reports downloading, loading, warming, ready
and failed as events. In a pipeline each rank's worker loads its shard; rank 0's reports the
instance's progress and readiness (its warm-up runs through every rank), the others only their
failures.

Whole at ~450 lines: one instance's life here (load, warm up, restart, drain, leave, unload) is
one state machine over the same running and loading tables; the files it pins are ModelFiles'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec

from fleet_bus import BusUnavailable
from fleet_proto import (
    Instance,
    InstanceDeleted,
    InstanceFailed,
    InstanceLoading,
    InstanceReady,
    InstanceStatus,
    InstanceStatusChanged,
    State,
)
from fleet_runtime.restarts import RestartPolicy
from fleet_store import (
    DEFAULT_REVISION,
    MODELS_BUCKET,
    ModelManifest,
    ObjectStore,
    StoreUnavailable,
    load_manifest,
)
from fleet_store.cards import stand_in_card
from fleet_store.layers import files_for_layers
from fleet_worker.calibrating import Calibrator
from fleet_worker.calibration import LOAD_TIMEOUT_S, warm_up_request
from fleet_worker.engine_options import (
    KVSettings,
    embedder_options,
    engine_options,
    memory_options,
    pipeline_options,
    rank_label,
    shard_rank,
)
from fleet_worker.engines.base import engine_spec
from fleet_worker.kv_tier import WorkerKV
from fleet_worker.model_cache import ModelCache
from fleet_worker.running import EngineHandle, RunningInstance
from fleet_worker.serving import RequestServer

log = logging.getLogger("fleet_worker")
WARMUP_TIMEOUT_S = 120.0
DRAIN_GRACE_S = 5.0  # Settings.drain_grace_s
PROGRESS_INTERVAL_S = 0.5

PublishEvent = Callable[[msgspec.Struct], Awaitable[object]]  # (Bus.publish_event's sequence: unused)
# engine name, model folder, options, timeout, on_progress, stream_interval_s -> a loaded engine
StartEngine = Callable[..., Awaitable[EngineHandle]]


class ModelFiles:
    """The model files instances here load from: fetched into the node's cache and pinned there
    while an instance needs them (a pipeline rank fetches only its layers' files)."""

    def __init__(self, store: ObjectStore, cache: ModelCache, node_id: str) -> None:
        self._store = store
        self._cache = cache
        self._node_id = node_id
        self._pinned: set[str] = set()  # instances holding a pin on their model

    async def fetch(
        self, instance: Instance, progress: Callable[[int, int], None]
    ) -> tuple[ModelManifest, Path]:
        manifest: ModelManifest | None
        try:
            manifest = await asyncio.to_thread(
                load_manifest, self._store, MODELS_BUCKET, instance.model_id, DEFAULT_REVISION
            )
        except StoreUnavailable as error:  # the cached copy, when this node has one, still serves
            manifest = self._cache.cached_manifest(instance.model_id, DEFAULT_REVISION)
            if manifest is None:
                raise
            log.warning(
                "object storage unavailable (%s): %s starts from its cached files",
                error,
                instance.instance_id,
            )
        if instance.instance_id not in self._pinned:  # never evicted while this instance needs it
            self._cache.pin(instance.model_id, DEFAULT_REVISION)
            self._pinned.add(instance.instance_id)
        shard = next((s for s in instance.shards if s.node_id == self._node_id), None)
        paths = None
        if shard is not None and len(instance.shards) > 1:
            paths = files_for_layers(manifest, shard.start_layer, shard.end_layer)
        return manifest, await self._cache.ensure(manifest, self._store, paths=paths, progress=progress)

    def release(self, instance: Instance) -> None:
        if instance.instance_id in self._pinned:
            self._pinned.discard(instance.instance_id)
            self._cache.unpin(instance.model_id, DEFAULT_REVISION)

    async def remove_model(self, model_id: str) -> None:
        """Drop the local copy of a deleted model, unless an instance here still runs it (then it
        goes when that instance is deleted and the model is deleted again, or by cache eviction)."""
        removed = await self._cache.remove(model_id)  # skips revisions pinned by an instance here
        log.info("model %s was deleted: removed local revisions %s", model_id, removed or "none")


class ProgressReporter:
    """Progress (done, total) as events, at most one per PROGRESS_INTERVAL_S (and the last)."""

    def __init__(self, publish: Callable[[float], Coroutine[Any, Any, None]]) -> None:
        self._publish = publish
        self._last = 0.0
        self._sent: list[asyncio.Future[None]] = []
        self._loop = asyncio.get_running_loop()

    def report(self, done: int, total: int) -> None:
        """Called on the loop (engine loading progress); flushed before the next lifecycle event."""
        if self._due(total, done == total):
            self._sent.append(self._loop.create_task(self._publish(done / total)))

    def report_threadsafe(self, done: int, total: int) -> None:
        """Called from a download thread; not awaited, and never the last word (the status event
        after the download says where the load is)."""
        if self._due(total, False):
            asyncio.run_coroutine_threadsafe(self._publish(done / total), self._loop)

    def _due(self, total: int, last: bool) -> bool:
        now = time.monotonic()
        if total and (now - self._last >= PROGRESS_INTERVAL_S or last):
            self._last = now
            return True
        return False

    async def flush(self) -> None:
        """Every progress event is out before the next lifecycle event."""
        await asyncio.gather(*self._sent)


class Lifecycle:
    def __init__(
        self,
        running: dict[str, RunningInstance],
        node_id: str,
        service_id: str,
        state: Callable[[], State],
        publish_event: PublishEvent,
        files: ModelFiles,
        start_engine: StartEngine,
        server: RequestServer,
        calibrator: Calibrator,
        engine_config: dict[str, dict[str, Any]] | None = None,
        kv: WorkerKV | None = None,
        kv_settings: KVSettings | None = None,
        stream_interval_s: float = 0.0,
        drain_grace_s: float = DRAIN_GRACE_S,
    ) -> None:
        self._drain_grace_s = drain_grace_s
        self._leaving = False
        self._node_id = node_id
        self._service_id = service_id
        self._state = state
        self._publish_event = publish_event
        self._files = files
        self._start_engine = start_engine
        self._server = server
        self._calibrator = calibrator
        self._engine_config = engine_config or {}
        self._kv = kv
        self._kv_settings = kv_settings
        self._stream_interval_s = stream_interval_s  # engine_child.OutputHold
        self.running = running  # filled here; the request server reads it
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._generations: dict[str, int] = {}  # loading or running instance -> its placement generation
        self._restart_policy = RestartPolicy()
        self._restarts: dict[str, list[float]] = {}  # instance -> when its engine was restarted
        self._restarting: set[str] = set()  # reported failed (crashed), being loaded again here

    def wanted(self, state: State) -> dict[str, Instance]:
        return {
            i.instance_id: i
            for i in state.instances.values()
            if i.runs_on(self._node_id)
            and (i.status != InstanceStatus.FAILED or i.instance_id in self._restarting)
        }

    async def reconcile(self, state: State) -> None:
        if self._leaving:  # the worker stops: it loads nothing more
            return
        wanted = self.wanted(state)
        for instance_id, generation in list(self._generations.items()):
            again = wanted.get(instance_id)
            if again is not None and again.generation != generation:
                await self.unload(instance_id)  # placed anew (a rank failed): every rank restarts
        for instance_id, instance in wanted.items():
            idle = instance_id not in self.running and instance_id not in self._loading
            if idle and instance.status != InstanceStatus.DRAINING:  # a drained one is not reloaded
                self._start_loading(instance)
        for instance_id in list(self.running.keys() | self._loading.keys()):
            if instance_id not in wanted:  # deleted, failed, or moved to another node
                await self.unload(instance_id)
        for instance_id, running in self.running.items():
            # rank 0 drains a pipeline; the other ranks step along until it is deleted
            draining = wanted[instance_id].status == InstanceStatus.DRAINING and running.rank == 0
            if draining and running.draining is None:
                running.draining = asyncio.create_task(self._drain(running), name=f"drain-{instance_id}")

    def _start_loading(self, instance: Instance) -> None:
        iid = instance.instance_id
        self._generations[iid] = instance.generation
        self._loading[iid] = asyncio.create_task(self._load(instance), name=f"load-{iid}")

    async def _event(self, event: msgspec.Struct) -> None:
        await self._publish_event(msgspec.structs.replace(event, origin=self._service_id, at=time.time()))

    async def _progress(self, event: InstanceLoading | InstanceStatusChanged) -> None:
        """Progress is advisory: a NATS outage must not fail the load it reports on (the next
        progress event, or ready, says where it is)."""
        try:
            await self._event(event)
        except BusUnavailable as error:
            log.warning("progress event for %s not published: %s", event.instance_id, error)

    async def _status(self, instance_id: str, status: InstanceStatus, progress: float) -> None:
        await self._progress(InstanceStatusChanged(instance_id=instance_id, status=status, progress=progress))

    async def _loading_progress(self, instance_id: str, progress: float) -> None:
        await self._progress(InstanceLoading(instance_id=instance_id, progress=progress))

    async def _load(self, instance: Instance) -> None:
        """Fetch, start and warm up the engine; any failure is reported, never lost."""
        iid = instance.instance_id
        engine: EngineHandle | None = None
        rank = shard_rank(instance, self._node_id) or 0
        try:
            if rank == 0:
                await self._status(iid, InstanceStatus.DOWNLOADING, 0.0)
            downloading = ProgressReporter(lambda f: self._status(iid, InstanceStatus.DOWNLOADING, f))
            report = downloading.report_threadsafe if rank == 0 else (lambda done, total: None)
            manifest, folder = await self._files.fetch(instance, report)
            if rank == 0:
                await self._loading_progress(iid, 0.0)
            card = self._state().models.get(instance.model_id)
            embedding = card is not None and card.embedding is not None
            if embedding:  # its engine's embedder takes none of generation's options but memory's
                options = embedder_options(self._memory_options(instance, manifest, {}))
                weight_format = ""
            else:
                options, weight_format = self._generation_options(instance, manifest, rank)
            loading = ProgressReporter(lambda fraction: self._loading_progress(iid, fraction))
            engine = await self._start_engine(
                instance.engine,
                folder,
                options,
                LOAD_TIMEOUT_S,
                on_progress=loading.report if rank == 0 else None,
                stream_interval_s=self._stream_interval_s,
            )
            await loading.flush()
            fingerprint = "" if instance.is_pipeline else options.get("kv_fingerprint", "")
            running = RunningInstance(instance, engine, fingerprint, rank)
            if self._kv is not None and fingerprint:
                kv = self._kv
                engine.on_kv_changes = lambda changes: kv.on_engine_changes(fingerprint, changes)
            running.pump = asyncio.create_task(
                self._server.pump(running, self._engine_exited), name=f"pump-{iid}"
            )
            if rank == 0:
                await self._status(iid, InstanceStatus.WARMING, 0.0)
                await self._warm_up(running, embedding)
            if rank == 0 and not embedding:  # calibration measures generation
                await self._calibrator.calibrate_loaded(
                    instance,
                    weight_format,
                    lambda request, timeout: self._server.run_internal(running, request, timeout),
                )
        except asyncio.CancelledError:  # unloaded (deleted or moved) while loading
            self._restarting.discard(iid)
            self._files.release(instance)
            if engine is not None:
                await engine.stop()
            raise
        except Exception as exc:
            self._restarting.discard(iid)
            self._files.release(instance)
            if engine is not None:
                await engine.stop()
            log.exception("loading %s failed", iid)
            reason = f"{rank_label(instance, rank)}: {exc}" if instance.is_pipeline else str(exc)
            await self._event(InstanceFailed(instance_id=iid, reason=reason, generation=instance.generation))
            return
        finally:
            self._loading.pop(iid, None)
        self._restarting.discard(iid)
        if iid not in self.wanted(self._state()):  # deleted or moved while loading
            self._files.release(instance)
            await engine.stop()
            return
        self.running[iid] = running
        if rank == 0:
            await self._event(InstanceReady(instance_id=iid))
        if rank == 0 and not embedding:
            self._calibrator.calibrate_others_later(
                self._state().models.get(instance.model_id), instance, folder
            )
        log.info("instance %s of %s ready (engine pid %d, rank %d)", iid, instance.model_id, engine.pid, rank)

    def _generation_options(
        self, instance: Instance, manifest: ModelManifest, rank: int
    ) -> tuple[dict[str, Any], str]:
        """A generating engine's options, and the weight format it serves (calibration's pick)."""
        # A rank's KV holds only its layers: its prefix blocks stay in its memory, out of the
        # shared tier (and of this worker's index: running.kv_fingerprint stays "").
        shared = not instance.is_pipeline
        options = engine_options(self._engine_config, instance.engine, manifest, self._kv_settings, shared)
        weight_format = self._calibrator.served_format(instance.engine, instance.model_id, options)
        if weight_format:
            options[engine_spec(instance.engine).weight_option] = weight_format
        options |= self._memory_options(instance, manifest, options)
        if instance.is_pipeline:
            options["pipeline"] = pipeline_options(instance, rank)
        return options, weight_format

    def _memory_options(
        self, instance: Instance, manifest: ModelManifest, options: dict[str, Any]
    ) -> dict[str, Any]:
        """The KV cache the memory placement granted the instance here allows (engine_options.memory_options),
        by the same rule placement counted it with: from the staged card, else one sized by the files."""
        state = self._state()
        node = state.nodes.get(self._node_id)
        if node is None:
            return {}
        card = state.models.get(instance.model_id) or stand_in_card(instance.model_id, manifest.total_size)
        shard = next((s for s in instance.shards if s.node_id == self._node_id), None)
        layers = shard.end_layer - shard.start_layer if shard is not None and instance.is_pipeline else None
        served = str(options.get(engine_spec(instance.engine).weight_option, ""))
        configured = self._engine_config.get(instance.engine, {})
        granted = 0 if instance.is_pipeline else instance.granted_bytes
        return memory_options(configured, instance.engine, card, node, layers, served, granted)

    async def _warm_up(self, running: RunningInstance, embedding: bool) -> None:
        """One 1-token generation (or one short input embedded), so the first user request does
        not pay for lazy initialisation."""
        request = warm_up_request(f"warmup-{running.instance.instance_id}", embedding)
        output = await self._server.run_internal(running, request, WARMUP_TIMEOUT_S)
        if output.finish_reason == "error":
            raise RuntimeError(f"warm-up failed: {output.error}")

    async def _drain(self, running: RunningInstance) -> None:
        """A deleted instance: its requests move on (new ones are no longer routed here), then it
        unloads and says so."""
        await self.empty(running, "the instance was deleted")
        iid = running.instance.instance_id
        await self.unload(iid)
        await self._event(InstanceDeleted(instance_id=iid))

    async def empty(self, running: RunningInstance, why: str) -> None:
        """Let in-flight requests finish within the drain grace; the streams still running then
        move to other instances (their gateways resume them), exports are cancelled."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(running.idle.wait(), self._drain_grace_s)
        await self._server.move(running, why)
        for engine_id in list(running.exports):
            with contextlib.suppress(Exception):
                running.engine.cancel(engine_id)

    async def leave(self) -> None:
        """The worker stops: every instance here drains at once (the node has left the cluster, so
        nothing new is routed here), is said to be placed but not loaded (this worker loads it again
        when it is back), then unloads."""
        self._leaving = True
        for running in self.running.values():
            running.leaving = True
        instances = list(self.running.values())
        await asyncio.gather(*(self.empty(r, f"worker {self._node_id} is stopping") for r in instances))
        for r in instances:  # placed here, not loaded: not routed to until this worker loads it again
            if r.rank == 0:
                await self._progress(
                    InstanceStatusChanged(instance_id=r.instance.instance_id, status=InstanceStatus.PLACED)
                )
        await self.close()

    async def unload(self, instance_id: str) -> None:
        self._generations.pop(instance_id, None)
        loading = self._loading.pop(instance_id, None)
        if loading is not None:
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
        running = self.running.pop(instance_id, None)
        if running is None:
            return
        await running.engine.stop()
        if running.pump is not None:
            await asyncio.gather(running.pump, return_exceptions=True)
        await self._let_go(running)
        log.info("instance %s unloaded", instance_id)

    async def _let_go(self, running: RunningInstance) -> None:
        """What an instance that no longer runs here held: its model's pin, its KV in the index."""
        self._files.release(running.instance)
        if self._kv is not None and running.kv_fingerprint:
            await self._kv.forget(running.kv_fingerprint)

    async def _engine_exited(self, running: RunningInstance) -> None:
        """The pump's end: an unload, or the engine died under us (a crash)."""
        iid = running.instance.instance_id
        if self.running.get(iid) is not running:
            return
        self.running.pop(iid)
        await self._let_go(running)
        await self._engine_crashed(running)

    async def _engine_crashed(self, running: RunningInstance) -> None:
        """Report the instance failed with the engine's exit reason, then load it again here (the
        model is cached: seconds), unless it has crashed too often lately."""
        instance, now = running.instance, time.monotonic()
        iid = instance.instance_id
        reason = running.engine.exit_reason or "engine process exited unexpectedly"
        if instance.is_pipeline and running.rank > 0 and running.engine.exitcode == 0:
            return  # rank 0 shut the pipeline down (unloaded): not a failure
        if instance.is_pipeline:  # one rank alone cannot restart: the scheduler places all anew
            reason = f"{rank_label(instance, running.rank)}: {reason}"
            log.error("instance %s: %s", iid, reason)
            await self._event(InstanceFailed(instance_id=iid, reason=reason, generation=instance.generation))
            return
        restarts = self._restarts.setdefault(iid, [])
        restart = self._restart_policy.allows(restarts, now)
        if restart:
            restarts.append(now)
            self._restarting.add(iid)
            reason += f"; restarting it (restart {len(restarts)} of {self._restart_policy.max_restarts})"
        else:
            reason += f"; not restarted: it crashed {len(restarts) + 1} times within the restart window"
        log.error("instance %s: %s", iid, reason)
        await self._publish_event(InstanceFailed(instance_id=iid, reason=reason, origin=self._service_id))
        if restart and iid not in self._loading:
            self._start_loading(instance)

    async def close(self) -> None:
        for instance_id in list(self.running.keys() | self._loading.keys()):
            await self.unload(instance_id)
