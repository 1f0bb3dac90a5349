"""A chat completion's text step on recorded token streams: reasoning, tool calls (Hermes, as the
template implies) and finish reasons, fed one token at a time through the real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet_gateway import openai_api as oai
from fleet_gateway.models import ModelInfo
from fleet_gateway.parsing.output import Delta
from fleet_gateway.tokenizer import ChatTokenizer
from fleet_gateway.turns import TextStep

from .tiny_tokenizer import make_tiny_tokenizer_folder

pytestmark = pytest.mark.unit

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<tool_call>{% endif %}<|im_start|>assistant\n<think>\n"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelInfo:
    folder: Path = make_tiny_tokenizer_folder(tmp_path_factory.mktemp("tools"))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return ModelInfo("tiny/tools", ChatTokenizer.from_folder(folder), 2048, "fp")


def run(step: TextStep, model: ModelInfo, text: str) -> Delta:
    total = Delta()
    for token in model.tokenizer.encode(text):
        total = total.merge(step.push((token,)))
    return total.merge(step.finish())


def test_reasoning_then_a_tool_call_finishes_with_tool_calls(model: ModelInfo) -> None:
    step = TextStep(model, [], prompt_text="<|im_start|>assistant\n<think>\n", tool_format="hermes")
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    output = f"the user wants weather</think>\n<tool_call>{call}</tool_call>"
    delta = run(step, model, output)
    assert delta.reasoning == "the user wants weather" and delta.content.strip() == ""
    assert [(c.name, json.loads(c.arguments)) for c in delta.tool_calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert step.finish_reason("stop") == "tool_calls"
    body = oai.completion_response("c", "m", 0, [oai.chat_choice(0, delta, step.finish_reason("stop"))], {})
    message = body["choices"][0]["message"]
    assert (
        body["choices"][0]["finish_reason"] == "tool_calls"
        and message["tool_calls"][0]["function"]["name"] == "get_weather"
    )


def test_without_tools_the_text_is_content(model: ModelInfo) -> None:
    step = TextStep(model, [], prompt_text="", tool_format="")
    delta = run(step, model, 'a <tool_call>{"name": "x", "arguments": {}}</tool_call> b')
    assert delta.tool_calls == [] and "<tool_call>" in delta.content and delta.reasoning == ""
    assert step.finish_reason("length") == "length"


def test_a_stop_string_ends_the_text_before_any_call(model: ModelInfo) -> None:
    step = TextStep(model, ["STOP"], prompt_text="", tool_format="hermes")
    delta = run(step, model, 'done STOP <tool_call>{"name": "x", "arguments": {}}</tool_call>')
    assert delta.tool_calls == [] and step.finish_reason("length") == "stop"


HARMONY_TOKENS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
HARMONY_TEMPLATE = (  # gpt-oss's shape, reduced: the generation prompt ends with <|start|>assistant
    "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m.content }}<|end|>{% endfor %}<|start|>assistant"
)


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory: pytest.TempPathFactory) -> ModelInfo:
    folder = make_tiny_tokenizer_folder(tmp_path_factory.mktemp("harmony"), HARMONY_TOKENS)
    (folder / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    return ModelInfo("tiny/harmony", ChatTokenizer.from_folder(folder), 2048, "fp")


def test_harmony_channels_split_from_special_tokens_kept_in_the_text(harmony_model: ModelInfo) -> None:
    tokenizer = harmony_model.tokenizer
    assert all(len(tokenizer.encode(token)) == 1 for token in HARMONY_TOKENS)  # special: one id each
    step = TextStep(harmony_model, [], prompt_text="")  # no tools offered: Harmony is split anyway
    output = (
        "<|channel|>analysis<|message|>The user wants weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Oslo"}<|call|>'
    )
    delta = run(step, harmony_model, output)
    assert delta.reasoning == "The user wants weather." and delta.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in delta.tool_calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert step.finish_reason("stop") == "tool_calls"

    final = run(
        TextStep(harmony_model, []), harmony_model, "<|channel|>final<|message|>Sunny in Oslo.<|return|>"
    )
    assert (final.content, final.reasoning) == ("Sunny in Oslo.", "")
    plain = run(
        TextStep(harmony_model, [], split_reasoning=False), harmony_model, "<|channel|>final<|message|>hi"
    )
    assert plain.content == "finalhi"  # raw completions: special tokens give no text, nothing is split
