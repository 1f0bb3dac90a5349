"""Each client's way of asking for a structured output -> the engine's StructuredOutput (pure), and
the 400s naming the client's field when the ask is malformed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fleet_gateway import completions_api, ollama_api, openai_api, responses_api
from fleet_gateway.errors import ApiError
from fleet_gateway.sampling import SamplingAsk, to_sampling
from fleet_proto import StructuredOutput

pytestmark = pytest.mark.unit

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SCHEMA_TEXT = json.dumps(SCHEMA)
TAG = json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}})
USER = [{"role": "user", "content": "hi"}]


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def engine_spec(ask: SamplingAsk) -> StructuredOutput | None:
    return to_sampling(ask, (2,), max_model_len=2048, prompt_len=10).structured


def chat_spec(**fields: Any) -> StructuredOutput | None:
    req = openai_api.parse_chat_request(body(model="m", messages=USER, **fields))
    return engine_spec(openai_api.sampling_ask(req))


def chat_error(**fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        openai_api.parse_chat_request(body(model="m", messages=USER, **fields))
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}},
            StructuredOutput(json_schema=SCHEMA_TEXT),
        ),
        (  # strict or not, the output is constrained (as vLLM does)
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "city", "schema": SCHEMA, "strict": False},
                }
            },
            StructuredOutput(json_schema=SCHEMA_TEXT),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(json_schema=SCHEMA_TEXT)),
        ({"structured_outputs": {"json": SCHEMA_TEXT}}, StructuredOutput(json_schema=SCHEMA_TEXT)),
        ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, StructuredOutput(regex=r"\d{3}-\d{4}")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput(choice=("yes", "no"))),
        ({"structured_outputs": {"grammar": 'root ::= "a"+'}}, StructuredOutput(grammar='root ::= "a"+')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput(json_object=True)),
        ({"structured_outputs": {"json_object": False}}, None),
        ({"structured_outputs": {"structural_tag": TAG}}, StructuredOutput(structural_tag=TAG)),
        ({"guided_json": SCHEMA}, StructuredOutput(json_schema=SCHEMA_TEXT)),
        ({"guided_regex": "[ab]+"}, StructuredOutput(regex="[ab]+")),
        ({"guided_choice": ["red", "blue"]}, StructuredOutput(choice=("red", "blue"))),
        ({"guided_grammar": 'root ::= "x"'}, StructuredOutput(grammar='root ::= "x"')),
    ],
)
def test_chat_asks_become_the_engines_structured_output(fields: dict, expected) -> None:
    assert chat_spec(**fields) == expected


def test_text_completions_ask_the_same_way() -> None:
    req = completions_api.parse_completion_request(
        body(model="m", prompt="hi", response_format={"type": "json_object"})
    )
    assert engine_spec(completions_api.sampling_ask(req)) == StructuredOutput(json_object=True)
    req = completions_api.parse_completion_request(body(model="m", prompt="hi", guided_choice=["a", "b"]))
    assert engine_spec(completions_api.sampling_ask(req)) == StructuredOutput(choice=("a", "b"))


def test_the_constraint_remembers_the_field_that_asked() -> None:
    """An engine refusing the spec later names this field."""
    req = openai_api.parse_chat_request(
        body(model="m", messages=USER, response_format={"type": "json_object"})
    )
    assert openai_api.sampling_ask(req).constraint.param == "response_format"
    req = openai_api.parse_chat_request(body(model="m", messages=USER, structured_outputs={"regex": "a"}))
    assert openai_api.sampling_ask(req).constraint.param == "structured_outputs.regex"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"json": {"minLength": -1}}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": {"$schema": 5}}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": [1]}}, "structured_outputs.choice[0]"),
        ({"structured_outputs": {"grammar": "  \n"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"structural_tag": "[]"}}, "structured_outputs.structural_tag"),
        ({"guided_regex": "a{2,1}"}, "guided_regex"),
        ({"guided_json": {"type": "strin"}}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": ""}, "guided_grammar"),
        # more than one constraint: the second one named
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs.choice"),
    ],
)
def test_malformed_asks_are_400_naming_the_field(fields: dict, param: str) -> None:
    assert chat_error(**fields).param == param


def test_a_bad_schema_says_what_and_where() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "strin"}}}
    error = chat_error(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    assert "not a valid JSON Schema" in error.message and "$.properties.city.type" in error.message


def test_two_constraints_name_both() -> None:
    error = chat_error(response_format={"type": "json_object"}, structured_outputs={"regex": "a"})
    assert "'response_format' and 'structured_outputs.regex'" in error.message


# ---------------------------------------------------------------- Responses' text.format


def responses_request(text: dict) -> responses_api.ResponsesRequest:
    return responses_api.parse_responses_request(body(model="m", input="hi", text=text))


def test_responses_text_format_constrains_and_is_echoed() -> None:
    req = responses_request({"format": {"type": "json_schema", "name": "city", "schema": SCHEMA}})
    assert engine_spec(responses_api.sampling_ask(req)) == StructuredOutput(json_schema=SCHEMA_TEXT)
    assert responses_api.sampling_ask(req).constraint.param == "text.format"
    echoed = responses_api.skeleton("resp_1", "m", req, 0)["text"]["format"]
    assert (echoed["type"], echoed["name"], echoed["schema"]) == ("json_schema", "city", SCHEMA)
    req = responses_request({"format": {"type": "json_object"}})
    assert engine_spec(responses_api.sampling_ask(req)) == StructuredOutput(json_object=True)
    assert responses_api.skeleton("resp_1", "m", req, 0)["text"] == {"format": {"type": "json_object"}}
    plain = responses_api.parse_responses_request(body(model="m", input="hi"))
    assert engine_spec(responses_api.sampling_ask(plain)) is None
    assert responses_api.skeleton("resp_1", "m", plain, 0)["text"] == {"format": {"type": "text"}}


@pytest.mark.parametrize(
    ("text", "param"),
    [
        ({"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}, "text.format.schema"),
        ({"format": {"type": "json_schema", "name": "x"}}, "text.format.schema"),
        ({"format": {"type": "yaml"}}, "text.format.type"),
    ],
)
def test_responses_malformed_text_format_is_400(text: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        responses_request(text)
    assert (info.value.status, info.value.param) == (400, param)


# ---------------------------------------------------------------- Ollama's format


def ollama_spec(format: Any) -> StructuredOutput | None:
    req = ollama_api.parse_chat_request(body(model="m", messages=USER, format=format))
    return engine_spec(ollama_api.sampling_ask(req))


def test_ollama_format_json_or_a_schema() -> None:
    assert ollama_spec("json") == StructuredOutput(json_object=True)
    assert ollama_spec(SCHEMA) == StructuredOutput(json_schema=SCHEMA_TEXT)
    assert ollama_spec("") is None
    req = ollama_api.parse_generate_request(body(model="m", prompt="hi", format="json"))
    assert ollama_api.sampling_ask(req).constraint.param == "format"


@pytest.mark.parametrize("format", ["yaml", {"type": 5}, {"required": "city"}])
def test_ollama_malformed_format_is_400(format: Any) -> None:
    with pytest.raises(ApiError) as info:
        ollama_api.parse_chat_request(body(model="m", messages=USER, format=format))
    assert (info.value.status, info.value.param) == (400, "format")
