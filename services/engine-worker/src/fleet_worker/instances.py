"""The instances this worker runs: load them when placed here, unload when deleted, run their tasks.

The worker follows State like every service and acts on the instances placed on its node (exo's
worker pattern): the scheduler decides, the worker reports loading/ready/failed as events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
from opentelemetry.trace import use_span

from fleet_bus import BusUnavailable, Delivery, publish_chunk
from fleet_bus.trace_context import is_sampled, remote_context
from fleet_proto import (
    EngineCalibration,
    GenerateTask,
    HandoffStats,
    Instance,
    InstanceDeleted,
    InstanceFailed,
    InstanceLoading,
    InstanceReady,
    InstanceStatus,
    InstanceStatusChanged,
    PrefillRequest,
    QualityBudget,
    SamplingParams,
    State,
    TokenChunk,
)
from fleet_proto.quality import DEFAULT_BUDGET, describe_quality, label
from fleet_proto.routing import (
    FIRST_TOKEN_EXPORT_ENGINES,
    FIRST_TOKEN_IMPORT_ENGINES,
    KV_EXPORT_ENGINES,
    KV_IMPORT_ENGINES,
)
from fleet_runtime.restarts import RestartPolicy
from fleet_runtime.service import ServiceContext
from fleet_runtime.tracing import now_ns
from fleet_store import (
    DEFAULT_REVISION,
    MODELS_BUCKET,
    ModelManifest,
    ObjectStore,
    StoreUnavailable,
    load_manifest,
)
from fleet_store.handoff import append_error
from fleet_store.kv import manifest_fingerprint
from fleet_store.layers import files_for_layers
from fleet_worker.calibration import TIMEOUT_S as CALIBRATION_TIMEOUT_S
from fleet_worker.calibration import (
    CalibrationStore,
    calibration_request,
    measure_engine,
    measured,
    served_format,
    warm_up_request,
)
from fleet_worker.engine_process import EngineProcess, EngineProcessExited
from fleet_worker.engines.base import EngineOutput, EngineRequest, KVExport, KVImport, engine_spec
from fleet_worker.handoff import HandoffClient
from fleet_worker.handoff_transport import HandoffFailed
from fleet_worker.kv_tier import WorkerKV
from fleet_worker.model_cache import ModelCache
from fleet_worker.quality.measure import QualityReference
from fleet_worker.quality.run import ensure_reference
from fleet_worker.request_trace import (
    RequestTrace,
    end_transfer,
    record_cancelled_transfer,
    record_request,
    start_request_trace,
    start_transfer,
)

log = logging.getLogger("fleet_worker")
LOAD_TIMEOUT_S = 600.0
WARMUP_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 30.0  # a draining instance's requests get this long to finish, then are cancelled
LOAD_PROGRESS_INTERVAL_S = 0.5
# Engines whose KV stays their own (per-sequence prefix reuse): no Fleet KV blocks, no KV folder,
# nothing for the shared tier or the KV index.
LOCAL_KV_ENGINES = ("llamacpp",)
# A model card's dtype -> the safetensors dtype its MLX decoder asks the prefill side to send.
WIRE_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


class EngineOptionsError(ValueError):
    """FLEET_ENGINE_OPTIONS is not a JSON object of objects."""


def parse_engine_options(raw: str) -> dict[str, dict[str, Any]]:
    """FLEET_ENGINE_OPTIONS: engine name -> keyword arguments of that engine's class."""
    if not raw.strip():
        return {}
    try:
        options = json.loads(raw)
    except ValueError as error:
        raise EngineOptionsError(f"FLEET_ENGINE_OPTIONS is not JSON: {error}") from None
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise EngineOptionsError('FLEET_ENGINE_OPTIONS must map engine names to objects: {"vllm": {...}}')
    return options


async def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Calibration:
    """What the worker measures its engines with (calibration.py): where results persist, which
    engines this node has (name -> version), the FLEET_CALIBRATION mode, and what to call when a
    result is new (the worker announces its node again)."""

    store: CalibrationStore | None = None
    engine_versions: Mapping[str, str] = field(default_factory=dict)
    mode: str = "all"
    on_calibrated: Callable[[], Awaitable[None]] = _nothing
    budget: QualityBudget = DEFAULT_BUDGET  # FLEET_QUALITY_BUDGET: which engine/format loads by itself
    references: Path | None = None  # where the models' float32 quality references are kept


@dataclass(frozen=True)
class KVSettings:
    """What every engine here gets for the shared KV cache (FLEET_KV_* settings)."""

    folder: str  # the local KV folder: blocks fetched from object storage, blocks to upload
    block_size: int
    memory_bytes: int  # tier 1 budget of an MLX engine (vLLM manages its own pages)


