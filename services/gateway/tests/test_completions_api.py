"""POST /v1/completions request checks (pure): one prompt, clear 400s for what is not supported."""

from __future__ import annotations

import json

import pytest

from fleet_gateway.completions_api import (
    DEFAULT_COMPLETION_TOKENS,
    parse_completion_request,
    text_completion_response,
)
from fleet_gateway.errors import ApiError
from fleet_gateway.frames import Finished
from fleet_gateway.parsing.output import Delta

pytestmark = pytest.mark.unit


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def test_a_string_or_token_ids_parse_with_openais_default_length() -> None:
    assert parse_completion_request(body()).max_tokens == DEFAULT_COMPLETION_TOKENS
    assert parse_completion_request(body(prompt=[1, 2, 3])).prompt == [1, 2, 3]
    assert parse_completion_request(body(prompt=["one"])).prompt == ["one"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"logprobs": 6}, "logprobs"),
        ({"n": 0}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"model": " "}, "model"),
    ],
)
def test_unsupported_or_invalid_fields_are_400(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as error:
        parse_completion_request(body(**fields))
    assert error.value.status == 400 and error.value.param == param


def test_the_response_is_a_text_completion() -> None:
    reply = text_completion_response("cmpl-1", "m", 0, [(Delta(content="text"), Finished("length", 3, 2))])
    assert reply["object"] == "text_completion" and reply["choices"][0]["text"] == "text"
    assert reply["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
