"""When a worker measures its engines (calibrating.Calibrator), on a real calibration file and a
fake engine run (no engine process): a loaded instance's engine is timed once, before it serves,
and the result is kept and announced; nothing is timed when calibration is off, for an engine
that loads no weights, or for a pipeline rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet_proto import Shard
from fleet_proto.messages import GenerationOutput
from fleet_worker.calibrating import Calibration, Calibrator
from fleet_worker.calibration import CalibrationStore
from fleet_worker.engines.base import EngineRequest

from .worker_fakes import instance

pytestmark = pytest.mark.unit


class FakeRun:
    """The engine's answer to the calibration request: its timings, as an engine reports them."""

    def __init__(self) -> None:
        self.asked: list[EngineRequest] = []

    async def __call__(self, request: EngineRequest, timeout_s: float) -> GenerationOutput:
        self.asked.append(request)
        tokens = request.sampling.max_tokens
        return GenerationOutput(
            request_id=request.request_id,
            finish_reason="length",
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=tokens,
            prompt_time_s=0.5,
            decode_time_s=0.01 * tokens,
        )


def calibrator(tmp_path: Path, mode: str = "all") -> tuple[Calibrator, CalibrationStore, list[str]]:
    store = CalibrationStore(tmp_path / "calibration.json")
    announced: list[str] = []

    async def announce() -> None:
        announced.append("node")

    settings = Calibration(store, {"mlx": "0.30", "echo": "1"}, mode, announce)
    return Calibrator(settings, {}), store, announced


async def test_a_loaded_engine_is_timed_once_and_the_result_kept_and_announced(tmp_path: Path) -> None:
    calibrating, store, announced = calibrator(tmp_path)
    run = FakeRun()
    loaded = instance(engine="mlx", model_id="org/m")
    assert calibrating.uncalibrated("mlx", "org/m")
    await calibrating.calibrate_loaded(loaded, "", run)
    entry = store.get("mlx", "0.30", "org/m")
    assert entry is not None and entry.prefill_tokens_per_s > 0 and entry.decode_tokens_per_s > 0
    assert announced == ["node"] and not calibrating.uncalibrated("mlx", "org/m")
    assert calibrating.uncalibrated("mlx", "org/m", quality=True)  # timed, quality not measured
    await calibrating.calibrate_loaded(loaded, "", run)
    assert len(run.asked) == 1  # measured already: not again
    assert CalibrationStore(tmp_path / "calibration.json").get("mlx", "0.30", "org/m") == entry


@pytest.mark.parametrize("case", ["off", "echo", "pipeline", "unknown engine version"])
async def test_nothing_is_timed_without_a_store_weights_a_whole_model_or_a_version(
    tmp_path: Path, case: str
) -> None:
    calibrating, store, announced = calibrator(tmp_path, "off" if case == "off" else "all")
    engine = {"echo": "echo", "unknown engine version": "vllm"}.get(case, "mlx")
    shards = (
        Shard(node_id="n1", start_layer=0, end_layer=2),
        Shard(node_id="n2", start_layer=2, end_layer=4),
    )
    loaded = instance(engine=engine, model_id="org/m", shards=shards if case == "pipeline" else ())
    run = FakeRun()
    await calibrating.calibrate_loaded(loaded, "", run)
    assert not run.asked and not store.all() and not announced
