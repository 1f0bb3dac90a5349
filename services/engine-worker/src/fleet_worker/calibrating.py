"""When this worker measures its engines (what it measures: calibration.py, quality/).

A loaded instance's own engine is timed before it takes requests; every other engine and weight
format of this node that can run the model is measured afterwards in the background, one engine
process at a time, quality included when the model has a float32 reference. Results persist in the
node's calibration store, and the worker announces its node again after each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from fleet_proto import EngineCalibration, Instance, ModelCard, QualityBudget
from fleet_proto.engines import engine_facts
from fleet_proto.quality import DEFAULT_BUDGET, describe_quality, label
from fleet_worker.calibration import TIMEOUT_S as CALIBRATION_TIMEOUT_S
from fleet_worker.calibration import (
    CalibrationStore,
    calibration_request,
    measure_engine,
    measured,
    served_format,
)
from fleet_worker.engines.base import EngineOutput, EngineRequest, engine_spec
from fleet_worker.quality.run import ensure_reference

log = logging.getLogger("fleet_worker")

RunInternal = Callable[[EngineRequest, float], Awaitable[EngineOutput]]


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


class Calibrator:
    def __init__(self, settings: Calibration, engine_options: Mapping[str, Mapping[str, Any]]) -> None:
        self._settings = settings
        self._store = settings.store
        self.mode = settings.mode if settings.store is not None else "off"
        self._versions = dict(settings.engine_versions)
        self._engine_options = engine_options
        self._lock = asyncio.Lock()  # one calibration engine process at a time
        self._background: set[asyncio.Task[None]] = set()

    def uncalibrated(
        self, engine: str, model_id: str, weight_format: str = "", quality: bool = False
    ) -> bool:
        """Not measured yet (with `quality`: or measured without quality)."""
        version = self._versions.get(engine, "")
        if self._store is None or not version or not engine_facts(engine).loads_weights:  # nothing to time
            return False
        entry = self._store.get(engine, version, model_id, weight_format)
        return entry is None or (quality and entry.quality is None)

    def served_format(self, engine: str, model_id: str, options: Mapping[str, Any]) -> str:
        """The weight format the engine serves the model in here (by calibration and the budget)."""
        spec, version, store = engine_spec(engine), self._versions.get(engine, ""), self._store
        entries = [store.get(engine, version, model_id, f) for f in spec.weight_formats] if store else []
        present = [e for e in entries if e is not None]
        return served_format(spec, options, present, self._settings.budget)

    async def _record(self, entry: EngineCalibration | None, engine: str, model_id: str, why: str) -> None:
        if entry is None or self._store is None:
            log.warning("calibration of %s on %s gave no timings: %s", engine, model_id, why)
            return
        self._store.put(entry)
        log.info(
            "calibrated %s %s on %s: %.0f prefill, %.1f decode tokens/s; %s",
            label(entry),
            entry.engine_version,
            model_id,
            entry.prefill_tokens_per_s,
            entry.decode_tokens_per_s,
            describe_quality(entry, self._settings.budget),
        )
        await self._settings.on_calibrated()

    async def calibrate_loaded(self, instance: Instance, weight_format: str, run: RunInternal) -> None:
        """Time the instance's own engine on its model, before it takes requests (advisory: a failure
        is logged and the instance serves anyway). Its quality is measured in the background."""
        if self.mode == "off" or instance.is_pipeline:
            return
        if not self.uncalibrated(instance.engine, instance.model_id, weight_format):
            return
        request = calibration_request(f"calibrate-{instance.instance_id}")
        try:
            output = await run(request, CALIBRATION_TIMEOUT_S)
        except TimeoutError:
            log.warning("calibration of %s timed out", instance.instance_id)
            return
        version = self._versions[instance.engine]
        entry = measured(output, instance.engine, version, instance.model_id, time.time(), weight_format)
        await self._record(entry, instance.engine, instance.model_id, output.error or str(output))

    def calibrate_others_later(self, card: ModelCard | None, instance: Instance, folder: Path) -> None:
        if self.mode != "all" or instance.is_pipeline or card is None:
            return
        task = asyncio.create_task(self._calibrate_others(card, folder), name=f"calibrate-{card.model_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _calibrate_others(self, card: ModelCard, folder: Path) -> None:
        """Measure every engine and weight format of this node that can run the model and is not
        measured yet (quality included, when the model has a reference), one engine process at a
        time (on the files the instance loaded from), while memory allows one more copy of it."""
        reference = None
        if self._settings.references is not None:
            path = self._settings.references / f"{card.model_id.replace('/', '--')}.json"
            try:
                reference = await ensure_reference(folder, path)
            except Exception as error:  # advisory: engines are then timed only
                log.warning("quality reference of %s failed: %s", card.model_id, error)
        for engine in [e for e in card.supported_engines if e in self._versions]:
            for weight_format in engine_spec(engine).weight_formats or ("",):
                async with self._lock:
                    if not self.uncalibrated(engine, card.model_id, weight_format, reference is not None):
                        continue
                    need = card.storage_bytes * 1.3
                    if (available := psutil.virtual_memory().available) < need:
                        log.info(
                            "not calibrating %s on %s: %d bytes free, %d needed",
                            engine, card.model_id, available, need,
                        )  # fmt: skip
                        continue
                    try:
                        measurement = await measure_engine(
                            engine,
                            self._versions[engine],
                            card.model_id,
                            folder,
                            dict(self._engine_options.get(engine, {})),
                            weight_format,
                            reference,
                        )
                    except Exception as error:  # advisory: this engine stays unmeasured
                        log.warning("calibrating %s on %s failed: %s", engine, card.model_id, error)
                        continue
                    await self._record(measurement.calibration, engine, card.model_id, "no timings")

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
