"""Disaggregation on SmolLM2-135M-Instruct (bf16), real engines in their worker child processes:
MLX prefill -> MLX decode and vLLM CPU prefill (float32, handed over as bf16) -> MLX decode give
the greedy tokens of MLX's own colocated run; vLLM CPU prefill (handed over as f16) -> llama.cpp
decode (the GGUF the safetensors came from) gives llama.cpp's own run, also going on from the first
token vLLM sampled, and its KV rows are vLLM's to within the two engines' rounding."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from fleet_downloader.defaults import DEFAULT_MODEL_SOURCE
from fleet_downloader.staging import local_model_folder
from fleet_gateway.tokenizer import ChatTokenizer
from fleet_proto import SamplingParams
from fleet_store.handoff import decode_chunk, read_folder
from fleet_worker.engine_process import EngineProcess
from fleet_worker.engines.base import EngineOutput, EngineRequest, KVExport, KVImport

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
FIRST_ONLY = SamplingParams(max_tokens=1, temperature=0.0)  # what a prefill-only request samples
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return local_model_folder(DEFAULT_MODEL_SOURCE, tmp_path_factory.mktemp("smollm2-handoff"))


@pytest.fixture(scope="module")
def prompt(smollm2: Path) -> tuple[int, ...]:
    return tuple(ChatTokenizer.from_folder(smollm2).encode_chat([{"role": "user", "content": QUESTION}]))


async def run(engine: EngineProcess, request: EngineRequest) -> list[EngineOutput]:
    engine.submit(request)
    outputs = []
    async with asyncio.timeout(300):
        async for output in engine.outputs():
            if output.request_id == request.request_id:
                outputs.append(output)
                if output.finish_reason:
                    return outputs
    raise AssertionError("the engine stopped")


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


async def decode_from(
    decoder: EngineProcess, prompt: tuple[int, ...], folder: Path, handoff_id: str, first_token: int = -1
) -> list[int]:
    imported = KVImport(folder=str(folder), handoff_id=handoff_id, first_token=first_token)
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = await run(
        decoder,
        EngineRequest(
            request_id=f"d-{handoff_id}", prompt_token_ids=prompt, sampling=sampling, kv_import=imported
        ),
    )
    assert outputs[-1].handoff is None, outputs[-1].handoff  # the handoff was used
    return tokens(outputs)


async def prefill(
    engine: EngineProcess,
    prompt: tuple[int, ...],
    folder: Path,
    handoff_id: str,
    sampling: SamplingParams = FIRST_ONLY,
    **spec,
) -> None:
    export = KVExport(folder=str(folder), handoff_id=handoff_id, **spec)
    request = EngineRequest(
        request_id=f"p-{handoff_id}", prompt_token_ids=prompt, sampling=sampling, export=export
    )
    outputs = await run(engine, request)
    assert outputs[-1].finish_reason == "length", outputs[-1].error


async def test_mlx_to_mlx_on_smollm2(smollm2: Path, prompt: tuple[int, ...], tmp_path: Path) -> None:
    prefiller = await EngineProcess.start("mlx", smollm2, {"prefill_step_size": 8}, load_timeout_s=300)
    decoder = await EngineProcess.start("mlx", smollm2, {}, load_timeout_s=300)
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        colocated = tokens(
            await run(decoder, EngineRequest(request_id="c", prompt_token_ids=prompt, sampling=sampling))
        )
        await prefill(prefiller, prompt, tmp_path, "mlx")
        chunks = [decode_chunk(blob) for blob in read_folder(tmp_path)]
        assert chunks[0].kv[0][0].dtype == "BF16" and len(chunks) > 3
        assert await decode_from(decoder, prompt, tmp_path, "mlx") == colocated
    finally:
        await prefiller.stop()
        await decoder.stop()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
async def test_vllm_to_mlx_on_smollm2(smollm2: Path, prompt: tuple[int, ...], tmp_path: Path) -> None:
    options = {"kv_dir": str(tmp_path / "kv"), "kv_cache_bytes": 256 << 20, "max_model_len": 2048}
    prefiller = await EngineProcess.start("vllm", smollm2, options, load_timeout_s=600)
    decoder = await EngineProcess.start("mlx", smollm2, {}, load_timeout_s=300)
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        colocated = tokens(
            await run(decoder, EngineRequest(request_id="c", prompt_token_ids=prompt, sampling=sampling))
        )
        await prefill(prefiller, prompt, tmp_path / "h", "vllm", wire_dtype="BF16")
        chunks = [decode_chunk(blob) for blob in read_folder(tmp_path / "h")]
        assert {c.kv[i][0].dtype for c in chunks for i in c.kv} == {"BF16"}
        assert sorted({i for c in chunks for i in c.kv}) == list(range(30))  # one chunk per layer
        assert await decode_from(decoder, prompt, tmp_path / "h", "vllm") == colocated
    finally:
        await prefiller.stop()
        await decoder.stop()


def handoff_rows(folder: Path, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """A handoff's keys and values of one layer as f32 [tokens, heads, head_dim]."""
    chunks = [decode_chunk(blob) for blob in read_folder(folder)]
    pairs = [c.kv[layer] for c in chunks if layer in c.kv]
    keys, values = (
        np.concatenate([np.frombuffer(t.data, dtype=np.float16).reshape(t.shape) for t in part]).astype(
            np.float32
        )
        for part in zip(*pairs, strict=True)
    )
    return keys, values


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


async def test_vllm_to_llamacpp_on_smollm2(smollm2: Path, prompt: tuple[int, ...], tmp_path: Path) -> None:
    options = {"kv_dir": str(tmp_path / "kv"), "kv_cache_bytes": 256 << 20, "max_model_len": 2048}
    prefiller = await EngineProcess.start("vllm", smollm2, options, load_timeout_s=600)
    decoder = await EngineProcess.start("llamacpp", smollm2, {}, load_timeout_s=600)
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        colocated = tokens(
            await run(decoder, EngineRequest(request_id="c", prompt_token_ids=prompt, sampling=sampling))
        )
        await prefill(prefiller, prompt, tmp_path / "v", "vllm", wire_dtype="F16")
        await prefill(decoder, prompt, tmp_path / "l", "llamacpp", wire_dtype="F16")
        for layer in (0, 29):  # K in the same order of a head's dims: llama.cpp's is permuted back
            (vllm_k, vllm_v), (llama_k, llama_v) = (
                handoff_rows(tmp_path / "v", layer),
                handoff_rows(tmp_path / "l", layer),
            )
            assert relative_error(llama_k, vllm_k) < 0.1 and relative_error(llama_v, vllm_v) < 0.15
        assert await decode_from(decoder, prompt, tmp_path / "v", "vllm") == colocated
        # vLLM samples the first token too: llama.cpp goes on from it to its own colocated tokens
        await prefill(prefiller, prompt, tmp_path / "f", "first", wire_dtype="F16", sample_first=True)
        chunks = [decode_chunk(blob) for blob in read_folder(tmp_path / "f")]
        done, kinds = chunks[-1], [c.kind for c in chunks]
        assert (done.kind, done.first_token, done.token_end) == ("done", colocated[0], len(prompt) - 1)
        # the token is announced ahead of the last step's layers (the decoder sends it on at once)
        first = kinds.index("first")
        assert chunks[first].first_token == colocated[0] and kinds[first + 1 :].count("kv") == 30
        assert await decode_from(decoder, prompt, tmp_path / "f", "first", done.first_token) == colocated[1:]
    finally:
        await prefiller.stop()
        await decoder.stop()
