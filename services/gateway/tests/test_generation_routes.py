"""The HTTP endpoints around a fake engine: `n` choices of one prompt (request ids, seeds, choices,
usage, streamed chunks), structured outputs and sampling fields reaching the engine, and an engine's
refusal answered as the client's 400 in its own error shape, streamed requests included (the refusal
comes before the stream starts).

FakeGenerator stands in for generation.Generator (routing, NATS and a worker): it records each task
and answers with scripted TokenChunks, so no server or engine is involved.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fleet_gateway.errors import error_middleware
from fleet_gateway.generation import NoInstance
from fleet_gateway.models import ModelInfo
from fleet_gateway.ollama_routes import ollama_routes
from fleet_gateway.openai_routes import openai_routes
from fleet_gateway.sampling import NO_LIMITS, RequestLimits
from fleet_gateway.tokenizer import ChatTokenizer
from fleet_gateway.turns import Turns
from fleet_proto import Instance, InstanceStatus, SamplingParams, State, StructuredOutput, TokenChunk
from fleet_runtime.tracing import Tracing

from .fake_catalog import FakeCatalog
from .tiny_tokenizer import IM_END_ID, make_tiny_tokenizer_folder

pytestmark = pytest.mark.unit

MODEL = "tiny/m"
USER = [{"role": "user", "content": "hi"}]
REFUSAL = "the grammar does not compile: unknown rule 'value'"


class FakeGenerator:
    """Answers each task with the text "seed <seed>" in two chunks (prefix-cached tokens: 4 for
    choice 0, 9 for the others), or refuses it as an engine refuses a spec it cannot compile."""

    def __init__(self, refuse: bool = False, fail: str = "", cold_s: float = 0.0, no_start: str = "") -> None:
        self.refuse, self.fail = refuse, fail
        # a model scaled to zero: its first chunk comes after cold_s (or NoInstance(no_start))
        self.cold_s, self.no_start = cold_s, no_start
        self.tasks: list[tuple[str, SamplingParams]] = []
        self.tokenizer: ChatTokenizer | None = None

    def starting(self, model_id: str) -> bool:
        return bool(self.cold_s)

    def starting_status(self, model_id: str) -> str:
        return "inst-1 on n1: loading (40%)"

    async def generate(
        self, request_id: str, model_id: str, prompt: list[int], sampling: SamplingParams, *_, **__
    ) -> AsyncIterator[TokenChunk]:
        self.tasks.append((request_id, sampling))
        if self.cold_s:
            await asyncio.sleep(self.cold_s)
            if self.no_start:
                raise NoInstance(self.no_start)
        if self.refuse or self.fail:
            kind = "invalid_request" if self.refuse else ""
            error = REFUSAL if self.refuse else self.fail
            yield TokenChunk(request_id=request_id, finish_reason="error", error=error, error_kind=kind)
            return
        tokens = self.tokenizer.encode(f"seed {sampling.seed}")
        yield TokenChunk(request_id=request_id, token_ids=tuple(tokens[:2]))
        yield TokenChunk(
            request_id=request_id,
            token_ids=tuple(tokens[2:]),
            finish_reason="stop",
            prompt_tokens=len(prompt),
            completion_tokens=len(tokens),
            prefix_cached_tokens=9 if request_id[-2:] in ("-1", "-2") else 4,
            index=1,
        )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelInfo:
    folder: Path = make_tiny_tokenizer_folder(tmp_path_factory.mktemp("tiny"))
    return ModelInfo(MODEL, ChatTokenizer.from_folder(folder), 2048, "fp")


@contextlib.asynccontextmanager
async def gateway(model: ModelInfo, generator: FakeGenerator, limits: RequestLimits = NO_LIMITS):
    generator.tokenizer = model.tokenizer
    ready = Instance(
        instance_id="i1", model_id=MODEL, node_id="n1", engine="vllm", status=InstanceStatus.READY
    )
    follower = SimpleNamespace(state=State(instances={"i1": ready}))
    turns = Turns(
        generator, FakeCatalog(model), follower, Tracing("gateway", "test"), limits, cold_start_progress_s=0.1
    )
    app = web.Application(middlewares=[error_middleware])
    app.add_routes(openai_routes(turns, follower))
    app.add_routes(ollama_routes(turns, follower))
    async with TestClient(TestServer(app)) as client:
        yield client


def sse_objects(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# ---------------------------------------------------------------- n choices


async def test_n_choices_fan_out_with_seeds_and_count_usage_once(model: ModelInfo) -> None:
    generator = FakeGenerator()
    async with gateway(model, generator) as client:
        reply = await client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": USER, "n": 3, "seed": 7}
        )
        assert reply.status == 200
        body = await reply.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["seed 7", "seed 8", "seed 9"]
    assert [request_id for request_id, _ in generator.tasks] == [f"{body['id']}-{i}" for i in range(3)]
    prompt_tokens = body["usage"]["prompt_tokens"]
    per_choice = len(model.tokenizer.encode("seed 7"))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 3 * per_choice,
        "total_tokens": prompt_tokens + 3 * per_choice,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


async def test_n_without_a_seed_leaves_each_choice_its_own_randomness(model: ModelInfo) -> None:
    generator = FakeGenerator()
    async with gateway(model, generator) as client:
        reply = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "n": 2})
        assert reply.status == 200
    assert [sampling.seed for _, sampling in generator.tasks] == [None, None]


async def test_n_choices_stream_interleaved_each_with_its_finish(model: ModelInfo) -> None:
    generator = FakeGenerator()
    request = {
        "model": MODEL,
        "messages": USER,
        "n": 2,
        "seed": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with gateway(model, generator) as client:
        reply = await client.post("/v1/chat/completions", json=request)
        text = await reply.text()
    chunks = sse_objects(text)
    contents, finishes = ["", ""], {}
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        contents[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert contents == ["seed 1", "seed 2"] and finishes == {0: "stop", 1: "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 4
    }
    assert text.endswith("data: [DONE]\n\n")


async def test_text_completions_fan_out_too(model: ModelInfo) -> None:
    async with gateway(model, FakeGenerator()) as client:
        reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 2, "seed": 3})
        body = await reply.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "seed 3"), (1, "seed 4")]


async def test_n_above_the_operators_limit_is_400_before_any_task(model: ModelInfo) -> None:
    generator = FakeGenerator()
    async with gateway(model, generator, RequestLimits(max_n=2)) as client:
        reply = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "n": 3})
        assert reply.status == 400
        assert (await reply.json())["error"]["param"] == "n"
    assert generator.tasks == []


# ---------------------------------------------------------------- a model scaled to zero


async def test_a_cold_start_streams_progress_comments_then_the_answer(model: ModelInfo) -> None:
    request = {"model": MODEL, "messages": USER, "seed": 1, "stream": True}
    async with gateway(model, FakeGenerator(cold_s=0.45)) as client:
        reply = await client.post("/v1/chat/completions", json=request)
        assert reply.status == 200  # the stream starts at once: the wait is in it
        text = await reply.text()
    waits = [json.loads(line.split(" ", 2)[2]) for line in text.splitlines() if line.startswith(": waiting")]
    assert len(waits) >= 2 and waits[0]["model"] == MODEL and "loading" in waits[0]["status"]
    assert waits[-1]["waited_s"] > waits[0]["waited_s"]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_objects(text))
    assert content == "seed 1" and text.endswith("data: [DONE]\n\n")
    assert text.rindex(": waiting") < text.index('"finish_reason":"stop"')


async def test_a_cold_start_answers_a_plain_request_once_started(model: ModelInfo) -> None:
    async with gateway(model, FakeGenerator(cold_s=0.25)) as client:
        reply = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "seed": 2})
        assert reply.status == 200
        assert (await reply.json())["choices"][0]["message"]["content"] == "seed 2"
        ollama = await client.post("/api/chat", json={"model": MODEL, "messages": USER, "stream": True})
        lines = [json.loads(line) for line in (await ollama.text()).splitlines()]
    assert lines[-1]["done"] is True  # NDJSON gets no progress lines: every line is a message


async def test_a_cold_start_that_fails_says_why_in_each_shape(model: ModelInfo) -> None:
    why = "No instance of tiny/m started within 0.2 s (waiting for the scheduler to place an instance)."
    async with gateway(model, FakeGenerator(cold_s=0.2, no_start=why)) as client:
        plain = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
        assert plain.status == 503 and why in (await plain.json())["error"]["message"]
        streamed = await client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": USER, "stream": True}
        )
        text = await streamed.text()
    [error] = [o for o in sse_objects(text) if "error" in o]
    assert why in error["error"]["message"]


# ---------------------------------------------------------------- what reaches the engine


async def test_structured_output_and_sampling_fields_reach_the_engine(model: ModelInfo) -> None:
    generator = FakeGenerator()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = {
        "model": MODEL,
        "messages": USER,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        "presence_penalty": 0.5,
        "logit_bias": {"17": -100},
        "stop_token_ids": [5],
    }
    async with gateway(model, generator) as client:
        assert (await client.post("/v1/chat/completions", json=request)).status == 200
        outside = {"model": MODEL, "messages": USER, "logit_bias": {str(model.tokenizer.vocab_size): 1}}
        refused = await client.post("/v1/chat/completions", json=outside)
        assert refused.status == 400 and (await refused.json())["error"]["param"] == "logit_bias"
    [(_, sampling)] = generator.tasks
    assert sampling.structured == StructuredOutput(json_schema=json.dumps(schema))
    assert (sampling.presence_penalty, sampling.logit_bias) == (0.5, ((17, -100.0),))
    assert sampling.stop_token_ids == (IM_END_ID, 5)


# ---------------------------------------------------------------- the engine refusing a spec


@pytest.mark.parametrize(
    ("path", "request_body", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": USER, "structured_outputs": {"grammar": "root ::= value"}},
            "structured_outputs.grammar",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "response_format": {"type": "json_object"}, "stream": True},
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "guided_regex": "a+", "n": 2, "stream": True},
            "guided_regex",
        ),
        ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_object"}}}, "text.format"),
        (
            "/v1/responses",
            {"input": "hi", "stream": True, "text": {"format": {"type": "json_object"}}},
            "text.format",
        ),
    ],
)
async def test_an_engine_refusal_is_a_400_naming_the_field(
    model: ModelInfo, path: str, request_body: dict, param: str
) -> None:
    async with gateway(model, FakeGenerator(refuse=True)) as client:
        reply = await client.post(path, json={"model": MODEL, **request_body})
        assert reply.status == 400 and reply.content_type == "application/json"
        assert await reply.json() == {
            "error": {
                "message": REFUSAL,
                "type": "invalid_request_error",
                "param": param,
                "code": "invalid_value",
            }
        }


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
async def test_an_engine_refusal_is_an_ollama_400(model: ModelInfo, path: str) -> None:
    request = {"model": MODEL, "messages": USER, "prompt": "hi", "format": "json"}  # streamed by default
    async with gateway(model, FakeGenerator(refuse=True)) as client:
        reply = await client.post(path, json=request)
        assert reply.status == 400 and await reply.json() == {"error": REFUSAL}


async def test_any_other_engine_error_is_still_the_servers(model: ModelInfo) -> None:
    async with gateway(model, FakeGenerator(fail="out of memory")) as client:
        reply = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
        assert reply.status == 503 and "out of memory" in (await reply.json())["error"]["message"]