def engine_options(
    configured: dict[str, dict[str, Any]],
    engine: str,
    manifest: ModelManifest,
    kv: KVSettings | None = None,
    shared_tier: bool = True,
) -> dict[str, Any]:
    """The options an instance's engine gets: the KV ones (the model's fingerprint from its
    manifest: no re-hashing of the weights on the node), then the configured ones, which win.
    Without the shared tier (a pipeline rank) an engine gets no KV folder, only its memory tier;
    an engine that keeps its KV local (LOCAL_KV_ENGINES) gets none of the KV options."""
    options: dict[str, Any] = {}
    if kv is not None and engine not in LOCAL_KV_ENGINES:
        options = {"kv_block_size": kv.block_size}
        if shared_tier:
            options["kv_dir"] = kv.folder
        if engine == "mlx":
            options["kv_memory_bytes"] = kv.memory_bytes
    options |= configured.get(engine, {})
    if not shared_tier:
        options.pop("kv_dir", None)
    if (options.get("kv_dir") or options.get("kv_memory_bytes")) and not options.get("kv_fingerprint"):
        options["kv_fingerprint"] = manifest_fingerprint(manifest)
    return options


def to_chunk(output: EngineOutput, index: int) -> TokenChunk:
    return TokenChunk(**msgspec.structs.asdict(output), index=index)


def export_request_id(handoff_id: str) -> str:
    return f"prefill-{handoff_id}"


def merged_stats(transport: HandoffStats | None, engine: HandoffStats | None) -> HandoffStats | None:
    """The worker's transfer numbers with the engine's verdict (a fallback when it could not use them)."""
    if transport is None or engine is None:
        return transport or engine
    return msgspec.structs.replace(transport, fallback=engine.fallback)


def shard_rank(instance: Instance, node_id: str) -> int | None:
    """This node's rank in a pipeline instance (its shard's position), None when it holds none."""
    return next((rank for rank, s in enumerate(instance.shards) if s.node_id == node_id), None)


def pipeline_options(instance: Instance, rank: int) -> dict[str, Any]:
    """The MLX engine's `pipeline` option of one rank: where every rank listens, and its layers."""
    shard = instance.shards[rank]
    return {
        "rank": rank,
        "addresses": [s.ring_address for s in instance.shards],
        "start_layer": shard.start_layer,
        "end_layer": shard.end_layer,
    }


def rank_label(instance: Instance, rank: int) -> str:
    shard = instance.shards[rank]
    return (
        f"rank {rank} of {len(instance.shards)} (layers {shard.start_layer}-{shard.end_layer} "
        f"on {shard.node_id})"
    )


class LoadProgressReporter:
    """Weight-loading progress from the engine process as instance_loading events, at most 2 a second."""

    def __init__(self, publish: Callable[[float], Awaitable[None]]) -> None:
        self._publish = publish
        self._last = 0.0
        self._sent: list[asyncio.Task[None]] = []

    def report(self, done: int, total: int) -> None:
        now = time.monotonic()
        if total and (now - self._last >= LOAD_PROGRESS_INTERVAL_S or done == total):
            self._last = now
            self._sent.append(asyncio.get_running_loop().create_task(self._publish(done / total)))

    async def flush(self) -> None:
        """Every progress event is out before the next lifecycle event."""
        await asyncio.gather(*self._sent)


