"""Calibration's pure parts: the timed request, what its output measures, and the store on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet_proto.messages import GenerationOutput
from fleet_worker.calibration import (
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    CalibrationStore,
    calibration_request,
    measured,
)

pytestmark = pytest.mark.unit


def finished(**fields) -> GenerationOutput:
    base = {
        "request_id": "c",
        "finish_reason": "length",
        "prompt_tokens": 128,
        "completion_tokens": 33,
        "prompt_time_s": 0.5,
        "decode_time_s": 2.0,
    }
    return GenerationOutput(**(base | fields))


def test_the_request_is_fixed_greedy_and_fits_small_vocabularies() -> None:
    request = calibration_request("c")
    assert request == calibration_request("c") and len(request.prompt_token_ids) == PROMPT_TOKENS
    assert max(request.prompt_token_ids) < 500 and min(request.prompt_token_ids) > 0
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.ignore_eos) == (OUTPUT_TOKENS, 0.0, True)


def test_prefill_speed_is_prompt_over_first_token_time_and_decode_the_rest() -> None:
    entry = measured(finished(), "mlx", "0.31", "org/m", at=7.0)
    assert entry is not None
    assert (entry.prefill_tokens_per_s, entry.decode_tokens_per_s) == (256.0, 16.0)
    assert (entry.engine, entry.engine_version, entry.model_id, entry.at) == ("mlx", "0.31", "org/m", 7.0)


def test_a_failed_or_too_short_run_measures_nothing() -> None:
    assert measured(finished(finish_reason="error"), "mlx", "1", "m", 0) is None
    assert measured(finished(completion_tokens=1), "mlx", "1", "m", 0) is None
    assert measured(finished(prompt_time_s=0.0), "mlx", "1", "m", 0) is None


def test_the_store_keeps_one_entry_per_engine_version_and_model_across_restarts(tmp_path: Path) -> None:
    path = tmp_path / "state" / "calibration.json"
    store = CalibrationStore(path)
    first = measured(finished(), "mlx", "1", "m", 1.0)
    again = measured(finished(decode_time_s=1.0), "mlx", "1", "m", 2.0)
    newer = measured(finished(), "mlx", "2", "m", 3.0)
    for entry in (first, again, newer):
        assert entry is not None
        store.put(entry)
    reopened = CalibrationStore(path)
    assert reopened.get("mlx", "1", "m") == again and reopened.get("mlx", "2", "m") == newer
    assert len(reopened.all()) == 2 and reopened.get("vllm", "1", "m") is None


def test_an_unreadable_file_is_measured_again_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    path.write_text("{not json")
    assert CalibrationStore(path).all() == ()
