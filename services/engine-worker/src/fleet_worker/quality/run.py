"""Measure an engine's quality through its public contract, and get the model's reference.

The reference is computed once per model and node, in a child process (reference.py), and kept
under the worker's state dir; a model with no safetensors weights, or a node without torch, has
none and its engines stay unmeasured (placement then says so, and does not gate them).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from fleet_proto import EngineQuality, SamplingParams
from fleet_worker.engines.base import EngineOutput, EngineRequest
from fleet_worker.quality.measure import (
    FIRST_POSITION,
    GREEDY_TOKENS,
    TOP_K,
    QualityReference,
    read_reference,
    score,
)

log = logging.getLogger("fleet_worker.quality")
REFERENCE_TIMEOUT_S = 600.0

RunRequest = Callable[[EngineRequest], Awaitable[EngineOutput]]
"""Runs one request on the engine and returns its whole output: every token and log-probability."""


def can_reference(model_dir: Path) -> str:
    """Why no reference can be computed for the model in `model_dir` ("" when one can)."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed on this node"
    if not (model_dir / "config.json").is_file() or not any(model_dir.glob("*.safetensors")):
        return "the model has no safetensors weights to compute a float32 reference from"
    return ""


async def ensure_reference(model_dir: Path, path: Path) -> QualityReference | None:
    """The model's reference from `path`, computed there first when missing (None: none possible)."""
    if (reference := read_reference(path)) is not None:
        return reference
    if why := can_reference(model_dir):
        log.info("no quality reference for %s: %s", model_dir.name, why)
        return None
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleet_worker.quality.reference", str(model_dir), str(path),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        _, stderr = await asyncio.wait_for(child.communicate(), REFERENCE_TIMEOUT_S)
    except (TimeoutError, asyncio.CancelledError):
        child.kill()
        await child.wait()
        raise
    if child.returncode != 0:
        log.warning("quality reference of %s failed: %s", model_dir.name, stderr.decode()[-2000:])
        return None
    return read_reference(path)


def _greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)


async def measure_quality(
    run: RunRequest, reference: QualityReference, prefix: str
) -> tuple[EngineQuality, tuple[tuple[int, ...], ...]]:
    """Score an engine, and return its greedy answers: one request per evaluation position, in
    order (each extends the last, so a prefix cache feeds only the new token), then the chat
    prompts side by side."""
    positions = []
    ids = reference.eval_token_ids
    for j in range(len(reference.positions)):
        request = EngineRequest(
            request_id=f"{prefix}-pos-{j}",
            prompt_token_ids=ids[: FIRST_POSITION + j + 1],
            sampling=_greedy(1, TOP_K),
        )
        output = await run(request)
        if output.finish_reason == "error" or not output.logprobs:
            raise RuntimeError(f"quality position {j}: {output.error or 'no log-probabilities'}")
        positions.append(output.logprobs[0])
    answers = await asyncio.gather(
        *(
            run(
                EngineRequest(
                    request_id=f"{prefix}-chat-{k}", prompt_token_ids=p, sampling=_greedy(GREEDY_TOKENS)
                )
            )
            for k, p in enumerate(reference.chat_prompts)
        )
    )
    tokens = tuple(a.token_ids for a in answers)
    return score(reference, positions, tokens), tokens
