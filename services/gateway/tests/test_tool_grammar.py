"""Forced tool calls as xgrammar structural tags (pure): for every format the gateway constrains, a
sample of the text the grammar allows is read back as calls by that format's own parser, and
xgrammar's matcher accepts it (one call only when parallel calls are off); the adapters' tool_choice
fields become ForcedCalls, with 400s naming tool_choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet_gateway import anthropic_api, openai_api, responses_api
from fleet_gateway.errors import ApiError
from fleet_gateway.parsing.output import Delta
from fleet_gateway.parsing.reasoning import ThinkParser
from fleet_gateway.parsing.tools import DSML, PARSERS
from fleet_gateway.sampling import SamplingAsk
from fleet_gateway.structured import Constraint
from fleet_gateway.tokenizer import ChatTokenizer
from fleet_gateway.tool_grammar import FORMATS, ForcedCalls, forced_calls, tool_call_tag, with_forced_calls
from fleet_proto import StructuredOutput

from .tiny_tokenizer import IM_END_ID, make_tiny_tokenizer_folder

FORECAST = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["unit", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: any object
]
FIRST = ("forecast", {"unit": "celsius", "days": 3})
SECOND = ("ping", {"host": "a;b"})  # a ";" inside a string must not split Llama's calls


def hermes(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def llama(name: str, arguments: dict) -> str:
    return f'{{"name": "{name}", "parameters": {json.dumps(arguments)}}}'


def dsml_invoke(name: str, arguments: dict) -> str:
    parameters = "".join(
        f'<{DSML}parameter name="{key}" string="{str(isinstance(value, str)).lower()}">'
        f"{value if isinstance(value, str) else json.dumps(value)}</{DSML}parameter>\n"
        for key, value in arguments.items()
    )
    return f'<{DSML}invoke name="{name}">\n{parameters}</{DSML}invoke>\n'


def dsml(*invokes: str) -> str:
    return f"<{DSML}function_calls>\n{''.join(invokes)}</{DSML}function_calls>"


def harmony(name: str, arguments: dict) -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{json.dumps(arguments)}"


# format -> (one call, two calls or None where the format holds one call a turn)
SAMPLES = {
    "hermes": (hermes(*FIRST), hermes(*FIRST) + "\n" + hermes(*SECOND)),
    "json": (llama(*FIRST), llama(*FIRST) + "; " + llama(*SECOND)),
    "dsml": (dsml(dsml_invoke(*FIRST)), dsml(dsml_invoke(*FIRST), dsml_invoke(*SECOND))),
    "harmony": (harmony(*FIRST), None),
}


def parsed(tool_format: str, text: str) -> Delta:
    parser = PARSERS[tool_format]()
    return parser.push(text).merge(parser.flush())


def calls(delta: Delta) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in delta.tool_calls]


def accepts(tag: str, text: str) -> bool:
    """Whether xgrammar's matcher takes `text` whole and ends there (no tokenizer: strings only)."""
    xgr = pytest.importorskip("xgrammar")
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_structural_tag(tag)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def tag_of(
    tool_format: str, parallel: bool = True, name: str | None = None, closes_think: bool = False
) -> str:
    return tool_call_tag(tool_format, forced_calls(TOOLS, name, parallel, "tool_choice"), closes_think)


def test_every_format_the_parsers_read_is_constrained() -> None:
    assert set(FORMATS) == set(PARSERS) == set(SAMPLES)


@pytest.mark.parametrize("tool_format", sorted(SAMPLES))
def test_the_constrained_text_parses_back_into_the_calls(tool_format: str) -> None:
    one, two = SAMPLES[tool_format]
    assert calls(parsed(tool_format, one)) == [FIRST]
    assert accepts(tag_of(tool_format), one) and accepts(tag_of(tool_format, parallel=False), one)
    if two is not None:
        assert calls(parsed(tool_format, two)) == [FIRST, SECOND]
        assert accepts(tag_of(tool_format), two)
        assert not accepts(tag_of(tool_format, parallel=False), two)


@pytest.mark.parametrize("tool_format", sorted(SAMPLES))
def test_only_calls_of_the_allowed_tools_within_their_schema(tool_format: str) -> None:
    one, _ = SAMPLES[tool_format]
    assert not accepts(tag_of(tool_format), "")  # at least one call
    assert not accepts(tag_of(tool_format), "Sure! " + one)  # no text around the calls
    assert accepts(tag_of(tool_format, name="forecast"), one)
    assert not accepts(tag_of(tool_format, name="ping"), one)
    wrong = one.replace("celsius", "kelvin")
    assert not accepts(tag_of(tool_format), wrong)


def test_a_think_block_the_prompt_opens_is_closed_before_the_call() -> None:
    text = "</think>\n\n" + hermes(*FIRST)
    assert accepts(tag_of("hermes", closes_think=True), text)
    assert not accepts(tag_of("hermes", closes_think=True), hermes(*FIRST))
    think = ThinkParser.for_prompt("<|im_start|>assistant\n<think>\n")
    split = think.push(text).merge(think.flush())
    assert split.reasoning == "" and calls(parsed("hermes", split.content)) == [FIRST]


