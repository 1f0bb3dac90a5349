"""How fast each engine runs each model on this node: one fixed greedy request, timed once.

The request is PROMPT_TOKENS fixed token ids (valid in any vocabulary of more than 500 tokens) and
OUTPUT_TOKENS greedy tokens that end-of-sequence does not stop. Prefill speed is prompt tokens over
the time to the first token; decode speed is the tokens after the first over the time since it.
Results persist in `<state dir>/calibration.json` by engine, engine version and model, so reloads
and restarts measure nothing again and a new engine version is measured anew.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from fleet_proto import EngineCalibration, SamplingParams
from fleet_worker.engines.base import EngineOutput, EngineRequest

log = logging.getLogger("fleet_worker.calibration")
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 32
TIMEOUT_S = 300.0
MODES = ("all", "loaded", "off")


def calibration_request(request_id: str) -> EngineRequest:
    prompt = tuple(1 + (i * 37) % 499 for i in range(PROMPT_TOKENS))
    sampling = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)


def measured(
    output: EngineOutput, engine: str, engine_version: str, model_id: str, at: float
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
    )


async def final_output(outputs: AsyncIterator[EngineOutput], request_id: str) -> EngineOutput:
    """Read an engine's outputs up to `request_id`'s final one (an engine nothing else uses)."""
    async for output in outputs:
        if output.request_id == request_id and output.finish_reason:
            return output
    raise RuntimeError("the engine process exited")


class CalibrationStore:
    """The node's calibrations, one per (engine, engine version, model), in a JSON file."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._entries: dict[tuple[str, str, str], EngineCalibration] = {}
        try:
            raw = msgspec.json.decode(path.read_bytes(), type=list[EngineCalibration])
        except FileNotFoundError:
            raw = []
        except (msgspec.DecodeError, msgspec.ValidationError) as error:  # measured again, not fatal
            log.warning("ignoring unreadable %s: %s", path, error)
            raw = []
        for entry in raw:
            self._entries[(entry.engine, entry.engine_version, entry.model_id)] = entry

    def get(self, engine: str, engine_version: str, model_id: str) -> EngineCalibration | None:
        return self._entries.get((engine, engine_version, model_id))

    def all(self) -> tuple[EngineCalibration, ...]:
        return tuple(self._entries.values())

    def put(self, entry: EngineCalibration) -> None:
        self._entries[(entry.engine, entry.engine_version, entry.model_id)] = entry
        self._path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps(msgspec.to_builtins(list(self._entries.values())), indent=1)
        with tempfile.NamedTemporaryFile("w", dir=self._path.parent, delete=False) as tmp:
            tmp.write(body)
        os.replace(tmp.name, self._path)  # a crash never leaves half a file
