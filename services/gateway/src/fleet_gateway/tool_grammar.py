"""Forced tool calls (OpenAI's tool_choice "required" or a named function, Anthropic's "any" or
"tool") as an xgrammar structural tag, pure: the completion can only be calls of the allowed tools,
written in the model's own tool-call format, so that format's parser (parsing/tools.py) reads them
back as calls. Each argument object is constrained by its tool's `parameters` schema.

The texts around a call are the model's (its chat template's, as xgrammar's builtin_structural_tag.py
spells them too):
- hermes: `<tool_call>\n{"name": "f", "arguments": ARGS}\n</tool_call>`, several joined by "\n"
- json (Llama 3.x): `{"name": "f", "parameters": ARGS}`, several joined by "; "
- dsml (DeepSeek V3.2): `<|DSML|function_calls>\n`, then per call `<|DSML|invoke name="f">\n`,
  ARGS as DSML parameters, `</|DSML|invoke>\n`, then `</|DSML|function_calls>` (the bars are
  U+FF5C, as parsing/tools.py says)
- harmony (gpt-oss): `<|channel|>commentary to=functions.f <|constrain|>json<|message|>ARGS`; one
  call a turn, ended by the model's `<|call|>` stop token

A prompt that leaves a <think> block open has it closed first: a model left to reason may reason
until max_tokens, and the call is certain only when it comes first.

Plain dicts, not xgrammar's classes: xgrammar imports torch (~4 s) and only the engines compile it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fleet_gateway.errors import ApiError
from fleet_gateway.parsing.harmony import HARMONY
from fleet_gateway.parsing.reasoning import CLOSE as THINK_CLOSE
from fleet_gateway.parsing.reasoning import OPEN as THINK_OPEN
from fleet_gateway.parsing.tools import DSML
from fleet_gateway.sampling import SamplingAsk
from fleet_gateway.structured import Constraint, one_constraint
from fleet_proto import StructuredOutput

ANY_OBJECT = {"type": "object"}  # the arguments of a tool that declares no parameters
THINK_END = THINK_CLOSE + "\n\n"  # how Qwen3-style templates close a finished think block
# At most one whitespace character between JSON tokens: a sampled model cannot run on in whitespace
# (0, JSON without spaces, is not a value xgrammar takes).
MAX_WHITESPACE = 1


@dataclass(frozen=True)
class CallFormat:
    """A tool-call format's texts: before a call's arguments (given the tool's name) and after,
    between calls, around all of them; how the arguments are written (xgrammar's json_schema
    `style`); whether one turn can hold several calls."""

    begin: Callable[[str], str]
    end: str
    separator: str
    style: str = "json"
    opening: str = ""
    closing: str = ""
    several: bool = True


FORMATS = {
    "hermes": CallFormat(
        begin=lambda name: f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ',
        end="}\n</tool_call>",
        separator="\n",
    ),
    "json": CallFormat(
        begin=lambda name: f'{{"name": {json.dumps(name)}, "parameters": ',
        end="}",
        separator="; ",
    ),
    "dsml": CallFormat(
        begin=lambda name: f'<{DSML}invoke name="{name}">\n',
        end=f"</{DSML}invoke>\n",
        separator="",
        style="deepseek_xml",
        opening=f"<{DSML}function_calls>\n",
        closing=f"</{DSML}function_calls>",
    ),
    # The JSON is the message's body; the <|call|> stop token that ends it also ends the turn.
    HARMONY: CallFormat(
        begin=lambda name: f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
        end="",
        separator="",
        several=False,
    ),
}


@dataclass(frozen=True)
class ForcedCalls:
    """A tool choice that forces calls: of which tools (OpenAI function tools), whether several may
    come, and the client's field that asked (400s name it)."""

    tools: tuple[dict[str, Any], ...]
    parallel: bool
    param: str = "tool_choice"


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def tool_name(tool: dict[str, Any]) -> str:
    return tool.get("function", {}).get("name", "")


def forced_calls(
    tools: Sequence[dict[str, Any]] | None, name: str | None, parallel: bool, param: str
) -> ForcedCalls:
    """Calls of any of `tools` (name None) or of the one named; 400 naming `param` when there are no
    tools or none has that name."""
    if not tools:
        raise _bad(param, f"'{param}' forces a tool call, but the request has no 'tools'.")
    if name is None:
        return ForcedCalls(tuple(tools), parallel, param)
    named = tuple(tool for tool in tools if tool_name(tool) == name)
    if not named:
        known = ", ".join(repr(tool_name(tool)) for tool in tools)
        raise _bad(param, f"'{param}' names the tool {name!r}, which is not in 'tools' ({known}).")
    return ForcedCalls(named[:1], parallel, param)


def _call_tag(form: CallFormat, tool: dict[str, Any]) -> dict[str, Any]:
    arguments = {
        "type": "json_schema",
        "json_schema": tool["function"].get("parameters") or ANY_OBJECT,
        "style": form.style,
        "max_whitespace_cnt": MAX_WHITESPACE,
    }
    return {"type": "tag", "begin": form.begin(tool_name(tool)), "content": arguments, "end": form.end}


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def tool_call_tag(tool_format: str, forced: ForcedCalls, closes_think: bool) -> str:
    """xgrammar's structural tag (JSON text) for `forced` calls in `tool_format` (a parser name of
    parsing/tools.py); `closes_think`: the prompt leaves a <think> block open. 400 naming the
    tool choice for a format not constrained yet."""
    form = FORMATS.get(tool_format)
    if form is None:
        raise _bad(forced.param, f"'{forced.param}' cannot force calls in the {tool_format!r} format yet.")
    calls = {
        "type": "tags_with_separator",
        "tags": [_call_tag(form, tool) for tool in forced.tools],
        "separator": form.separator,
        "at_least_one": True,
        "stop_after_first": not (forced.parallel and form.several),
    }
    before = [_const(text) for text in (THINK_END if closes_think else "", form.opening) if text]
    after = [_const(form.closing)] if form.closing else []
    elements = [*before, calls, *after]
    shape = elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}
    return json.dumps({"type": "structural_tag", "format": shape}, ensure_ascii=False)


def with_forced_calls(
    ask: SamplingAsk, forced: ForcedCalls, tool_format: str, prompt_text: str
) -> SamplingAsk:
    """`ask` constrained to the forced calls, written in `tool_format` after `prompt_text` (the
    rendered prompt); 400 when the request also asks for another structured output."""
    opens_think = prompt_text.rstrip().endswith(THINK_OPEN)  # as ThinkParser.for_prompt decides
    tag = tool_call_tag(tool_format, forced, opens_think)
    calls = Constraint(StructuredOutput(structural_tag=tag), forced.param)
    constraint = one_constraint([c for c in (ask.constraint, calls) if c is not None])
    return dataclasses.replace(ask, constraint=constraint)
