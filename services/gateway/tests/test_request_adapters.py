"""Anthropic, Responses and Ollama requests -> the chat template's messages and tools (pure), and the
400s naming the offending field in each API's own path style."""

from __future__ import annotations

import json

import pytest

from fleet_gateway import anthropic_api, ollama_api, responses_api
from fleet_gateway.errors import ApiError

pytestmark = pytest.mark.unit

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
TEMPLATE_TURNS = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "Weather in Paris?\nNow."},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny\n21 C"},
]


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_anthropic_blocks_become_template_turns() -> None:
    req = anthropic_api.parse_messages_request(
        body(
            model="m",
            max_tokens=5,
            system=[{"type": "text", "text": "be brief"}],
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Weather in Paris?"},
                        {"type": "text", "text": "Now."},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "dropped", "signature": ""},
                        {
                            "type": "tool_use",
                            "id": "call_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "call_1",
                            "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "21 C"}],
                        }
                    ],
                },
            ],
            tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
        )
    )
    turn = anthropic_api.chat_turn(req)
    assert turn.messages == TEMPLATE_TURNS
    assert turn.tools == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "", "parameters": {"type": "object"}},
        }
    ]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages.0.content.0.type"),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "x", "content": [{"type": "image"}]}],
                }
            ],
            "messages.0.content.0.content.0",
        ),
        ([{"role": "robot", "content": "hi"}], "messages.0.role"),
        ([], "messages"),
    ],
)
def test_anthropic_refusals_name_the_block(messages, param: str) -> None:
    with pytest.raises(ApiError) as refused:
        anthropic_api.chat_turn(
            anthropic_api.parse_messages_request(body(model="m", max_tokens=5, messages=messages))
        )
    assert refused.value.status == 400 and refused.value.param == param


def test_responses_items_become_template_turns() -> None:
    req = responses_api.parse_responses_request(
        body(
            model="m",
            instructions="be brief",
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Weather in Paris?"},
                        {"type": "input_text", "text": "Now."},
                    ],
                },
                {"type": "reasoning", "summary": []},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Paris"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny\n21 C"},
            ],
            tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        )
    )
    turn = responses_api.chat_turn(req)
    assert turn.messages == TEMPLATE_TURNS
    assert turn.tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    with pytest.raises(ApiError) as refused:
        responses_api.chat_turn(
            responses_api.parse_responses_request(
                body(model="m", input=[{"role": "user", "content": [{"type": "input_image"}]}])
            )
        )
    assert refused.value.param == "input[0].content[0]"


def test_ollama_tool_turns_answer_their_call_by_name() -> None:
    req = ollama_api.parse_chat_request(
        body(
            model="m",
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "Weather in Paris?\nNow."},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
                },
                {"role": "tool", "content": "sunny\n21 C", "tool_name": "get_weather"},
            ],
            options={"num_predict": 7, "repeat_penalty": 1.1, "stop": ["", "END"]},
        )
    )
    turn = ollama_api.chat_turn(req)
    assistant, tool = turn.messages[2], turn.messages[3]
    assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"] and tool["name"] == "get_weather"
    assert (turn.sampling.max_tokens, turn.sampling.repetition_penalty, turn.stops) == (7, 1.1, ["END"])
    with pytest.raises(ApiError) as refused:
        ollama_api.parse_chat_request(body(model="m", messages=[], options={"repeat_penalty": -1}))
    assert refused.value.param == "options.repeat_penalty"
