"""How fast each engine runs each model on this node: one fixed greedy request, timed once.

The request is PROMPT_TOKENS fixed token ids (valid in any vocabulary of more than 500 tokens) and
OUTPUT_TOKENS greedy tokens that end-of-sequence does not stop. Prefill speed is prompt tokens over
the time to the first token; decode speed is the tokens after the first over the time since it.
Results persist in `<state dir>/calibration.json` by engine, engine version, model and weight
format, so reloads and restarts measure nothing again and a new engine version is measured anew.
The same pass measures quality against the model's float32 reference (fleet_worker.quality).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from fleet_proto import EngineCalibration, QualityBudget, SamplingParams
from fleet_proto.speed import fastest_within
from fleet_worker.engine_process import EngineProcess
from fleet_worker.engines.base import EngineOutput, EngineRequest, EngineSpec, engine_spec
from fleet_worker.quality.measure import FIRST_POSITION, QualityReference
from fleet_worker.quality.run import measure_quality

log = logging.getLogger("fleet_worker.calibration")
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 32
TIMEOUT_S = 300.0
LOAD_TIMEOUT_S = 600.0
# Quality is measured only where it takes at most this long at the timed prefill speed (an engine
# that reuses no prefix prefills every position's whole prefix): MLX in bf16 on a 2-core x86 would
# take ~11 minutes on SmolLM2 and stays unmeasured (eligible, its reason says "not measured").
QUALITY_MAX_S = 120.0


def quality_seconds(timed: EngineCalibration, reference: QualityReference) -> float:
    """The prefill time the quality pass would take at worst on an engine measured as `timed`."""
    tokens = sum(FIRST_POSITION + j + 1 for j in range(len(reference.positions)))
    tokens += sum(len(p) for p in reference.chat_prompts)
    return tokens / max(timed.prefill_tokens_per_s, 1e-9)


MODES = ("all", "loaded", "off")


def calibration_request(request_id: str) -> EngineRequest:
    prompt = tuple(1 + (i * 37) % 499 for i in range(PROMPT_TOKENS))
    sampling = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)


def measured(
    output: EngineOutput, engine: str, engine_version: str, model_id: str, at: float, weight_format: str = ""
) -> EngineCalibration | None:
    """The calibration a finished request's timings give, or None when it failed or was too short."""
    decoded = output.completion_tokens - 1
    if output.finish_reason not in ("length", "stop") or output.prompt_time_s <= 0 or decoded < 1:
        return None
    if output.decode_time_s <= 0:
        return None
    return EngineCalibration(
        engine=engine,
        engine_version=engine_version,
        model_id=model_id,
        prefill_tokens_per_s=output.prompt_tokens / output.prompt_time_s,
        decode_tokens_per_s=decoded / output.decode_time_s,
        prompt_tokens=output.prompt_tokens,
        completion_tokens=output.completion_tokens,
        at=at,
        weight_format=weight_format,
    )


def warm_up_request(request_id: str, embedding: bool = False) -> EngineRequest:
    if embedding:
        return EngineRequest(request_id=request_id, prompt_token_ids=(), embed_inputs=((0, 1),))
    return EngineRequest(request_id=request_id, prompt_token_ids=(0,), sampling=SamplingParams(max_tokens=1))


class WholeOutputs:
    """Every output of the requests in flight on an engine, joined into one per request: its final
    output with all its tokens and log-probabilities (for the worker's own requests)."""

    def __init__(self) -> None:
        self._parts: dict[str, list[EngineOutput]] = {}
        self._done: dict[str, asyncio.Future[EngineOutput]] = {}

    def expect(self, request_id: str) -> asyncio.Future[EngineOutput]:
        self._parts[request_id] = []
        future = self._done[request_id] = asyncio.get_running_loop().create_future()
        return future

    def forget(self, request_id: str) -> None:
        self._parts.pop(request_id, None)
        self._done.pop(request_id, None)

    def add(self, output: EngineOutput) -> bool:
        """Take `output` when it belongs to an expected request (True), else leave it (False)."""
        parts = self._parts.get(output.request_id)
        if parts is None:
            return False
        parts.append(output)
        future = self._done[output.request_id]
        if output.finish_reason and not future.done():
            whole = msgspec.structs.replace(
                output,
                token_ids=tuple(t for p in parts for t in p.token_ids),
                logprobs=tuple(lp for p in parts for lp in p.logprobs),
            )
            future.set_result(whole)
        return True

    def fail_all(self, reason: str) -> None:
        for future in self._done.values():
            if not future.done():
                future.set_exception(RuntimeError(reason))