class RunningInstance:
    def __init__(
        self, instance: Instance, engine: EngineProcess, kv_fingerprint: str = "", rank: int = 0
    ) -> None:
        self.instance = instance
        self.engine = engine
        self.rank = rank  # in a pipeline; rank 0 takes the tasks, the others only step along
        self.kv_fingerprint = kv_fingerprint
        self.fetched: dict[str, list[Path]] = {}  # request -> KV files fetched for it
        self.next_index: dict[str, int] = {}  # in-flight request -> next chunk index
        self.prompt_tokens: dict[str, int] = {}  # in-flight request -> its prompt length
        self.generated: dict[str, int] = {}  # request -> tokens so far (absent: still queued)
        # disaggregation: prefill-only requests run for other workers (engine request -> folder,
        # handoff), decode requests still receiving their KV, and what their handoffs did
        self.exports: dict[str, tuple[Path, str]] = {}
        self.receiving: dict[str, asyncio.Task[None]] = {}
        self.imports: dict[str, Path] = {}
        self.handoff_stats: dict[str, HandoffStats] = {}
        self.traces: dict[str, RequestTrace] = {}  # traced requests: when their stages ran
        self.pump: asyncio.Task[None] | None = None
        self.warmup_id = f"warmup-{instance.instance_id}"
        # the worker's own requests (warm-up, calibration): request id -> its final output
        self.internal: dict[str, asyncio.Future[EngineOutput]] = {}
        self.draining: asyncio.Task[None] | None = None
        self.idle = asyncio.Event()  # set while no request is in flight
        self.idle.set()

    def start(self, request_id: str, prompt_tokens: int) -> None:
        self.next_index[request_id] = 0
        self.prompt_tokens[request_id] = prompt_tokens
        self.idle.clear()

    def finish(self, request_id: str) -> None:
        for table in (self.next_index, self.prompt_tokens, self.generated, self.traces):
            table.pop(request_id, None)
        if not self.next_index:
            self.idle.set()

    def running_tokens(self) -> int:
        return sum(self.prompt_tokens[r] + n for r, n in self.generated.items() if r in self.prompt_tokens)

    def queued_tokens(self) -> int:
        return sum(n for r, n in self.prompt_tokens.items() if r not in self.generated)


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
    ) -> None:
        self._ctx = ctx
        self._stream_interval_s = stream_interval_s  # engine_process.OutputHold
        calibration = calibration or Calibration()
        self._calibrations = calibration.store
        self._calibration_mode = calibration.mode if calibration.store is not None else "off"
        self._engine_versions = dict(calibration.engine_versions)
        self._on_calibrated = calibration.on_calibrated
        self._quality_budget = calibration.budget
        self._references = calibration.references
        self._calibration_lock = asyncio.Lock()  # one calibration engine process at a time
        self._calibrating: set[asyncio.Task[None]] = set()
        self._handoffs = handoffs
        self._options = options or {}
        self._kv = kv
        self._kv_settings = kv_settings
        self._node_id = node_id
        self._store = store
        self._cache = cache
        self._pinned: set[str] = set()  # instances holding a pin on their model in the cache
        self._running: dict[str, RunningInstance] = {}
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._generations: dict[str, int] = {}  # loading or running instance -> its placement generation
        self._restart_policy = RestartPolicy()
        self._restarts: dict[str, list[float]] = {}  # instance -> when its engine was restarted
        # Instances reported failed (their engine crashed) that this worker is loading again.
        self._restarting: set[str] = set()

    def active_requests(self) -> dict[str, int]:
        return {i: len(r.next_index) for i, r in self._running.items()}

    def running_tokens(self) -> dict[str, int]:
        return {i: r.running_tokens() for i, r in self._running.items()}

    def queued_tokens(self) -> dict[str, int]:
        return {i: r.queued_tokens() for i, r in self._running.items()}

    # -- lifecycle, driven by State ------------------------------------------------------------
    def wanted(self, state: State) -> dict[str, Instance]:
        return {
            i.instance_id: i
            for i in state.instances.values()
            if i.runs_on(self._node_id)
            and (i.status != InstanceStatus.FAILED or i.instance_id in self._restarting)
        }

    async def reconcile(self, state: State) -> None:
        wanted = self.wanted(state)
        for instance_id, generation in list(self._generations.items()):
            again = wanted.get(instance_id)
            if again is not None and again.generation != generation:
                await self._unload(instance_id)  # placed anew (a rank failed): every rank restarts
        for instance_id, instance in wanted.items():
            idle = instance_id not in self._running and instance_id not in self._loading
            if idle and instance.status != InstanceStatus.DRAINING:  # a drained one is not reloaded
                self._start_loading(instance)
        for instance_id in list(self._running.keys() | self._loading.keys()):
            if instance_id not in wanted:  # deleted, failed, or moved to another node
                await self._unload(instance_id)
        for instance_id, running in self._running.items():
            # rank 0 drains a pipeline; the other ranks step along until it is deleted
            draining = wanted[instance_id].status == InstanceStatus.DRAINING and running.rank == 0
            if draining and running.draining is None:
                running.draining = asyncio.create_task(self._drain(running), name=f"drain-{instance_id}")

    def _start_loading(self, instance: Instance) -> None:
        iid = instance.instance_id
        self._generations[iid] = instance.generation
        self._loading[iid] = asyncio.create_task(self._load(instance), name=f"load-{iid}")

    async def _publish(self, event) -> None:
        await self._ctx.bus.publish_event(event)

    async def _load(self, instance: Instance) -> None:
        """Fetch, start and warm up the engine. In a pipeline each rank's worker loads its shard;
        rank 0's reports the instance's progress and readiness (its warm-up runs through every
        rank), the others report only their failures."""
        ctx, iid = self._ctx, instance.instance_id
        engine: EngineProcess | None = None
        rank = shard_rank(instance, self._node_id) or 0
        try:
            if rank == 0:
                await self._status(iid, InstanceStatus.DOWNLOADING, 0.0)
            manifest, folder = await self._fetch(instance, report=rank == 0)
            if rank == 0:
                await self._loading_progress(iid, 0.0)
            # A rank's KV holds only its layers: its prefix blocks stay in its memory, out of the
            # shared tier (and of this worker's index: running.kv_fingerprint stays "").
            shared = not instance.is_pipeline
            options = engine_options(self._options, instance.engine, manifest, self._kv_settings, shared)
            weight_format = self._served_format(instance.engine, instance.model_id, options)
            if weight_format:
                options[engine_spec(instance.engine).weight_option] = weight_format
            if instance.is_pipeline:
                options["pipeline"] = pipeline_options(instance, rank)
            progress = LoadProgressReporter(lambda fraction: self._loading_progress(iid, fraction))
            engine = await EngineProcess.start(
                instance.engine,
                folder,
                options,
                LOAD_TIMEOUT_S,
                on_progress=progress.report if rank == 0 else None,
                stream_interval_s=self._stream_interval_s,
            )
            await progress.flush()
            running = RunningInstance(
                instance, engine, options.get("kv_fingerprint", "") if shared else "", rank
            )
            if self._kv is not None and running.kv_fingerprint:
                kv, fingerprint = self._kv, running.kv_fingerprint
                engine.on_kv_changes = lambda changes: kv.on_engine_changes(fingerprint, changes)
            running.pump = asyncio.create_task(self._pump(running), name=f"pump-{iid}")
            if rank == 0:
                await self._status(iid, InstanceStatus.WARMING, 0.0)
                await self._warm_up(running)
                if self._calibration_mode != "off":
                    await self._calibrate_loaded(running, weight_format)
        except asyncio.CancelledError:  # unloaded (deleted or moved) while loading
            self._restarting.discard(iid)
            self._release(instance)
            if engine is not None:
                await engine.stop()
            raise
        except Exception as exc:  # any failure (EngineLoadError, S3, ...) is reported, never lost
            self._restarting.discard(iid)
            self._release(instance)
            if engine is not None:
                await engine.stop()
            log.exception("loading %s failed", iid)
            reason = f"{rank_label(instance, rank)}: {exc}" if instance.is_pipeline else str(exc)
            await self._publish(
                InstanceFailed(
                    instance_id=iid,
                    reason=reason,
                    generation=instance.generation,
                    origin=ctx.service_id,
                    at=time.time(),
                )
            )
            return
        finally:
            self._loading.pop(iid, None)
        wanted = iid in self.wanted(ctx.follower.state)
        self._restarting.discard(iid)
        if not wanted:  # deleted or moved while loading
            self._release(instance)
            await engine.stop()
            return
        self._running[iid] = running
        if rank == 0:
            await self._publish(InstanceReady(instance_id=iid, origin=ctx.service_id, at=time.time()))
            self._calibrate_others_later(instance, folder)
        log.info("instance %s of %s ready (engine pid %d, rank %d)", iid, instance.model_id, engine.pid, rank)

    async def _loading_progress(self, instance_id: str, progress: float) -> None:
        event = InstanceLoading(instance_id=instance_id, progress=progress)
        await self._publish_progress(
            msgspec.structs.replace(event, origin=self._ctx.service_id, at=time.time())
        )

    async def _status(self, instance_id: str, status: InstanceStatus, progress: float) -> None:
        event = InstanceStatusChanged(instance_id=instance_id, status=status, progress=progress)
        await self._publish_progress(
            msgspec.structs.replace(event, origin=self._ctx.service_id, at=time.time())
        )

    async def _publish_progress(self, event) -> None:
        """Progress is advisory: a NATS outage must not fail the load it reports on (the next
        progress event, or ready, says where it is)."""
        try:
            await self._publish(event)
        except BusUnavailable as error:
            log.warning("progress event for %s not published: %s", event.instance_id, error)

    async def _run_internal(
        self, running: RunningInstance, request: EngineRequest, timeout_s: float
    ) -> EngineOutput:
        """Run one of the worker's own requests on the instance's engine; its final output."""
        done = running.internal[request.request_id] = asyncio.get_running_loop().create_future()
        try:
            running.engine.submit(request)
            return await asyncio.wait_for(done, timeout_s)
        finally:
            running.internal.pop(request.request_id, None)

    async def _warm_up(self, running: RunningInstance) -> None:
        """One 1-token generation, so the first user request does not pay for lazy initialisation."""
        request = warm_up_request(running.warmup_id)
        output = await self._run_internal(running, request, WARMUP_TIMEOUT_S)
        if output.finish_reason == "error":
            raise RuntimeError(f"warm-up failed: {output.error}")

    # -- calibration: how fast each engine runs each model here (calibration.py), and how close it
    # comes to the model's float32 reference (quality/) ------------------------------------------
    def _uncalibrated(
        self, engine: str, model_id: str, weight_format: str = "", quality: bool = False
    ) -> bool:
        """Not measured yet (with `quality`: or measured without quality)."""
        store = self._calibrations
        version = self._engine_versions.get(engine, "")
        if store is None or not version or engine == "echo":  # echo loads no model: nothing to time
            return False
        entry = store.get(engine, version, model_id, weight_format)
        return entry is None or (quality and entry.quality is None)

    async def _record(self, entry: EngineCalibration | None, engine: str, model_id: str, why: str) -> None:
        if entry is None or self._calibrations is None:
            log.warning("calibration of %s on %s gave no timings: %s", engine, model_id, why)
            return
        self._calibrations.put(entry)
        log.info(
            "calibrated %s %s on %s: %.0f prefill, %.1f decode tokens/s; %s",
            label(entry),
            entry.engine_version,
            model_id,
            entry.prefill_tokens_per_s,
            entry.decode_tokens_per_s,
            describe_quality(entry, self._quality_budget),
        )
        await self._on_calibrated()

    async def _calibrate_loaded(self, running: RunningInstance, weight_format: str) -> None:
        """Time the instance's own engine on its model, before it takes requests (advisory: a failure
        is logged and the instance serves anyway). Its quality is measured in the background."""
        instance = running.instance
        if instance.is_pipeline or not self._uncalibrated(instance.engine, instance.model_id, weight_format):
            return
        request = calibration_request(f"calibrate-{instance.instance_id}")
        try:
            output = await self._run_internal(running, request, CALIBRATION_TIMEOUT_S)
        except TimeoutError:
            log.warning("calibration of %s timed out", instance.instance_id)
            return
        version = self._engine_versions[instance.engine]
        entry = measured(output, instance.engine, version, instance.model_id, time.time(), weight_format)
        await self._record(entry, instance.engine, instance.model_id, output.error or str(output))

    def _calibrate_others_later(self, instance: Instance, folder: Path) -> None:
        if self._calibration_mode != "all" or instance.is_pipeline:
            return
        task = asyncio.create_task(
            self._calibrate_others(instance, folder), name=f"calibrate-{instance.model_id}"
        )
        self._calibrating.add(task)
        task.add_done_callback(self._calibrating.discard)

    async def _calibrate_others(self, instance: Instance, folder: Path) -> None:
        """Measure every engine and weight format of this node that can run the instance's model and
        is not measured yet (quality included, when the model has a reference), one engine process
        at a time (on the files the instance loaded from), while memory allows one more copy of it."""
        card = self._ctx.follower.state.models.get(instance.model_id)
        if card is None:
            return
        reference = None
        if self._references is not None:
            path = self._references / f"{card.model_id.replace('/', '--')}.json"
            try:
                reference = await ensure_reference(folder, path)
            except Exception as error:  # advisory: engines are then timed only
                log.warning("quality reference of %s failed: %s", card.model_id, error)
        engines = [e for e in card.supported_engines if e in self._engine_versions]
        for engine in engines:
            for weight_format in engine_spec(engine).weight_formats or ("",):
                async with self._calibration_lock:
                    if not self._uncalibrated(engine, card.model_id, weight_format, reference is not None):
                        continue
                    need = card.storage_bytes * 1.3
                    if (available := psutil.virtual_memory().available) < need:
                        log.info(
                            "not calibrating %s on %s: %d bytes free, %d needed",
                            engine,
                            card.model_id,
                            available,
                            need,
                        )
                        continue
                    try:
                        entry = await self._measure_engine(
                            engine, weight_format, card.model_id, folder, reference
                        )
                    except Exception as error:  # advisory: this engine stays unmeasured
                        log.warning("calibrating %s on %s failed: %s", engine, card.model_id, error)
                        continue
                    await self._record(entry, engine, card.model_id, "no timings")

    async def _measure_engine(
        self,
        engine_name: str,
        weight_format: str,
        model_id: str,
        folder: Path,
        reference: QualityReference | None,
    ) -> EngineCalibration | None:
        options = dict(self._options.get(engine_name, {}))
        version = self._engine_versions[engine_name]
        measurement = await measure_engine(
            engine_name, version, model_id, folder, options, weight_format, reference
        )
        return measurement.calibration

    def _served_format(self, engine: str, model_id: str, options: Mapping[str, Any]) -> str:
        spec, version, store = engine_spec(engine), self._engine_versions.get(engine, ""), self._calibrations
        entries = [store.get(engine, version, model_id, f) for f in spec.weight_formats] if store else []
        return served_format(spec, options, [e for e in entries if e is not None], self._quality_budget)

    async def _drain(self, running: RunningInstance) -> None:
        """Let in-flight requests finish (new ones are no longer routed here), then unload and say so."""
        iid = running.instance.instance_id
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(running.idle.wait(), DRAIN_TIMEOUT_S)
        for request_id in list(running.next_index):
            running.engine.cancel(request_id)
        await self._unload(iid)
        await self._publish(InstanceDeleted(instance_id=iid, origin=self._ctx.service_id, at=time.time()))

    async def _fetch(self, instance: Instance, report: bool = True) -> tuple[ModelManifest, Path]:
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
        # a pipeline rank pulls only the files of its layers
        shard = next((s for s in instance.shards if s.node_id == self._node_id), None)
        paths = None
        if shard is not None and len(instance.shards) > 1:
            paths = files_for_layers(manifest, shard.start_layer, shard.end_layer)
        loop = asyncio.get_running_loop()
        last = [0.0]

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if report and now - last[0] >= 0.5 and total:
                last[0] = now
                update = self._status(instance.instance_id, InstanceStatus.DOWNLOADING, done / total)
                asyncio.run_coroutine_threadsafe(update, loop)

        return manifest, await self._cache.ensure(manifest, self._store, paths=paths, progress=progress)

    def _release(self, instance: Instance) -> None:
        if instance.instance_id in self._pinned:
            self._pinned.discard(instance.instance_id)
            self._cache.unpin(instance.model_id, DEFAULT_REVISION)

    async def _unload(self, instance_id: str) -> None:
        self._generations.pop(instance_id, None)
        loading = self._loading.pop(instance_id, None)
        if loading is not None:
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
        running = self._running.pop(instance_id, None)
        if running is None:
            return
        self._release(running.instance)
        await running.engine.stop()
        if running.pump is not None:
            await asyncio.gather(running.pump, return_exceptions=True)
        if self._kv is not None and running.kv_fingerprint:
            await self._kv.forget(running.kv_fingerprint)
        log.info("instance %s unloaded", instance_id)

    async def remove_model(self, model_id: str) -> None:
        """Drop the local copy of a deleted model, unless an instance here still runs it (then it
        goes when that instance is deleted and the model is deleted again, or by cache eviction)."""
        removed = await self._cache.remove(model_id)  # skips revisions pinned by an instance here
        log.info("model %s was deleted: removed local revisions %s", model_id, removed or "none")

    async def close(self) -> None:
        for task in list(self._calibrating):
            task.cancel()
        await asyncio.gather(*self._calibrating, return_exceptions=True)
        for instance_id in list(self._running.keys() | self._loading.keys()):
            await self._unload(instance_id)

    # -- requests ------------------------------------------------------------------------------
    async def _pump(self, running: RunningInstance) -> None:
        async for output in running.engine.outputs():
            if (internal := running.internal.get(output.request_id)) is not None:
                if output.finish_reason and not internal.done():
                    internal.set_result(output)
                continue
            if output.request_id in running.exports:
                self._export_output(running, output)
                continue
            index = running.next_index.get(output.request_id, 0)
            trace = running.traces.get(output.request_id)
            if trace is not None and output.token_ids:
                trace.on_output(now_ns(), len(output.token_ids))
            if output.finish_reason:
                running.finish(output.request_id)
                if self._kv is not None:
                    self._kv.release(running.fetched.pop(output.request_id, []))
                folder = running.imports.pop(output.request_id, None)
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)
                stats = merged_stats(running.handoff_stats.pop(output.request_id, None), output.handoff)
                output = msgspec.structs.replace(output, handoff=stats)
                if trace is not None:
                    record_request(self._ctx.tracing, trace, now_ns(), output)
            else:
                running.next_index[output.request_id] = index + 1
                running.generated[output.request_id] = output.completion_tokens
            await publish_chunk(self._ctx.bus, to_chunk(output, index))
        iid = running.instance.instance_id
        if self._running.get(iid) is running:  # the engine died under us, not an unload
            self._running.pop(iid)
            self._release(running.instance)
            if self._kv is not None and running.kv_fingerprint:
                await self._kv.forget(running.kv_fingerprint)
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
            failed = InstanceFailed(instance_id=iid, reason=reason, generation=instance.generation)
            await self._publish(msgspec.structs.replace(failed, origin=self._ctx.service_id, at=time.time()))
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
        await self._publish(InstanceFailed(instance_id=iid, reason=reason, origin=self._ctx.service_id))
        if restart and iid not in self._loading:
            self._start_loading(instance)

    def _export_output(self, running: RunningInstance, output: EngineOutput) -> None:
        if not output.finish_reason:
            return
        folder, handoff_id = running.exports.pop(output.request_id)
        running.finish(output.request_id)
        if output.finish_reason != "length":  # the engine died or gave up: the reader must know
            append_error(folder, handoff_id, output.error or output.finish_reason)

    async def on_task(self, task: GenerateTask, _: Delivery) -> None:
        running = self._running.get(task.instance_id)
        if running is None or running.draining is not None:
            error = f"instance {task.instance_id} is not running on {self._node_id}"
            chunk = TokenChunk(request_id=task.request_id, index=0, finish_reason="error", error=error)
            await publish_chunk(self._ctx.bus, chunk)
            return
        running.start(task.request_id, len(task.prompt_token_ids))
        received = now_ns()
        if is_sampled(parent := remote_context(task.traceparent)):
            trace = start_request_trace(self._ctx.tracing, parent, task.sent_at_ns, received)
            running.traces[task.request_id] = trace
        if self._kv is not None and running.kv_fingerprint and task.block_hashes:
            usable = task.block_hashes[: (len(task.prompt_token_ids) - 1) // self._kv_settings.block_size]
            fetched = await self._kv.prefetch(running.kv_fingerprint, usable)
            running.fetched[task.request_id] = fetched
            if (trace := running.traces.get(task.request_id)) is not None:
                trace.kv_fetch = (received, now_ns(), len(fetched))
        if task.prefill is not None and self._handoffs is not None:
            if running.instance.engine in KV_IMPORT_ENGINES and len(task.prompt_token_ids) > 1:
                receive = self._decode_disaggregated(running, task)
                running.receiving[task.request_id] = asyncio.create_task(
                    receive, name=f"handoff-{task.request_id}"
                )
                return
        self._submit(running, task)

    def _submit(
        self, running: RunningInstance, task: GenerateTask, kv_import: KVImport | None = None
    ) -> None:
        request = EngineRequest(
            request_id=task.request_id,
            prompt_token_ids=task.prompt_token_ids,
            sampling=task.sampling,
            kv_import=kv_import,
        )
        if (trace := running.traces.get(task.request_id)) is not None:
            trace.submitted_ns = now_ns()
        running.engine.submit(request)

    def _held_prefix(self, running: RunningInstance, task: GenerateTask) -> int:
        """Leading prompt tokens whose KV this node's engine holds (the handoff can start there)."""
        if self._kv is None or self._kv_settings is None or not running.kv_fingerprint:
            return 0
        if running.instance.engine != "mlx":  # vLLM's own pages are not indexed: it takes whole prompts
            return 0
        usable = task.block_hashes[: (len(task.prompt_token_ids) - 1) // self._kv_settings.block_size]
        return self._kv.held_run(running.kv_fingerprint, usable) * self._kv_settings.block_size

    async def _decode_disaggregated(self, running: RunningInstance, task: GenerateTask) -> None:
        """Receive the prompt's KV from the planned prefill instance, then decode it here; on any
        failure of the handoff the prompt is prefilled here instead (logged, in the stats)."""
        assert self._handoffs is not None and task.prefill is not None
        card = self._ctx.follower.state.models.get(running.instance.model_id)
        wire_dtype = WIRE_DTYPES.get(card.dtype, "") if card is not None else ""
        if running.instance.engine in LOCAL_KV_ENGINES:  # its KV is not the card's dtype: its own
            wire_dtype = ""
        start_pos = self._held_prefix(running, task)
        # the prefill may sample the first token, sent from here the moment it arrives, ahead of
        # the last of the KV (not when a log-probability is asked for: it would come without it)
        starts_from_first = (
            running.instance.engine in FIRST_TOKEN_IMPORT_ENGINES and task.sampling.logprobs is None
        )
        kv_import, sent_first = None, -1
        trace = running.traces.get(task.request_id)
        transfer = start_transfer(self._ctx.tracing, trace, now_ns()) if trace is not None else None

        async def send_first(token: int) -> None:  # while the rest of the KV still travels
            nonlocal sent_first
            sent_first = token
            await self._send_first_token(running, task, token)

        try:
            with use_span(transfer, end_on_exit=False) if transfer is not None else contextlib.nullcontext():
                kv_import, stats = await self._handoffs.fetch(
                    task.request_id,
                    task.prefill,
                    task.prompt_token_ids,
                    start_pos,
                    wire_dtype,
                    task.sampling if starts_from_first else None,
                    send_first,
                )
            running.imports[task.request_id] = Path(kv_import.folder)
        except HandoffFailed as error:
            log.warning("request %s: remote prefill failed, prefilling here: %s", task.request_id, error)
            stats = HandoffStats(prefill_worker_id=task.prefill.worker_id, fallback=str(error))
            if sent_first >= 0:  # the engine prefills, then goes on from the token already sent
                kv_import = KVImport(folder="", handoff_id="", first_token=sent_first)
        except asyncio.CancelledError:
            if trace is not None and transfer is not None:
                record_cancelled_transfer(self._ctx.tracing, trace, transfer, now_ns())
            index = running.next_index.get(task.request_id, 0)  # 1 once the first token went out
            running.finish(task.request_id)
            chunk = TokenChunk(request_id=task.request_id, index=index, finish_reason="cancelled")
            await publish_chunk(self._ctx.bus, chunk)
            raise
        finally:
            running.receiving.pop(task.request_id, None)
        if transfer is not None:
            end_transfer(transfer, stats, now_ns())
        running.handoff_stats[task.request_id] = stats
        if kv_import is not None and kv_import.first_token >= 0 and sent_first < 0:
            await self._send_first_token(running, task, kv_import.first_token)
        if running.engine.alive:
            self._submit(running, task, kv_import)  # it ends a max_tokens=1 request at once
            return
        index = running.next_index.get(task.request_id, 0)
        running.finish(task.request_id)
        error = f"the engine of instance {task.instance_id} exited"
        chunk = TokenChunk(request_id=task.request_id, index=index, finish_reason="error", error=error)
        await publish_chunk(self._ctx.bus, chunk)

    async def _send_first_token(self, running: RunningInstance, task: GenerateTask, token: int) -> None:
        """Publish the first token the prefill sampled as the request's chunk 0; the engine's
        outputs follow it (the last one ends the request, as for any other)."""
        rid = task.request_id
        running.next_index[rid], running.generated[rid] = 1, 1
        chunk = TokenChunk(
            request_id=rid,
            index=0,
            token_ids=(token,),
            prompt_tokens=len(task.prompt_token_ids),
            completion_tokens=1,
        )
        await publish_chunk(self._ctx.bus, chunk)

    # -- the prefill side of disaggregation (called by the PrefillServer) ------------------------
    def start_export(self, request: PrefillRequest, folder: Path) -> str:
        running = self._running.get(request.instance_id)
        if running is None or running.draining is not None:
            return f"instance {request.instance_id} is not running on {self._node_id}"
        if running.instance.engine not in KV_EXPORT_ENGINES:
            return f"engine {running.instance.engine} cannot prefill for another instance"
        if running.instance.role == "decode":
            return f"instance {request.instance_id} only decodes"
        engine_id = export_request_id(request.handoff_id)
        running.exports[engine_id] = (folder, request.handoff_id)
        running.start(engine_id, len(request.prompt_token_ids))
        # the decoder's sampling where this engine can sample the first token for it, else greedy
        asked = request.sampling if running.instance.engine in FIRST_TOKEN_EXPORT_ENGINES else None
        sampling = msgspec.structs.replace(asked or SamplingParams(temperature=0.0), max_tokens=1)
        export = KVExport(
            folder=str(folder),
            handoff_id=request.handoff_id,
            start_pos=request.start_pos,
            wire_dtype=request.wire_dtype,
            sample_first=asked is not None,
        )
        try:
            running.engine.submit(
                EngineRequest(
                    request_id=engine_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling=sampling,
                    export=export,
                )
            )
        except EngineProcessExited as error:  # the decoder hears it at once and prefills itself
            running.exports.pop(engine_id, None)
            running.finish(engine_id)
            return str(error)
        return ""

    def cancel_export(self, request: PrefillRequest) -> None:
        running = self._running.get(request.instance_id)
        if running is not None and export_request_id(request.handoff_id) in running.exports:
            with contextlib.suppress(Exception):
                running.engine.cancel(export_request_id(request.handoff_id))

    def cancel(self, request_id: str) -> None:
        for running in self._running.values():
            receiving = running.receiving.get(request_id)
            if receiving is not None:
                receiving.cancel()
            elif request_id in running.next_index:
                with contextlib.suppress(Exception):
                    running.engine.cancel(request_id)
