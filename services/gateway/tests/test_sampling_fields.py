"""Penalties, logit_bias, min_tokens, stop_token_ids and n in every API that has them -> SamplingParams
(pure), with the same meaning everywhere and 400s naming the client's field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fleet_gateway import completions_api, ollama_api, openai_api
from fleet_gateway.errors import ApiError
from fleet_gateway.sampling import SamplingAsk, check_n, to_sampling
from fleet_proto import SamplingParams
from fleet_runtime.settings import load_settings

pytestmark = pytest.mark.unit

USER = [{"role": "user", "content": "hi"}]
EOS = (2,)


def chat_params(vocab_size: int = 0, **fields: Any) -> SamplingParams:
    req = openai_api.parse_chat_request(json.dumps({"model": "m", "messages": USER, **fields}).encode())
    return to_sampling(openai_api.sampling_ask(req), EOS, 2048, 10, vocab_size=vocab_size)


def chat_error(vocab_size: int = 0, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat_params(vocab_size, **fields)
    assert info.value.status == 400
    return info.value


def test_openai_fields_reach_the_engine() -> None:
    params = chat_params(
        presence_penalty=0.5,
        frequency_penalty=-1.5,
        logit_bias={"50": -100, "7": 5.5, "12": 0},
        min_tokens=3,
        max_tokens=10,
        stop_token_ids=[9, 2],
        repetition_penalty=1.1,
    )
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.5)
    assert params.logit_bias == ((7, 5.5), (12, 0.0), (50, -100.0))  # sorted by token id
    assert (params.min_tokens, params.max_tokens, params.repetition_penalty) == (3, 10, 1.1)
    assert params.stop_token_ids == (2, 9)  # the EOS ids, then the request's (once each)


def test_text_completions_share_the_fields() -> None:
    body = {"model": "m", "prompt": "hi", "presence_penalty": 1, "logit_bias": {"3": 1}, "min_tokens": 2}
    req = completions_api.parse_completion_request(json.dumps(body).encode())
    params = to_sampling(completions_api.sampling_ask(req), EOS, 2048, 10)
    assert (params.presence_penalty, params.logit_bias, params.min_tokens) == (1.0, ((3, 1.0),), 2)


def test_ignore_eos_keeps_the_requests_own_stop_tokens() -> None:
    assert chat_params(ignore_eos=True, stop_token_ids=[9]).stop_token_ids == (9,)
    assert chat_params(ignore_eos=True).stop_token_ids == ()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {" 1": 1}}, "logit_bias"),
        ({"logit_bias": {"1" * 30: 1}}, "logit_bias"),
        ({"logit_bias": {"1": 100.5}}, "logit_bias"),
        ({"logit_bias": {"1": "high"}}, "logit_bias[...]"),  # msgspec's path for a value
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 11, "max_tokens": 10}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["2"]}, "stop_token_ids[0]"),
        ({"n": 0}, "n"),
    ],
)
def test_out_of_range_fields_are_400_naming_them(fields: dict, param: str) -> None:
    assert chat_error(**fields).param == param


def test_token_ids_must_be_in_the_vocabulary_when_it_is_known() -> None:
    assert chat_params(vocab_size=0, logit_bias={"500": 1}).logit_bias == ((500, 1.0),)
    error = chat_error(vocab_size=400, logit_bias={"400": 1})
    assert error.param == "logit_bias" and "400" in error.message
    assert chat_error(vocab_size=400, stop_token_ids=[400]).param == "stop_token_ids"
    assert chat_params(vocab_size=400, logit_bias={"399": 1}).logit_bias == ((399, 1.0),)


def test_min_tokens_is_checked_against_the_default_budget_too() -> None:
    ask = SamplingAsk(min_tokens=50)
    assert to_sampling(ask, EOS, max_model_len=100, prompt_len=40).min_tokens == 50
    with pytest.raises(ApiError) as info:
        to_sampling(ask, EOS, max_model_len=100, prompt_len=60)  # 40 tokens of room left
    assert info.value.param == "min_tokens"


# ---------------------------------------------------------------- n


def test_n_is_bounded_by_the_operators_limit() -> None:
    check_n(1, 8)
    check_n(8, 8)
    for n in (0, 9):
        with pytest.raises(ApiError) as info:
            check_n(n, 8)
        assert (info.value.status, info.value.param) == (400, "n")
    assert "[1, 8]" in info.value.message


def test_the_limit_comes_from_fleet_max_n() -> None:
    assert load_settings({}).max_n == 8
    assert load_settings({"FLEET_MAX_N": "16"}).max_n == 16


# ---------------------------------------------------------------- Ollama's options


def ollama_request(options: dict) -> ollama_api.ChatRequest:
    return ollama_api.parse_chat_request(
        json.dumps({"model": "m", "messages": USER, "options": options}).encode()
    )


def test_ollama_options_map_to_the_same_sampling() -> None:
    options = {
        "repeat_penalty": 1.2,
        "presence_penalty": 0.3,
        "frequency_penalty": 0.4,
        "seed": 5,
        "min_p": 0.05,
        "top_k": 20,
        "num_predict": 7,
        "mirostat": 2,  # not a sampler Fleet has: ignored, as Ollama ignores what a runner does not take
    }
    params = to_sampling(ollama_api.sampling_ask(ollama_request(options)), EOS, 2048, 10)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.2, 0.3, 0.4)
    assert (params.seed, params.min_p, params.top_k, params.max_tokens) == (5, 0.05, 20, 7)


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"repeat_penalty": 0}, "options.repeat_penalty"),
        ({"presence_penalty": 9}, "options.presence_penalty"),
        ({"frequency_penalty": -9}, "options.frequency_penalty"),
        ({"temperature": -1}, "options.temperature"),
        ({"num_predict": 0, "top_p": 2}, "options.top_p"),
    ],
)
def test_ollama_bad_options_name_the_option(options: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        ollama_request(options)
    assert (info.value.status, info.value.param) == (400, param)
