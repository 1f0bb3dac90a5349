"""Reasoning and tool-call parsers on recorded model outputs, fed whole, cut at every position and
character by character: a tag cut anywhere must parse the same."""

from __future__ import annotations

import json

import pytest

from fleet_gateway.parsing.output import Delta
from fleet_gateway.parsing.reasoning import ThinkParser
from fleet_gateway.parsing.tags import partial_tag_suffix
from fleet_gateway.parsing.tools import DSML, PARSERS, infer_tool_parser

pytestmark = pytest.mark.unit


def feed(make, pieces: list[str]) -> Delta:
    parser = make()
    total = Delta()
    for piece in pieces:
        total = total.merge(parser.push(piece))
    return total.merge(parser.flush())


def splittings(text: str):
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def parsed_every_way(make, text: str) -> Delta:
    results = [feed(make, pieces) for pieces in splittings(text)]
    first = results[0]
    for result in results[1:]:
        assert (result.content, result.reasoning) == (first.content, first.reasoning)
        assert [(c.name, c.arguments) for c in result.tool_calls] == [
            (c.name, c.arguments) for c in first.tool_calls
        ]
    return first


def calls(delta: Delta) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in delta.tool_calls]


def test_partial_tag_suffix() -> None:
    assert partial_tag_suffix("abc<th", "<think>") == 3
    assert partial_tag_suffix("abc", "<think>") == 0
    assert partial_tag_suffix("<think", "<think>") == 6


@pytest.mark.parametrize(
    ("text", "inside", "reasoning", "content"),
    [
        ("<think>2 + 2 is 4.</think>The answer is 4.", False, "2 + 2 is 4.", "The answer is 4."),
        ("So 2 + 2 = 4.\n</think>\n\nFour.", True, "So 2 + 2 = 4.\n", "\n\nFour."),
        ("<think>still thinking when cut", False, "still thinking when cut", ""),
        ("No reasoning, a <thing> and a <th", False, "", "No reasoning, a <thing> and a <th"),
        ("<think></think>Empty.", False, "", "Empty."),
    ],
)
def test_think_tags_split_reasoning_from_content(text, inside, reasoning, content) -> None:
    delta = parsed_every_way(lambda: ThinkParser(starts_inside=inside), text)
    assert (delta.reasoning, delta.content) == (reasoning, content)


def test_a_template_that_opens_the_think_block_starts_inside_it() -> None:
    assert ThinkParser.for_prompt("<|im_start|>assistant\n<think>\n")._tags.inside
    assert not ThinkParser.for_prompt("<|im_start|>assistant\n")._tags.inside


HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>'
)


def test_hermes_tool_calls() -> None:
    delta = parsed_every_way(PARSERS["hermes"], HERMES)
    assert calls(delta) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"})]
    assert delta.content == "Let me check.\n\n"
    assert all(c.id.startswith("call_") for c in delta.tool_calls)


@pytest.mark.parametrize(
    "text",
    [
        "Broken: <tool_call>{not json}</tool_call> done",
        'Cut: <tool_call>{"name": "get_weather", "argum',
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
    ],
)
def test_a_hermes_call_that_does_not_parse_stays_in_the_content(text: str) -> None:
    delta = parsed_every_way(PARSERS["hermes"], text)
    assert delta.tool_calls == [] and delta.content == text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', [("get_weather", {"city": "Oslo"})]),
        ('<|python_tag|>{"name": "search", "parameters": {"q": "nats"}}', [("search", {"q": "nats"})]),
        (
            '  {"name": "a", "arguments": {}}; {"name": "b", "parameters": {"x": 1}}',
            [("a", {}), ("b", {"x": 1})],
        ),
        ('[{"name": "a", "arguments": {"k": [1, 2]}}]', [("a", {"k": [1, 2]})]),
        (  # a ";" inside a string does not split the calls
            '{"name": "a", "parameters": {"q": "x; y"}}; {"name": "b", "parameters": {}}',
            [("a", {"q": "x; y"}), ("b", {})],
        ),
    ],
)
def test_json_tool_calls(text: str, expected) -> None:
    delta = parsed_every_way(PARSERS["json"], text)
    assert calls(delta) == expected and delta.content == ""


@pytest.mark.parametrize(
    "text", ["Hello there, {name}!", '{"not": "a call"}', "{broken", "<|python", "<|python_tag|>", "[]"]
)
def test_json_that_is_no_call_is_content(text: str) -> None:
    delta = parsed_every_way(PARSERS["json"], text)
    assert delta.tool_calls == [] and delta.content == text


D = DSML
DSML_TEXT = (
    f"I will look it up.\n\n<{D}function_calls>\n"
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">San Francisco</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
    f"</{D}invoke>\n"
    f'<{D}invoke name="get_time">\n'
    f'<{D}parameter name="zones" string="false">["PST", "UTC"]</{D}parameter>\n'
    f"</{D}invoke>\n"
    f"</{D}function_calls>"
)


def test_deepseek_dsml_tool_calls() -> None:
    delta = parsed_every_way(PARSERS["dsml"], DSML_TEXT)
    assert calls(delta) == [
        ("get_weather", {"city": "San Francisco", "days": 3}),
        ("get_time", {"zones": ["PST", "UTC"]}),
    ]
    assert delta.content == "I will look it up.\n\n"


def test_reasoning_then_a_tool_call() -> None:
    think = ThinkParser()
    tools = PARSERS["hermes"]()
    text = '<think>weather needs a tool</think><tool_call>{"name": "w", "arguments": {}}</tool_call>'
    total = Delta()
    for char in text:
        step = think.push(char)
        total = total.merge(Delta(reasoning=step.reasoning)).merge(tools.push(step.content))
    last = think.flush()
    total = total.merge(Delta(reasoning=last.reasoning)).merge(tools.push(last.content)).merge(tools.flush())
    assert total.reasoning == "weather needs a tool" and calls(total) == [("w", {})] and total.content == ""


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}", "hermes"),
        (f"{{{{'<{DSML}function_calls>'}}}}", "dsml"),
        ("<|start|>assistant<|channel|>analysis<|message|>", "harmony"),
        ("{%- if tools %}<|python_tag|>{% endif %}", "json"),
        ("{% if tools is not none %}Use JSON{% endif %}", "json"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", ""),
    ],
)
def test_the_chat_template_names_the_format(template: str, parser: str) -> None:
    assert infer_tool_parser(template) == parser
