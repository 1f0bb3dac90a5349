"""OpenAI chat completions adapter and OpenAI-style errors: parsing, validation, mapping, response shapes.

Past ~450 lines as one file: its cases follow openai_api.py's sections one for one, and a split by
section would scatter the shared request builders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fleet_gateway.detokenize import IncrementalDetokenizer
from fleet_gateway.errors import ApiError, api_error, error_middleware, error_type_for
from fleet_gateway.frames import sse_data
from fleet_gateway.openai_api import (
    SSE_DONE,
    ChatCompletionRequest,
    chat_choice,
    chunk,
    completion_response,
    first_chunk,
    include_usage,
    messages_for_template,
    new_completion_id,
    parse_chat_request,
    sampling_ask,
    stop_strings,
    usage,
    usage_chunk,
)
from fleet_gateway.parsing.output import Delta
from fleet_gateway.sampling import engine_finish_reason, to_sampling
from fleet_gateway.stops import StopMatcher
from fleet_gateway.tokenizer import ChatTokenizer
from fleet_proto.messages import SamplingParams

from .tiny_tokenizer import IM_END_ID, make_tiny_tokenizer_folder

pytestmark = pytest.mark.unit

USER = [{"role": "user", "content": "hi"}]


def _body(**fields: Any) -> bytes:
    base: dict[str, Any] = {"model": "smollm2", "messages": USER}
    for key, value in fields.items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = value
    return json.dumps(base).encode()


def _error(body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_chat_request(body)
    return info.value


# ---------------------------------------------------------------- parsing


def test_minimal_request_and_defaults() -> None:
    req = parse_chat_request(_body())
    assert req.model == "smollm2"
    assert req.stream is False
    assert req.max_tokens is None and req.temperature is None and req.stop is None
    assert messages_for_template(req) == [{"role": "user", "content": "hi"}]
    assert stop_strings(req) == []
    assert not include_usage(req)


def test_unknown_fields_are_tolerated() -> None:
    req = parse_chat_request(_body(response_format={"type": "text"}, metadata={"a": "b"}, store=False))
    assert req.model == "smollm2"


def test_all_known_fields_parse() -> None:
    req = parse_chat_request(
        _body(
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=10,
            temperature=0,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            repetition_penalty=1.1,
            seed=7,
            stop=["\n\n", "", "END"],
            n=1,
            presence_penalty=0,
            frequency_penalty=0.0,
            user="u1",
            logprobs=False,
        )
    )
    assert include_usage(req)
    assert stop_strings(req) == ["\n\n", "END"]
    assert req.temperature == 0.0 and req.top_k == 40 and req.seed == 7


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (b'{"model": "m", "messages": [], "temperature": NaN}', None),
        (_body(model=None), "model"),
        (_body(messages=None), "messages"),
        (_body(model=1), "model"),
        (_body(model="  "), "model"),
        (_body(messages=[]), "messages"),
        (_body(messages="hi"), "messages"),
        (_body(messages=[{"content": "hi"}]), "messages[0].role"),
        (
            _body(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": 5}]),
            "messages[1].content",
        ),
        (_body(messages=[{"role": "bot", "content": "hi"}]), "messages[0].role"),
        (_body(messages=[{"role": "tool", "content": "hi"}]), "messages[0].tool_call_id"),
        (_body(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role"),
        (_body(messages=[{"role": "user"}]), "messages[0].content"),
        (
            _body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages[0].content[0].type",
        ),
        (_body(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text"),
        (_body(temperature=-0.1), "temperature"),
        (_body(temperature="hot"), "temperature"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 1e999}',
            "temperature",
        ),
        (_body(top_p=0), "top_p"),
        (_body(top_p=1.01), "top_p"),
        (_body(top_k=-2), "top_k"),
        (_body(min_p=1.5), "min_p"),
        (_body(repetition_penalty=0), "repetition_penalty"),
        (_body(max_tokens=0), "max_tokens"),
        (_body(max_tokens=1.5), "max_tokens"),
        (_body(max_completion_tokens=-1), "max_completion_tokens"),
        (_body(n=0), "n"),
        (_body(presence_penalty=2.5), "presence_penalty"),
        (_body(frequency_penalty=-2.01), "frequency_penalty"),
        (_body(stop=["a", "b", "c", "d", "e"]), "stop"),
        (_body(stop=5), "stop"),
        (_body(stream="yes"), "stream"),
        (_body(stream_options={"include_usage": True}), "stream_options"),
        (_body(logprobs=True, top_logprobs=21), "top_logprobs"),
        (_body(top_logprobs=2), "top_logprobs"),
        (_body(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0]"),
        (_body(tools=[{"type": "retrieval"}]), "tools[0]"),
        (_body(tool_choice="required"), "tool_choice"),
        (_body(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    ],
)
def test_invalid_requests_are_400_with_the_param(body: bytes, param: str | None) -> None:
    error = _error(body)
    assert error.status == 400
    assert error.type == "invalid_request_error"
    assert error.param == param
    assert error.message


def test_bad_role_message_lists_supported_roles() -> None:
    error = _error(_body(messages=[{"role": "bot", "content": "hi"}]))
    assert error.code == "invalid_value"
    assert "'bot'" in error.message and "'user'" in error.message


def test_missing_field_message_names_it() -> None:
    assert (
        _error(_body(messages=[{"content": "hi"}])).message
        == "Missing required parameter: 'messages[0].role'."
    )


def test_a_penalty_out_of_range_says_the_range() -> None:
    assert "[-2, 2]" in _error(_body(presence_penalty=3)).message


def test_messages_for_template_joins_parts_and_maps_developer() -> None:
    messages = [
        {"role": "developer", "content": "rules"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "name": "ann",
        },
        {"role": "assistant", "content": None},
    ]
    req = parse_chat_request(_body(messages=messages))
    assert messages_for_template(req) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": ""},
    ]


def test_single_stop_string() -> None:
    assert stop_strings(parse_chat_request(_body(stop="END"))) == ["END"]


# ---------------------------------------------------------------- sampling


def test_to_sampling_defaults() -> None:
    params = to_sampling(sampling_ask(parse_chat_request(_body())), (2,), max_model_len=2048, prompt_len=10)
    assert params == SamplingParams(
        max_tokens=256,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        stop_token_ids=(2,),
    )


def test_to_sampling_maps_every_field() -> None:
    req = parse_chat_request(
        _body(max_tokens=20, temperature=0, top_p=0.5, top_k=-1, min_p=0.1, repetition_penalty=1.2, seed=3)
    )
    params = to_sampling(sampling_ask(req), [2, 0, 2], max_model_len=100, prompt_len=80)
    assert params == SamplingParams(
        max_tokens=20,
        temperature=0.0,
        top_p=0.5,
        top_k=0,
        min_p=0.1,
        repetition_penalty=1.2,
        seed=3,
        stop_token_ids=(2, 0),
    )


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = parse_chat_request(_body(max_tokens=50, max_completion_tokens=7))
    assert to_sampling(sampling_ask(req), (2,), 2048, 10).max_tokens == 7


def test_default_max_tokens_is_capped_by_the_context() -> None:
    assert (
        to_sampling(
            sampling_ask(parse_chat_request(_body())), (2,), max_model_len=100, prompt_len=90
        ).max_tokens
        == 10
    )


def test_too_many_tokens_requested_names_the_numbers() -> None:
    req = parse_chat_request(_body(max_tokens=200))
    with pytest.raises(ApiError) as info:
        to_sampling(sampling_ask(req), (2,), max_model_len=1000, prompt_len=900)
    error = info.value
    assert (error.status, error.param, error.code) == (400, "max_tokens", "context_length_exceeded")
    assert "1000" in error.message and "900" in error.message and "200" in error.message
    assert to_sampling(sampling_ask(req), (2,), max_model_len=1100, prompt_len=900).max_tokens == 200


def test_prompt_filling_the_context_is_400() -> None:
    with pytest.raises(ApiError) as info:
        to_sampling(sampling_ask(parse_chat_request(_body())), (2,), max_model_len=512, prompt_len=512)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert "512" in info.value.message


# ---------------------------------------------------------------- responses


def test_completion_response_shape() -> None:
    choices = [chat_choice(0, Delta(content="Hello!"), "stop")]
    body = completion_response("chatcmpl-1", "smollm2", 1700000000, choices, usage(12, 3))
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "smollm2",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello!", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 3,
            "total_tokens": 15,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        "system_fingerprint": None,
    }


def test_chunk_shapes() -> None:
    first = first_chunk("c", "m", 5)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert "usage" not in first
    middle = chunk("c", "m", 5, {"content": "Hi"}, include_usage=True)
    assert middle["usage"] is None
    assert middle["choices"][0]["delta"] == {"content": "Hi"}
    last = chunk("c", "m", 5, {}, "length")
    assert (last["id"], last["model"], last["created"]) == ("c", "m", 5)
    assert last["choices"][0]["finish_reason"] == "length"
    assert usage_chunk("c", "m", 5, usage(4, 6)) == {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "system_fingerprint": None,
        "choices": [],
        "usage": usage(4, 6),
    }


def test_sse_framing() -> None:
    frame = sse_data({"a": "é\n"})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert frame.count(b"\n") == 2  # the JSON has no raw newline that would break the frame
    assert json.loads(frame[len(b"data: ") : -2]) == {"a": "é\n"}
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_finish_reasons_and_ids() -> None:
    assert engine_finish_reason("length") == "length"
    assert [engine_finish_reason(r) for r in ("stop", "", "cancelled")] == ["stop", "stop", "stop"]
    first, second = new_completion_id(), new_completion_id()
    assert first.startswith("chatcmpl-") and first != second


# ---------------------------------------------------------------- the pieces together


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    folder: Path = make_tiny_tokenizer_folder(tmp_path_factory.mktemp("tiny"))
    return ChatTokenizer.from_folder(folder)


def test_a_streamed_request_end_to_end_without_a_worker(tok: ChatTokenizer) -> None:
    req = parse_chat_request(_body(stream=True, stream_options={"include_usage": True}, stop=["dog"]))
    prompt = tok.encode_chat(messages_for_template(req))
    params = to_sampling(sampling_ask(req), tok.eos_token_ids, max_model_len=2048, prompt_len=len(prompt))
    assert params.stop_token_ids == (IM_END_ID,)

    # What a worker would send back: tokens of a reply, one chunk at a time.
    generated = tok.encode("The lazy dog sleeps.")
    detok, stops = IncrementalDetokenizer(tok), StopMatcher(stop_strings(req))
    frames = [sse_data(first_chunk("c", req.model, 1, include_usage=include_usage(req)))]
    finish = "length"
    for token in generated:
        emit, stopped = stops.feed(detok.push([token]))
        if emit:
            frames.append(sse_data(chunk("c", req.model, 1, {"content": emit}, include_usage=True)))
        if stopped:
            finish = "stop"
            break
    frames.append(sse_data(chunk("c", req.model, 1, {}, finish, include_usage=True)))
    frames.append(sse_data(usage_chunk("c", req.model, 1, usage(len(prompt), len(generated)))))
    frames.append(SSE_DONE)

    datas = [frame[len(b"data: ") : -2] for frame in frames[:-1]]
    decoded = [json.loads(data) for data in datas]
    text = "".join(d["choices"][0]["delta"].get("content", "") for d in decoded if d["choices"])
    assert text == "The lazy "
    assert decoded[-2]["choices"][0]["finish_reason"] == "stop"
    assert decoded[-1]["usage"]["prompt_tokens"] == len(prompt)
    assert frames[-1] == SSE_DONE


def test_request_struct_is_immutable() -> None:
    req = parse_chat_request(_body())
    assert isinstance(req, ChatCompletionRequest)
    with pytest.raises(AttributeError):
        req.model = "other"  # type: ignore[misc]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (404, "invalid_request_error"),
        (422, "invalid_request_error"),
        (401, "authentication_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
        (503, "service_unavailable"),
        (418, "invalid_request_error"),
        (599, "server_error"),
    ],
)
def test_error_type_for_status(status: int, kind: str) -> None:
    assert error_type_for(status) == kind
    assert ApiError(status, "x").type == kind


def test_api_error_response_body() -> None:
    response = api_error(404, "The model 'x' does not exist", param="model", code="model_not_found")
    assert response.status == 404
    assert response.content_type == "application/json"
    assert isinstance(response.body, bytes)
    assert json.loads(response.body) == {
        "error": {
            "message": "The model 'x' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_api_error_explicit_type_wins() -> None:
    error = ApiError(503, "no worker", type="overloaded_error")
    assert error.body()["error"]["type"] == "overloaded_error"
    assert error.response().status == 503


async def test_error_middleware_renders_openai_errors() -> None:
    async def raises_api_error(_: web.Request) -> web.Response:
        raise ApiError(400, "bad temperature", param="temperature")

    async def crashes(_: web.Request) -> web.Response:
        raise RuntimeError("boom")

    async def unavailable(_: web.Request) -> web.Response:
        raise ApiError(503, "no worker serves this model")

    async def fine(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[error_middleware])
    app.router.add_post("/bad", raises_api_error)
    app.router.add_get("/crash", crashes)
    app.router.add_get("/busy", unavailable)
    app.router.add_get("/fine", fine)
    async with TestClient(TestServer(app)) as client:
        bad = await client.post("/bad")
        assert bad.status == 400
        assert await bad.json() == {
            "error": {
                "message": "bad temperature",
                "type": "invalid_request_error",
                "param": "temperature",
                "code": None,
            }
        }
        crash = await client.get("/crash")
        assert crash.status == 500
        assert (await crash.json())["error"]["type"] == "server_error"
        busy = await client.get("/busy")
        assert busy.status == 503
        assert (await busy.json())["error"]["type"] == "service_unavailable"
        missing = await client.get("/nope")
        assert missing.status == 404
        assert (await missing.json())["error"]["type"] == "invalid_request_error"
        wrong_method = await client.get("/bad")
        assert wrong_method.status == 405
        assert wrong_method.headers["Allow"] == "POST"
        ok = await client.get("/fine")
        assert ok.status == 200 and await ok.json() == {"ok": True}


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        b'{"model": "m", "messages": [], "temperature": NaN}',
        b"\x00\x01",
    ],
)
def test_bodies_that_are_not_json_text_are_400(body: bytes):
    with pytest.raises(ApiError) as refused:
        parse_chat_request(body)
    assert refused.value.status == 400
