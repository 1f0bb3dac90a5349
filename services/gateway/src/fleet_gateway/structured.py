"""Structured outputs: each client's way of asking for JSON, a regex, a choice or a grammar -> the
engine's `StructuredOutput` (pure), with 400s naming the client's field.

- OpenAI chat and text completions: `response_format` (json_object, json_schema) and vLLM's extras,
  `structured_outputs` {json, regex, choice, grammar, json_object, structural_tag} and the older
  guided_json / guided_regex / guided_choice / guided_grammar;
- OpenAI Responses: `text.format` (json_object, json_schema);
- Ollama: `format` ("json", or a JSON schema).

A request asks for one constraint at most. json_schema's `strict` changes nothing: the output is
constrained either way, as vLLM does. The gateway checks what it can cheaply (a well-formed JSON
Schema, Python's regex syntax, a non-empty choice or grammar); the engine's grammar compiler refuses
the rest, and that refusal becomes a 400 naming `Constraint.param`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for

from fleet_gateway.errors import ApiError
from fleet_proto import StructuredOutput


@dataclass(frozen=True)
class Constraint:
    """What the completion must match, and the client's field that asked (an engine's refusal names it)."""

    output: StructuredOutput
    param: str


class JsonSchemaSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    name: str
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # constrained whether true or not (vLLM's behaviour)
    description: str | None = None


class TextFormat(msgspec.Struct, frozen=True, tag_field="type", tag="text", forbid_unknown_fields=False):
    pass


class JsonObjectFormat(
    msgspec.Struct, frozen=True, tag_field="type", tag="json_object", forbid_unknown_fields=False
):
    pass


class JsonSchemaFormat(
    msgspec.Struct, frozen=True, tag_field="type", tag="json_schema", forbid_unknown_fields=False
):
    """Chat completions' `response_format`: the schema nested under `json_schema`."""

    json_schema: JsonSchemaSpec


class FlatJsonSchemaFormat(
    JsonSchemaSpec, frozen=True, tag_field="type", tag="json_schema", forbid_unknown_fields=False
):
    """The Responses API's `text.format`: the same fields, not nested."""


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat
ResponsesTextFormat = TextFormat | JsonObjectFormat | FlatJsonSchemaFormat