def _key(entry: EngineCalibration) -> tuple[str, str, str, str]:
    return (entry.engine, entry.engine_version, entry.model_id, entry.weight_format)


class CalibrationStore:
    """The node's calibrations, one per (engine, engine version, model, weight format), in a JSON file."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._entries: dict[tuple[str, str, str, str], EngineCalibration] = {}
        try:
            raw = msgspec.json.decode(path.read_bytes(), type=list[EngineCalibration])
        except FileNotFoundError:
            raw = []
        except (msgspec.DecodeError, msgspec.ValidationError) as error:  # measured again, not fatal
            log.warning("ignoring unreadable %s: %s", path, error)
            raw = []
        for entry in raw:
            self._entries[_key(entry)] = entry

    def get(
        self, engine: str, engine_version: str, model_id: str, weight_format: str = ""
    ) -> EngineCalibration | None:
        return self._entries.get((engine, engine_version, model_id, weight_format))

    def all(self) -> tuple[EngineCalibration, ...]:
        return tuple(self._entries.values())

    def put(self, entry: EngineCalibration) -> None:
        self._entries[_key(entry)] = entry
        self._path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps(msgspec.to_builtins(list(self._entries.values())), indent=1)
        with tempfile.NamedTemporaryFile("w", dir=self._path.parent, delete=False) as tmp:
            tmp.write(body)
        os.replace(tmp.name, self._path)  # a crash never leaves half a file


def peak_resident_bytes(pid: int | None) -> int:
    """A live process's peak resident memory (VmHWM; 0 where the system does not say)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            line = next((x for x in status if x.startswith("VmHWM:")), "")
    except OSError:
        return 0
    parts = line.split()
    return int(parts[1]) * 1024 if len(parts) >= 2 else 0


def served_format(
    spec: EngineSpec,
    options: Mapping[str, object],
    measurements: Sequence[EngineCalibration],
    budget: QualityBudget,
) -> str:
    """The weight format an engine loads a model in: the one asked for by name in the engine's
    options, else the fastest of `measurements` (this node's, of that engine and model) within the
    quality budget, else "" (the engine's own choice, until its formats are measured)."""
    if not spec.weight_formats:
        return ""
    asked = str(options.get(spec.weight_option, "auto"))
    if asked != "auto":
        return asked
    own = [m for m in measurements if m.weight_format in spec.weight_formats]
    best = fastest_within(own, budget)
    return best.weight_format if best is not None else ""


@dataclass(frozen=True)
class EngineMeasurement:
    calibration: EngineCalibration | None  # None: the timed request gave no timings
    answers: tuple[tuple[int, ...], ...] = ()  # greedy answers to the reference's chat prompts


async def measure_engine(
    engine_name: str,
    engine_version: str,
    model_id: str,
    folder: Path,
    options: Mapping[str, object],
    weight_format: str = "",
    reference: QualityReference | None = None,
) -> EngineMeasurement:
    """Start `engine_name` (in `weight_format`) on the model in `folder`, warm it up, time the
    calibration request, measure its quality against `reference`, note its peak memory, stop."""
    options = dict(options)
    if weight_format:
        options[engine_spec(engine_name).weight_option] = weight_format
    engine = await EngineProcess.start(engine_name, folder, options, LOAD_TIMEOUT_S)
    whole = WholeOutputs()

    async def pump() -> None:
        async for output in engine.outputs():
            whole.add(output)
        whole.fail_all("the engine process exited")

    async def run(request: EngineRequest, timeout_s: float = TIMEOUT_S) -> EngineOutput:
        done = whole.expect(request.request_id)
        try:
            engine.submit(request)
            return await asyncio.wait_for(done, timeout_s)
        finally:
            whole.forget(request.request_id)

    reader = asyncio.create_task(pump())
    try:
        await run(warm_up_request("warmup"))
        timed = await run(calibration_request("calibration"))
        entry = measured(timed, engine_name, engine_version, model_id, time.time(), weight_format)
        if entry is None:
            return EngineMeasurement(None)
        answers: tuple[tuple[int, ...], ...] = ()
        if reference is not None and quality_seconds(entry, reference) <= QUALITY_MAX_S:
            quality, answers = await measure_quality(run, reference, "quality")
            entry = msgspec.structs.replace(entry, quality=quality)
        entry = msgspec.structs.replace(entry, peak_memory_bytes=peak_resident_bytes(engine.pid))
        return EngineMeasurement(entry, answers)
    finally:
        await engine.stop()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
