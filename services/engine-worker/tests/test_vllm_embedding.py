"""VllmEmbedder on all-MiniLM-L6-v2 (vLLM's CPU pooling runner), in the worker's engine child process:
its vectors equal sentence-transformers' own, inputs of concurrent requests share vLLM's steps
without changing a vector, bad requests and cancels end alone, and a model whose vectors vLLM
cannot make as its card says is refused at load with the reason.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from fleet_worker.engine_process import EngineLoadError, EngineProcess
from fleet_worker.engines.base import INVALID_REQUEST, EngineOutput, EngineRequest

from .minilm import MIN_COSINE, TEXTS, cosines, minilm_folder, reference_vectors, token_inputs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

STEPS_SCRIPT = Path(__file__).with_name("vllm_embed_steps.py")
MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length
EMBEDDING = {"embedding": True}  # the options the worker starts an embedding model's engine with
Inputs = Sequence[tuple[int, ...]]


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Engine children inherit it: one OpenMP thread is fastest for a small model on 2 cores."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return minilm_folder(tmp_path_factory.mktemp("minilm"))


@pytest.fixture(scope="module")
def inputs(folder: Path) -> list[tuple[int, ...]]:
    return token_inputs(folder)


class Embedder:
    """An embedder's engine process plus a reader that files each request's final output."""

    def __init__(self, process: EngineProcess, progress: list[tuple[int, int]]) -> None:
        self.process = process
        self.progress = progress
        self.finished: dict[str, asyncio.Future[EngineOutput]] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for output in self.process.outputs():
            assert output.finish_reason, "an embedding request has one output, its final one"
            self.finished[output.request_id].set_result(output)

    def submit(self, request_id: str, inputs: Inputs, prompt: tuple[int, ...] = ()) -> None:
        self.finished[request_id] = asyncio.get_running_loop().create_future()
        request = EngineRequest(request_id=request_id, prompt_token_ids=prompt, embed_inputs=tuple(inputs))
        self.process.submit(request)

    async def run(self, request_id: str, inputs: Inputs, prompt: tuple[int, ...] = ()) -> EngineOutput:
        self.submit(request_id, inputs, prompt)
        return await asyncio.wait_for(self.finished[request_id], 120)

    async def close(self) -> None:
        await self.process.stop()
        await self._reader


def vectors(output: EngineOutput) -> np.ndarray:
    return np.stack([np.frombuffer(vector, "<f4") for vector in output.embeddings])


@pytest.fixture(scope="module")
async def embedder(folder: Path, one_thread: None) -> AsyncIterator[Embedder]:
    progress: list[tuple[int, int]] = []
    process = await EngineProcess.start(
        "vllm", folder, EMBEDDING, load_timeout_s=300, on_progress=lambda d, t: progress.append((d, t))
    )
    engine = Embedder(process, progress)
    yield engine
    await engine.close()


async def test_loading_reports_the_encoder_layers(embedder: Embedder) -> None:
    assert embedder.progress[-1] == (6, 6)
    done = [d for d, _ in embedder.progress]
    assert done == sorted(done) and done[0] >= 1


async def test_vectors_equal_sentence_transformers(embedder: Embedder, folder: Path, inputs: Inputs) -> None:
    output = await embedder.run("all", inputs)
    assert output.finish_reason == "stop" and output.error == ""
    assert output.prompt_tokens == sum(len(tokens) for tokens in inputs) and output.prompt_time_s > 0
    got = vectors(output)
    assert got.shape == (len(TEXTS), 384)
    assert cosines(got, reference_vectors(folder)).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # its Normalize module


@pytest.fixture(scope="module")
def requests(inputs: Inputs) -> dict[str, Inputs]:
    """Several requests, inputs shared out unevenly and repeated."""
    return {"r0": inputs[:3], "r1": inputs[3:], "r2": [inputs[5], inputs[0]], "r3": [inputs[2]]}


@pytest.fixture(scope="module")
def batched(folder: Path, requests: dict[str, Inputs], one_thread: None) -> dict:
    """The embedder's steps and vectors for `requests`, all added before its first step."""
    request = json.dumps({rid: [list(tokens) for tokens in batch] for rid, batch in requests.items()})
    result = subprocess.run(
        [sys.executable, str(STEPS_SCRIPT), str(folder), request],
        capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


async def test_concurrent_requests_share_steps_and_equal_one_at_a_time(
    embedder: Embedder, inputs: Inputs, requests: dict[str, Inputs], batched: dict
) -> None:
    alone = [vectors(await embedder.run(f"alone-{i}", [tokens]))[0] for i, tokens in enumerate(inputs)]
    assert batched["steps"] < sum(len(batch) for batch in requests.values())
    for rid, batch in requests.items():
        expected = np.stack([alone[inputs.index(tokens)] for tokens in batch])
        np.testing.assert_allclose(np.array(batched["vectors"][rid], dtype=np.float32), expected, atol=1e-4)


@pytest.mark.parametrize(
    ("batch", "prompt", "message"),
    [
        ((), (), "no inputs to embed"),
        (((101, 102), ()), (), "input 1 is empty"),
        (((101, 30522, 102),), (), "token id 30522 is outside the vocabulary of 30522"),
        ((tuple([101] + [1037] * MAX_TOKENS + [102]),), (), "has 258 tokens; this model embeds at most 256"),
        ((), (101, 102), "this instance serves embeddings only"),
    ],
)
async def test_bad_requests_fail_alone(
    embedder: Embedder, inputs: Inputs, batch: Inputs, prompt: tuple[int, ...], message: str
) -> None:
    output = await embedder.run(f"bad-{message}", batch, prompt)
    assert output.finish_reason == "error" and message in output.error
    assert output.error_kind == INVALID_REQUEST and output.embeddings == ()
    after = await embedder.run(f"after-{message}", inputs[:1])
    assert after.finish_reason == "stop" and len(after.embeddings) == 1


async def test_cancel_ends_the_request_and_the_engine_goes_on(embedder: Embedder, inputs: Inputs) -> None:
    # ~100 inputs of 100 tokens: several of vLLM's steps of 32 inputs, so the cancel lands first
    many = [tuple([101] + [1000 + (i * 7 + j) % 5000 for j in range(98)] + [102]) for i in range(100)]
    embedder.submit("long", many)
    embedder.process.cancel("long")
    output = await asyncio.wait_for(embedder.finished["long"], 120)
    assert output.finish_reason == "cancelled" and output.embeddings == ()
    after = await embedder.run("after-cancel", inputs)
    assert after.finish_reason == "stop" and len(after.embeddings) == len(inputs)


async def test_throughput_at_batch_32_against_sentence_transformers(embedder: Embedder, folder: Path) -> None:
    """Printed for the record, not asserted: one engine thread, one torch thread, the same 32 texts."""
    import torch
    from sentence_transformers import SentenceTransformer

    texts = [f"{TEXTS[i % len(TEXTS)]} ({i})" for i in range(32)]
    batch = token_inputs(folder, tuple(texts))
    vllm_s = min([await _timed(embedder, f"speed-{i}", batch) for i in range(3)])
    model = SentenceTransformer(str(folder), device="cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        st_s = min(_st_seconds(model, texts) for _ in range(3))
    finally:
        torch.set_num_threads(threads)
    rates = f"vLLM embedder {32 / vllm_s:.0f} inputs/s, sentence-transformers {32 / st_s:.0f} inputs/s"
    print(f"\nbatch of 32 (one thread each): {rates}")


async def _timed(embedder: Embedder, request_id: str, batch: Inputs) -> float:
    started = time.perf_counter()
    assert (await embedder.run(request_id, batch)).finish_reason == "stop"
    return time.perf_counter() - started


def _st_seconds(model: object, texts: list[str]) -> float:
    started = time.perf_counter()
    model.encode(texts, batch_size=32)  # type: ignore[attr-defined]
    return time.perf_counter() - started


async def test_a_model_vllm_cannot_embed_as_its_card_says_is_refused_with_the_reason(
    folder: Path, tmp_path: Path, one_thread: None
) -> None:
    # the card's vectors would be 512 long (as if a module after pooling made them so); vLLM's are 384
    wrong = tmp_path / "wrong-dimensions"
    shutil.copytree(folder, wrong)
    pooling = wrong / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps(json.loads(pooling.read_text()) | {"word_embedding_dimension": 512}))
    reason = r"vLLM's vectors have shape \(384,\), the model's are 512 long"
    with pytest.raises(EngineLoadError, match=reason):
        await EngineProcess.start("vllm", wrong, EMBEDDING, load_timeout_s=300)
