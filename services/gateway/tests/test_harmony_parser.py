"""The Harmony (gpt-oss) parser on recorded-style outputs, fed whole, cut at every position and
character by character: a special token cut anywhere must parse the same."""

from __future__ import annotations

import pytest

from fleet_gateway.parsing.harmony import HarmonyParser

from .test_output_parsing import calls, parsed_every_way

pytestmark = pytest.mark.unit

THINK = "<|channel|>analysis<|message|>User wants the weather in Paris. Use get_weather.<|end|>"
NEXT = "<|start|>assistant"


def test_analysis_then_final() -> None:
    text = (
        '<|channel|>analysis<|message|>User asks "What is 2+2?". Simple arithmetic: 4.<|end|>'
        f"{NEXT}<|channel|>final<|message|>2 + 2 = **4**.<|return|>"
    )
    delta = parsed_every_way(HarmonyParser, text)
    assert delta.reasoning == 'User asks "What is 2+2?". Simple arithmetic: 4.'
    assert (delta.content, delta.tool_calls) == ("2 + 2 = **4**.", [])


@pytest.mark.parametrize(
    "header",
    [
        "<|channel|>commentary to=functions.get_weather <|constrain|>json",
        " to=functions.get_weather<|channel|>commentary json",
        " to=functions.get_weather<|channel|>commentary <|constrain|>json",
    ],
)
def test_analysis_then_a_tool_call_with_the_recipient_after_or_before_the_channel(header) -> None:
    text = f'{THINK}{NEXT}{header}<|message|>{{"location": "Paris, FR", "unit": "°C"}}<|call|>'
    delta = parsed_every_way(HarmonyParser, text)
    assert delta.reasoning == "User wants the weather in Paris. Use get_weather."
    assert delta.content == ""
    assert calls(delta) == [("get_weather", {"location": "Paris, FR", "unit": "°C"})]
    assert "°C" in delta.tool_calls[0].arguments  # re-dumped without ASCII escapes


def test_two_tool_calls_in_a_row() -> None:
    text = (
        f"{THINK}{NEXT}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        f'{{"location": "Paris"}}<|call|>{NEXT} to=functions.get_time<|channel|>commentary json'
        '<|message|>{"tz": "Europe/Paris"}<|call|>'
    )
    delta = parsed_every_way(HarmonyParser, text)
    assert calls(delta) == [("get_weather", {"location": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
    assert delta.content == ""


def test_a_commentary_preamble_is_content_before_the_call() -> None:
    text = (
        f"{THINK}{NEXT}<|channel|>commentary<|message|>Let me check the weather for you.<|end|>"
        f"{NEXT}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"location":"Paris"}<|call|>'
    )
    delta = parsed_every_way(HarmonyParser, text)
    assert delta.content == "Let me check the weather for you."
    assert calls(delta) == [("get_weather", {"location": "Paris"})]


def test_a_recipient_starting_with_a_bang_is_reasoning() -> None:
    text = (
        " to=!memory<|channel|>commentary<|message|>User prefers Celsius.<|end|>"
        f"{NEXT}<|channel|>final<|message|>Noted: Celsius from now on.<|return|>"
    )
    delta = parsed_every_way(HarmonyParser, text)
    assert (delta.reasoning, delta.content) == ("User prefers Celsius.", "Noted: Celsius from now on.")


@pytest.mark.parametrize(
    "text",
    ["The capital of France is Paris.", " tomorrow: a <|pipe| and a < stay as written", "<"],
)
def test_plain_text_without_markup_is_content(text) -> None:
    delta = parsed_every_way(HarmonyParser, text)
    assert (delta.content, delta.reasoning, delta.tool_calls) == (text, "", [])


def test_a_stream_cut_inside_a_special_token_holds_it_until_flushed() -> None:
    text = f"{THINK}{NEXT}<|channel|>final<|message|>It is sunny.<|ret"
    delta = parsed_every_way(HarmonyParser, text)
    assert (delta.reasoning, delta.content) == (
        "User wants the weather in Paris. Use get_weather.",
        "It is sunny.<|ret",
    )
    parser = HarmonyParser()
    assert parser.push(text).content == "It is sunny."
    assert parser.flush().content == "<|ret"


def test_bodies_stream_as_they_arrive_and_calls_come_whole() -> None:
    parser = HarmonyParser()
    assert parser.push("<|channel|>analysis<|message|>Need").reasoning == "Need"
    assert parser.push(" weather.<|en").reasoning == " weather."
    assert not parser.push("d|><|start|>assistant<|channel|>commentary to=functions.get_weather")
    assert not parser.push(' <|constrain|>json<|message|>{"location": "Par')
    assert calls(parser.push('is"}<|call|>')) == [("get_weather", {"location": "Paris"})]
    assert not parser.flush()


def test_a_call_whose_arguments_do_not_parse_stays_as_content() -> None:
    body = '{"location": "Paris", "unit": '
    header = "<|channel|>commentary to=functions.get_weather <|constrain|>json"
    text = f"{THINK}{NEXT}{header}<|message|>{body}<|call|>"
    delta = parsed_every_way(HarmonyParser, text)
    assert (delta.content, delta.tool_calls) == (body, [])


@pytest.mark.parametrize(
    ("tail", "content", "tool_calls"),
    [
        ("<|channel|>final<|message|>Sunny, 24 °C.", "Sunny, 24 °C.", []),
        (
            '<|channel|>commentary to=functions.get_weather json<|message|>{"location": "Paris"}',
            "",
            [("get_weather", {"location": "Paris"})],
        ),
        ('<|channel|>commentary to=functions.get_weather json<|message|>{"loc', '{"loc', []),
        ("<|channel|>final to", "", []),  # a dangling header: nothing to show
    ],
)
def test_a_stream_that_stops_without_an_end_token(tail, content, tool_calls) -> None:
    delta = parsed_every_way(HarmonyParser, f"{THINK}{NEXT}{tail}")
    assert delta.reasoning == "User wants the weather in Paris. Use get_weather."
    assert (delta.content, calls(delta)) == (content, tool_calls)
