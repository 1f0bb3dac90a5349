"""Forced tool calls through the HTTP endpoints around a fake engine: the engine is sent the
structural tag of the model's format (closing the think block its template opens), and the call it
writes comes back as the client's tool call (OpenAI chat streamed and not, Responses, Anthropic) with
the finish reason each API gives calls; a request that also asks for a JSON output is a 400."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fleet_gateway.anthropic_routes import anthropic_routes
from fleet_gateway.errors import error_middleware
from fleet_gateway.models import ModelInfo
from fleet_gateway.openai_routes import openai_routes
from fleet_gateway.tokenizer import ChatTokenizer
from fleet_gateway.turns import Turns
from fleet_proto import Instance, InstanceStatus, SamplingParams, State, TokenChunk
from fleet_runtime.tracing import Tracing

from .fake_catalog import FakeCatalog
from .tiny_tokenizer import make_tiny_tokenizer_folder

pytestmark = pytest.mark.unit

MODEL = "tiny/tools"
USER = [{"role": "user", "content": "weather?"}]
# Qwen3-like: renders tools, calls them Hermes-style and opens a think block for the answer.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n<think>\n"
)
SCHEMA = {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]}
TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "ping"}},
]
# What a constrained engine writes for tool_choice "required" after that template's prompt.
CALL_TEXT = '</think>\n\n<tool_call>\n{"name": "forecast", "arguments": {"days": 2}}\n</tool_call>'


class ScriptedEngine:
    """Records each task's sampling and answers with CALL_TEXT, ending with the engine's "stop"."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.tasks: list[SamplingParams] = []

    def starting(self, model_id: str) -> bool:  # its model is never scaled to zero
        return False

    async def generate(
        self, request_id: str, model_id: str, prompt: list[int], sampling: SamplingParams, *_, **__
    ) -> AsyncIterator[TokenChunk]:
        self.tasks.append(sampling)
        tokens = tuple(self.tokenizer.encode(CALL_TEXT))
        yield TokenChunk(request_id=request_id, token_ids=tokens[:5])
        yield TokenChunk(
            request_id=request_id,
            token_ids=tokens[5:],
            finish_reason="stop",
            prompt_tokens=len(prompt),
            completion_tokens=len(tokens),
            index=1,
        )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelInfo:
    folder: Path = make_tiny_tokenizer_folder(tmp_path_factory.mktemp("tools"))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return ModelInfo(MODEL, ChatTokenizer.from_folder(folder), 2048, "fp")


@contextlib.asynccontextmanager
async def gateway(model: ModelInfo, engine: ScriptedEngine):
    ready = Instance(
        instance_id="i1", model_id=MODEL, node_id="n1", engine="mlx", status=InstanceStatus.READY
    )
    follower = SimpleNamespace(state=State(instances={"i1": ready}))
    turns = Turns(engine, FakeCatalog(model), follower, Tracing("gateway", "test"))
    app = web.Application(middlewares=[error_middleware])
    app.add_routes(openai_routes(turns, follower))
    app.add_routes(anthropic_routes(turns))
    async with TestClient(TestServer(app)) as client:
        yield client


async def post(model: ModelInfo, path: str, body: dict[str, Any]) -> tuple[int, Any, list[SamplingParams]]:
    engine = ScriptedEngine(model.tokenizer)
    async with gateway(model, engine) as client:
        reply = await client.post(path, json={"model": MODEL, **body})
        answer = await (reply.json() if reply.content_type == "application/json" else reply.text())
        return reply.status, answer, engine.tasks


def structural_tag(sampling: SamplingParams) -> dict[str, Any]:
    assert sampling.structured is not None
    return json.loads(sampling.structured.structural_tag)


def called(tag: dict[str, Any]) -> tuple[list[str], bool]:
    """The tools a tag lets the model call (after the think block's close) and whether only once."""
    close, calls = tag["format"]["elements"]
    assert close == {"type": "const_string", "value": "</think>\n\n"}
    return [t["begin"].split('"')[3] for t in calls["tags"]], calls["stop_after_first"]


async def test_required_sends_the_tag_and_answers_a_tool_call(model: ModelInfo) -> None:
    status, body, [sampling] = await post(
        model, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "required"}
    )
    assert status == 200 and called(structural_tag(sampling)) == (["forecast", "ping"], False)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and "reasoning_content" not in choice["message"]
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "forecast", "arguments": '{"days": 2}'}


async def test_a_named_function_without_parallel_calls_allows_one_call_of_it(model: ModelInfo) -> None:
    choice = {"type": "function", "function": {"name": "forecast"}}
    request = {"messages": USER, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}
    status, body, [sampling] = await post(model, "/v1/chat/completions", request | {"stream": True})
    assert status == 200 and called(structural_tag(sampling)) == (["forecast"], True)
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks]
    [call] = [item for d in deltas for item in d["delta"].get("tool_calls", [])]
    assert call["function"]["name"] == "forecast" and deltas[-1]["finish_reason"] == "tool_calls"


async def test_responses_required_answers_a_function_call_item(model: ModelInfo) -> None:
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    request = {"input": "weather?", "tools": tools, "tool_choice": {"type": "function", "name": "ping"}}
    status, body, [sampling] = await post(model, "/v1/responses", request)
    assert status == 200 and called(structural_tag(sampling)) == (["ping"], False)
    [item] = [item for item in body["output"] if item["type"] == "function_call"]
    assert (item["name"], item["arguments"]) == ("forecast", '{"days": 2}')  # as the fake engine wrote


async def test_anthropic_any_answers_a_tool_use_block(model: ModelInfo) -> None:
    tools = [{"name": "forecast", "input_schema": SCHEMA}, {"name": "ping"}]
    choice = {"type": "any", "disable_parallel_tool_use": True}
    request = {"messages": USER, "max_tokens": 64, "tools": tools, "tool_choice": choice}
    status, body, [sampling] = await post(model, "/v1/messages", request)
    assert status == 200 and called(structural_tag(sampling)) == (["forecast", "ping"], True)
    assert body["stop_reason"] == "tool_use"
    assert [(b["type"], b.get("name"), b.get("input")) for b in body["content"]][-1] == (
        "tool_use",
        "forecast",
        {"days": 2},
    )


async def test_a_json_output_beside_a_forced_call_is_a_400_before_any_task(model: ModelInfo) -> None:
    request = {
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    status, body, tasks = await post(model, "/v1/chat/completions", request)
    assert (status, body["error"]["param"], tasks) == (400, "tool_choice", [])
    assert "'response_format' and 'tool_choice'" in body["error"]["message"]