def test_the_engines_tokens_reach_the_end_and_then_only_stop_tokens(tmp_path: Path) -> None:
    """As an engine runs it: token ids of a tokenizer (the tiny byte-level one), then its stop token."""
    xgr = pytest.importorskip("xgrammar")
    transformers = pytest.importorskip("transformers")
    folder = make_tiny_tokenizer_folder(tmp_path)
    info = xgr.TokenizerInfo.from_huggingface(
        transformers.AutoTokenizer.from_pretrained(str(folder)), stop_token_ids=[IM_END_ID]
    )
    tag = tag_of("hermes", parallel=False, closes_think=True)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(tag))
    text = "</think>\n\n" + hermes(*FIRST)
    assert all(matcher.accept_token(token) for token in ChatTokenizer.from_folder(folder).encode(text))
    assert not matcher.is_terminated() and matcher.accept_token(IM_END_ID) and matcher.is_terminated()


def test_a_format_not_constrained_yet_is_a_400_naming_tool_choice() -> None:
    with pytest.raises(ApiError) as refused:
        tool_call_tag("pythonic", ForcedCalls(tuple(TOOLS), True), False)
    assert (refused.value.status, refused.value.param) == (400, "tool_choice")
    assert "'pythonic'" in refused.value.message


def test_another_structured_output_beside_forced_calls_is_a_400() -> None:
    forced = forced_calls(TOOLS, None, True, "tool_choice")
    ask = with_forced_calls(SamplingAsk(), forced, "hermes", "<|im_start|>assistant\n")
    assert ask.constraint == Constraint(StructuredOutput(structural_tag=tag_of("hermes")), "tool_choice")
    json_mode = SamplingAsk(constraint=Constraint(StructuredOutput(json_object=True), "response_format"))
    with pytest.raises(ApiError) as refused:
        with_forced_calls(json_mode, forced, "hermes", "")
    assert refused.value.param == "tool_choice" and "'response_format'" in refused.value.message


# ---------------------------------------------------------------- each API's tool_choice

USER = [{"role": "user", "content": "weather?"}]
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
ANTHROPIC_TOOLS = [{"name": "forecast", "input_schema": FORECAST}, {"name": "ping"}]


def chat(**fields) -> ForcedCalls | None:
    body = json.dumps({"model": "m", "messages": USER, "tools": TOOLS, **fields}).encode()
    return openai_api.chat_forced_calls(openai_api.parse_chat_request(body))


def responses(**fields) -> ForcedCalls | None:
    body = json.dumps({"model": "m", "input": "weather?", "tools": RESPONSES_TOOLS, **fields}).encode()
    return responses_api.responses_forced_calls(responses_api.parse_responses_request(body))


def anthropic(**fields) -> ForcedCalls | None:
    body = {"model": "m", "max_tokens": 9, "messages": USER, "tools": ANTHROPIC_TOOLS, **fields}
    return anthropic_api.forced_tool_calls(anthropic_api.parse_messages_request(json.dumps(body).encode()))


def names(forced: ForcedCalls | None) -> tuple[list[str], bool] | None:
    return None if forced is None else ([t["function"]["name"] for t in forced.tools], forced.parallel)


BOTH = ["forecast", "ping"]


@pytest.mark.parametrize(
    ("ask", "fields", "expected"),
    [
        (chat, {}, None),
        (chat, {"tool_choice": "auto"}, None),
        (chat, {"tool_choice": "none"}, None),
        (chat, {"tool_choice": "required"}, (BOTH, True)),
        (chat, {"tool_choice": "required", "parallel_tool_calls": False}, (BOTH, False)),
        (chat, {"tool_choice": {"type": "function", "function": {"name": "ping"}}}, (["ping"], True)),
        (responses, {"tool_choice": "auto"}, None),
        (responses, {"tool_choice": "required", "parallel_tool_calls": False}, (BOTH, False)),
        (responses, {"tool_choice": {"type": "function", "name": "forecast"}}, (["forecast"], True)),
        (anthropic, {"tool_choice": {"type": "auto"}}, None),
        (anthropic, {"tool_choice": {"type": "any"}}, (BOTH, True)),
        (anthropic, {"tool_choice": {"type": "any", "disable_parallel_tool_use": True}}, (BOTH, False)),
        (anthropic, {"tool_choice": {"type": "tool", "name": "ping"}}, (["ping"], True)),
    ],
)
def test_each_apis_tool_choice_becomes_forced_calls(ask, fields: dict, expected) -> None:
    assert names(ask(**fields)) == expected


def test_anthropic_tools_are_forced_as_the_template_renders_them() -> None:
    forced = anthropic(tool_choice={"type": "tool", "name": "forecast"})
    assert forced is not None and forced.tools[0]["function"]["parameters"] == FORECAST


@pytest.mark.parametrize(
    ("ask", "fields", "param", "says"),
    [
        (chat, {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        (chat, {"tool_choice": "required", "tools": None}, "tool_choice", "no 'tools'"),
        (chat, {"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        (chat, {"tool_choice": {"type": "allowed_tools"}}, "tool_choice", "allowed_tools"),
        (responses, {"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
        (responses, {"tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
        (anthropic, {"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice", "'nope'"),
        (anthropic, {"tool_choice": {"type": "tool"}}, "tool_choice.name", "required"),
        (anthropic, {"tool_choice": {"type": "some"}}, "tool_choice", '"some"'),
        (anthropic, {"tool_choice": {"type": "any"}, "tools": []}, "tool_choice", "no 'tools'"),
    ],
)
def test_a_tool_choice_that_cannot_be_met_is_a_400_naming_it(
    ask, fields: dict, param: str, says: str
) -> None:
    with pytest.raises(ApiError) as refused:
        ask(**fields)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert says in refused.value.message
