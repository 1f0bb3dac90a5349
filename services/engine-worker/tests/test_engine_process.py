"""EngineProcess: the MLX engine in a spawned child, driven from asyncio."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from fleet_proto import SamplingParams
from fleet_worker.engine_process import EngineLoadError, EngineProcess, EngineProcessExited, describe_exit
from fleet_worker.engines.base import EngineOutput, EngineRequest

from .tiny_model import make_tiny_llama

LOAD_TIMEOUT_S = 120.0


def request(request_id: str, prompt: list[int], max_tokens: int = 8) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-process"), seed=3)


@pytest.fixture(scope="module")
async def engine(model_dir: Path) -> AsyncIterator[EngineProcess]:
    process = await EngineProcess.start("mlx", model_dir, {"max_batch_size": 4}, LOAD_TIMEOUT_S)
    yield process
    await process.stop()


async def collect(process: EngineProcess, request_ids: set[str]) -> dict[str, list[EngineOutput]]:
    """Outputs by request until every one of request_ids has its final output."""
    seen: dict[str, list[EngineOutput]] = {r: [] for r in request_ids}
    pending = set(request_ids)
    async with asyncio.timeout(30):
        async for output in process.outputs():
            seen[output.request_id].append(output)
            if output.finish_reason:
                pending.discard(output.request_id)
            if not pending:
                break
    return seen


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


async def test_round_trip_matches_in_process_generation(engine: EngineProcess, model_dir: Path):
    assert engine.alive and engine.pid and engine.pid != os.getpid()
    assert engine.load_time_s > 0
    prompts = {"a": [5, 6, 7], "b": list(range(30, 50))}
    for request_id, prompt in prompts.items():
        engine.submit(request(request_id, prompt))
    seen = await collect(engine, set(prompts))
    model, _ = load_model(model_dir)
    for request_id, prompt in prompts.items():
        expected = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=8)]
        assert tokens_of(seen[request_id]) == expected
        final = seen[request_id][-1]
        assert (final.finish_reason, final.completion_tokens) == ("length", 8)
        assert final.prompt_tokens == len(prompt)


async def test_cancel_through_the_process(engine: EngineProcess):
    engine.submit(request("long", [9, 10, 11], max_tokens=100_000))
    async with asyncio.timeout(30):
        async for output in engine.outputs():
            assert output.request_id == "long"
            if output.token_ids:
                break
    engine.cancel("long")
    seen = await collect(engine, {"long"})
    assert seen["long"][-1].finish_reason == "cancelled"
    engine.submit(request("next", [1, 2], max_tokens=4))
    seen = await collect(engine, {"next"})
    assert len(tokens_of(seen["next"])) == 4


async def test_stop_ends_the_child_and_the_outputs(model_dir: Path):
    process = await EngineProcess.start("mlx", model_dir, {}, LOAD_TIMEOUT_S)
    await process.stop()
    assert not process.alive
    assert [o async for o in process.outputs()] == []
    with pytest.raises(EngineProcessExited):
        process.submit(request("late", [1]))


async def test_missing_model_folder_fails_to_load(tmp_path: Path):
    with pytest.raises(EngineLoadError) as caught:
        await EngineProcess.start("mlx", tmp_path / "no-such-model", {}, LOAD_TIMEOUT_S)
    assert "FileNotFoundError" in caught.value.reason
    assert str(tmp_path / "no-such-model") in caught.value.reason


async def test_unknown_engine_fails_to_load(model_dir: Path):
    with pytest.raises(EngineLoadError, match="unknown engine 'nope'"):
        await EngineProcess.start("nope", model_dir, {}, LOAD_TIMEOUT_S)


async def test_killed_child_fails_in_flight_requests(model_dir: Path):
    process = await EngineProcess.start("mlx", model_dir, {}, LOAD_TIMEOUT_S)
    # Long enough to be still running when the kill lands; the kill comes after the first token.
    process.submit(request("doomed", [3, 4, 5], max_tokens=100_000))
    outputs = process.outputs()
    async with asyncio.timeout(30):
        first = await anext(outputs)
    assert first.request_id == "doomed" and not first.finish_reason
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    async with asyncio.timeout(5):
        rest = [o async for o in outputs]
    final = rest[-1]
    assert (final.request_id, final.finish_reason) == ("doomed", "error")
    assert final.error.startswith("engine process was killed by SIGKILL (out of memory?")
    assert process.exit_reason == final.error
    assert all(not o.finish_reason for o in rest[:-1])
    assert not process.alive
    await process.stop()  # a no-op on an exited child


def test_exit_codes_are_described_in_words():
    assert describe_exit(0) == "engine process exited with code 0"
    assert describe_exit(3) == "engine process exited with code 3"
    assert describe_exit(-signal.SIGSEGV) == "engine process was killed by SIGSEGV"
    assert "OOM killer" in describe_exit(-signal.SIGKILL)
    assert describe_exit(None) == "engine process is gone"