class StructuredOutputsAsk(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """vLLM's `structured_outputs` body field (its StructuredOutputsParams); its other keys are ignored."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


# ---------------------------------------------------------------- one kind of spec each


def schema_problem(schema: dict[str, Any]) -> str:
    """Why `schema` is not a JSON Schema ("" when it is), by its own `$schema` draft (else 2020-12)."""
    if not isinstance(schema.get("$schema", ""), str):
        return "'$schema' must be a string"  # validator_for would crash on it
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        return f"{exc.message} (at {exc.json_path})"
    except RecursionError:
        return "it is nested too deeply"
    return ""


def _json_object(text: str, param: str, expected: str) -> dict[str, Any]:
    """JSON text that must hold an object; 400 naming `param` otherwise."""
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _bad(param, f"Invalid '{param}': not JSON text ({exc}).") from None
    if not isinstance(parsed, dict):
        raise _bad(param, f"Invalid '{param}': expected {expected}.")
    return parsed


def json_schema(schema: str | dict[str, Any], param: str) -> StructuredOutput:
    """A JSON Schema object, or its JSON text (vLLM's `json` and `guided_json` take both)."""
    if isinstance(schema, str):
        schema = _json_object(schema, param, "a JSON Schema object")
    if not isinstance(schema, dict):
        raise _bad(param, f"Invalid '{param}': expected a JSON Schema object.")
    problem = schema_problem(schema)
    if problem:
        raise _bad(param, f"Invalid '{param}': not a valid JSON Schema: {problem}.")
    return StructuredOutput(json_schema=json.dumps(schema))


def regex(pattern: str, param: str) -> StructuredOutput:
    try:
        re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        raise _bad(param, f"Invalid '{param}': not a regular expression ({exc}).") from None
    return StructuredOutput(regex=pattern)


def choice(choices: list[str], param: str) -> StructuredOutput:
    if not choices:
        raise _bad(param, f"Invalid '{param}': expected at least one choice.")
    return StructuredOutput(choice=tuple(choices))


def grammar(ebnf: str, param: str) -> StructuredOutput:
    if not ebnf.strip():
        raise _bad(param, f"Invalid '{param}': the grammar is empty.")
    return StructuredOutput(grammar=ebnf)


def structural_tag(tag: str, param: str) -> StructuredOutput:
    """xgrammar's structural-tag JSON; its contents are for the engine's compiler to judge."""
    _json_object(tag, param, "a JSON object")
    return StructuredOutput(structural_tag=tag)


# ---------------------------------------------------------------- each client's field


def response_format(fmt: ResponseFormat | ResponsesTextFormat | None, param: str) -> Constraint | None:
    """OpenAI's `response_format` (chat, text completions) or `text.format` (Responses)."""
    if isinstance(fmt, JsonObjectFormat):
        return Constraint(StructuredOutput(json_object=True), param)
    if isinstance(fmt, JsonSchemaFormat):
        return Constraint(_named_schema(fmt.json_schema, f"{param}.json_schema"), param)
    if isinstance(fmt, FlatJsonSchemaFormat):
        return Constraint(_named_schema(fmt, param), param)
    return None


def _named_schema(spec: JsonSchemaSpec, where: str) -> StructuredOutput:
    if spec.schema is None:
        raise _bad(f"{where}.schema", f"Missing required parameter: '{where}.schema'.")
    return json_schema(spec.schema, f"{where}.schema")


# A field's value and its param -> the constraint; each maker takes its own field's kind of value.
Maker = Callable[[Any, str], StructuredOutput]


def structured_outputs(ask: StructuredOutputsAsk | None) -> list[Constraint]:
    """Every constraint set in vLLM's `structured_outputs`, each named by its key
    (`structured_outputs.regex`); one_constraint refuses more than one."""
    if ask is None:
        return []
    asked: list[tuple[str, object, Maker]] = [
        ("json", ask.json, json_schema),
        ("regex", ask.regex, regex),
        ("choice", ask.choice, choice),
        ("grammar", ask.grammar, grammar),
        ("structural_tag", ask.structural_tag, structural_tag),
    ]
    found = [
        Constraint(make(value, f"structured_outputs.{key}"), f"structured_outputs.{key}")
        for key, value, make in asked
        if value is not None
    ]
    if ask.json_object:
        found.append(Constraint(StructuredOutput(json_object=True), "structured_outputs.json_object"))
    return found


def guided(
    guided_json: str | dict[str, Any] | None,
    guided_regex: str | None,
    guided_choice: list[str] | None,
    guided_grammar: str | None,
) -> list[Constraint]:
    """vLLM's older guided_* fields, each its own param."""
    asked: list[tuple[str, object, Maker]] = [
        ("guided_json", guided_json, json_schema),
        ("guided_regex", guided_regex, regex),
        ("guided_choice", guided_choice, choice),
        ("guided_grammar", guided_grammar, grammar),
    ]
    return [Constraint(make(value, name), name) for name, value, make in asked if value is not None]


def ollama_format(fmt: str | dict[str, Any] | None) -> Constraint | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema; "" or absent: free text."""
    if not fmt:
        return None
    if isinstance(fmt, dict):
        return Constraint(json_schema(fmt, "format"), "format")
    if fmt != "json":
        raise _bad("format", f'format {fmt!r} is not supported: use "json" or a JSON schema')
    return Constraint(StructuredOutput(json_object=True), "format")


def one_constraint(asked: list[Constraint]) -> Constraint | None:
    """The request's constraint; 400 when it asks for several (an engine applies one)."""
    if len(asked) > 1:
        fields = " and ".join(f"'{c.param}'" for c in asked)
        raise _bad(asked[1].param, f"Only one structured output per request: this one asks in {fields}.")
    return asked[0] if asked else None
