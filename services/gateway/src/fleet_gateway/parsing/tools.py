"""Tool calls in model text, one parser per format, and which format a chat template implies.

- hermes (Qwen2.5/3, Hermes, SmolLM3 ...): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- json (Llama 3.x and templates that ask for bare JSON): the message is one JSON object
  `{"name": ..., "parameters" | "arguments": {...}}`, or several separated by ";", optionally after
  `<|python_tag|>`
- dsml (DeepSeek V3.2): `<|DSML|function_calls>` holding `<|DSML|invoke name="f">` elements with
  `<|DSML|parameter name="p" string="true|false">value</|DSML|parameter>` (string="false": JSON;
  the bars around DSML are U+FF5C FULLWIDTH VERTICAL LINE)
- harmony (gpt-oss): channels and `to=functions.f` recipients (parsing/harmony.py; it splits the
  reasoning too)

A call that does not parse stays in the content as the model wrote it: nothing is lost.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Protocol

from fleet_gateway.parsing.harmony import HARMONY, HarmonyParser
from fleet_gateway.parsing.output import Delta, ToolCall
from fleet_gateway.parsing.tags import ENTER, EXIT, INSIDE, OUTSIDE, TagSplitter


class ToolParser(Protocol):
    def push(self, text: str) -> Delta: ...

    def flush(self) -> Delta: ...


def _call(name: object, arguments: object) -> ToolCall | None:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):  # some models send the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _json_call(obj: object) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    return _call(obj.get("name"), obj.get("arguments", obj.get("parameters")))


class TaggedCalls:
    """Calls between an open and a close tag; `parse(inner)` turns one block into calls."""

    def __init__(self, open_tag: str, close_tag: str, parse: Callable[[str], list[ToolCall]]) -> None:
        self._open, self._close = open_tag, close_tag
        self._tags = TagSplitter(open_tag, close_tag)
        self._parse = parse
        self._inner = ""

    def push(self, text: str) -> Delta:
        return self._delta(self._tags.push(text), final=False)

    def flush(self) -> Delta:
        return self._delta(self._tags.flush(), final=True)

    def _delta(self, pieces: list[tuple[str, str]], final: bool) -> Delta:
        delta = Delta()
        for kind, text in pieces:
            if kind == OUTSIDE:
                delta.content += text
            elif kind == INSIDE:
                self._inner += text
            elif kind == EXIT:
                calls = self._parse(self._inner)
                if calls:
                    delta.tool_calls += calls
                else:
                    delta.content += self._open + self._inner + self._close
                self._inner = ""
            elif kind == ENTER:
                self._inner = ""
        if final and self._tags.inside:  # cut off inside a call: give the text back
            delta.content += self._open + self._inner
            self._inner = ""
        return delta


def parse_hermes(inner: str) -> list[ToolCall]:
    try:
        call = _json_call(json.loads(inner))
    except ValueError:
        return []
    return [call] if call else []


def hermes_parser() -> TaggedCalls:
    return TaggedCalls("<tool_call>", "</tool_call>", parse_hermes)


DSML = "\uff5cDSML\uff5c"
DSML_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]+)">(.*?)</{DSML}invoke>', re.S)
DSML_PARAMETER = re.compile(
    rf'<{DSML}parameter name="([^"]+)" string="(true|false)">(.*?)</{DSML}parameter>', re.S
)


def parse_dsml(inner: str) -> list[ToolCall]:
    calls = []
    for name, body in DSML_INVOKE.findall(inner):
        arguments: dict[str, object] = {}
        for parameter, is_string, value in DSML_PARAMETER.findall(body):
            if is_string == "true":
                arguments[parameter] = value
                continue
            try:
                arguments[parameter] = json.loads(value)
            except ValueError:
                return []
        calls.append(ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))
    return calls


def dsml_parser() -> TaggedCalls:
    return TaggedCalls(f"<{DSML}function_calls>", f"</{DSML}function_calls>", parse_dsml)


PYTHON_TAG = "<|python_tag|>"


def json_values(text: str) -> list[object]:
    """The JSON values of `text`, one after another, ";"-separated or not (a ";" inside a string
    is part of it, which splitting on ";" would break). ValueError when one is not JSON."""
    decoder, at = json.JSONDecoder(), 0
    values: list[object] = []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values
        value, at = decoder.raw_decode(text, at)
        values.append(value)


class JsonCalls:
    """A message that is a JSON tool call (or several, ";"-separated) instead of an answer: held
    until the end once it starts like one, streamed as content otherwise."""

    def __init__(self) -> None:
        self._held = ""
        self._mode = ""  # "" undecided, "text", "json"

    def push(self, text: str) -> Delta:
        if self._mode == "text":
            return Delta(content=text)
        self._held += text
        start = self._held.lstrip()
        if not start or (PYTHON_TAG.startswith(start) and len(start) < len(PYTHON_TAG)):
            return Delta()  # nothing to decide on yet
        if start.startswith(("{", "[", PYTHON_TAG)):
            self._mode = "json"
            return Delta()
        self._mode, held, self._held = "text", self._held, ""
        return Delta(content=held)

    def flush(self) -> Delta:
        held, self._held = self._held, ""
        if self._mode != "json":
            return Delta(content=held)
        body = held.strip().removeprefix(PYTHON_TAG).strip()
        calls = []
        try:
            objects = json_values(body)
        except ValueError:
            return Delta(content=held)
        if len(objects) == 1 and isinstance(objects[0], list):
            objects = objects[0]
        for obj in objects:
            call = _json_call(obj)
            if call is None:
                return Delta(content=held)
            calls.append(call)
        return Delta(tool_calls=calls) if calls else Delta(content=held)


PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": hermes_parser,
    "json": JsonCalls,
    "dsml": dsml_parser,
    HARMONY: HarmonyParser,
}


def infer_tool_parser(chat_template: str) -> str:
    """The tool-call format a chat template asks for ("" when it renders no tools). Harmony
    (gpt-oss) is told apart by its channel tokens."""
    if DSML in chat_template:
        return "dsml"
    if "<|channel|>" in chat_template:
        return HARMONY
    if "<tool_call>" in chat_template:
        return "hermes"
    if PYTHON_TAG in chat_template or "tools" in chat_template:
        return "json"
    return ""
