"""The gateway's response formatters, read back by the official client SDKs (openai, anthropic, ollama).

Each test turns one run's events (reasoning, content, a tool call, the finish) into the exact bytes
the gateway would send, with the formatter alone (start() + delta() per event + finish()/fail()), and
hands them to the SDK through a fake HTTP transport that answers every request with those recorded
bytes. The transport is fake so that no server, engine or network is involved, and so that the run
can contain what the end-to-end tests' random model never produces (tool calls, reasoning, a stop
string): what is proven is that the SDKs' own parsers and stream accumulators accept the gateway's
frames and reconstruct the intended message. The last test also validates every frame strictly against
the SDKs' declared (pydantic) types, which their parsers do not enforce.

openai and anthropic take an `httpx2.Client` (they refuse an `httpx.Client`); ollama uses httpx.

Past ~450 lines as one file: every API's formatter is read back by its own SDK through the same fake
transport and event scripts, which a split would copy."""

from __future__ import annotations

import json
import typing

import anthropic
import httpx
import httpx2
import ollama
import openai
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from fleet_gateway.anthropic_api import MessageEvents, message_body
from fleet_gateway.completions_api import TextChunks
from fleet_gateway.frames import NDJSON, SSE, Failed, Finished, Progress, StreamFormat
from fleet_gateway.ollama_api import ChatLines
from fleet_gateway.openai_api import ChatChunks, chat_choice, choices_usage, completion_response
from fleet_gateway.parsing.output import Delta, ToolCall
from fleet_gateway.responses_api import ResponseEvents, parse_responses_request, response_body, skeleton
from fleet_gateway.streaming import event_frames

pytestmark = pytest.mark.unit

MODEL = "fleet-test-model"
CREATED = 1_700_000_000
WEATHER_CALL = ToolCall("get_weather", '{"city": "Paris"}', id="call_0123456789abcdef01234567")
# What a reasoning model's run yields: thinking, then the answer, then a tool call.
RUN = [
    Delta(reasoning="let me think"),
    Delta(reasoning=" more", content=""),
    Delta(content="Hello"),
    Delta(content=" there"),
    Delta(tool_calls=[WEATHER_CALL]),
]
TOOL_FINISH = Finished("tool_calls", 12, 7)
WHOLE_RUN = Delta(reasoning="let me think more", content="Hello there", tool_calls=[WEATHER_CALL])
USER_TURN = [{"role": "user", "content": "Weather in Paris?"}]


# A long prompt's run: prefill progress first, then the same deltas.
PREFILLING = [Progress(512, 1500), Progress(1024, 1500)]


def recorded_body(
    fmt: StreamFormat, events: list[Delta | Progress] = RUN, end: Finished | Failed = TOOL_FINISH
) -> bytes:
    """The bytes the gateway writes for one run: the formatter's frames, in order."""
    frames = fmt.start()
    for event in [*events, end]:
        frames += event_frames(fmt, event)
    return b"".join(frames)


def recorded_transport(http, body: bytes, content_type: str, seen: list | None = None):
    """A fake transport of the `http` module (httpx2 for openai / anthropic, httpx for ollama): every
    request gets 200 with the recorded body; the requests are kept in `seen` when given."""

    def reply(request):
        if seen is not None:
            seen.append(request)
        return http.Response(200, headers={"content-type": content_type}, content=body)

    return http.MockTransport(reply)


def openai_client(body: bytes, content_type: str = SSE, seen: list | None = None) -> openai.OpenAI:
    transport = recorded_transport(httpx2, body, content_type, seen)
    return openai.OpenAI(
        api_key="unused",
        base_url="http://fake/v1",
        max_retries=0,
        http_client=httpx2.Client(transport=transport),
    )


def anthropic_client(body: bytes, content_type: str = SSE) -> anthropic.Anthropic:
    transport = recorded_transport(httpx2, body, content_type)
    return anthropic.Anthropic(
        api_key="unused",
        base_url="http://fake",
        max_retries=0,
        http_client=httpx2.Client(transport=transport),
    )


def ollama_client(body: bytes, seen: list | None = None) -> ollama.Client:
    # ollama.Client passes extra keyword arguments on to httpx.Client
    return ollama.Client(host="http://fake", transport=recorded_transport(httpx, body, NDJSON, seen))


def json_body(body: dict) -> bytes:
    return json.dumps(body).encode()


# ---------------------------------------------------------------- OpenAI chat completions


def chat_chunks(include_usage: bool = False) -> ChatChunks:
    return ChatChunks("chatcmpl-test", MODEL, CREATED, include_usage)


def test_chat_stream_chunks_carry_content_reasoning_and_the_tool_call():
    seen: list = []
    client = openai_client(recorded_body(chat_chunks(include_usage=True)), seen=seen)
    stream = client.chat.completions.create(
        model=MODEL, messages=USER_TURN, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)

    assert seen[0].url.path == "/v1/chat/completions"
    assert {chunk.id for chunk in chunks} == {"chatcmpl-test"}
    choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert choices[0].delta.role == "assistant"
    assert "".join(choice.delta.content or "" for choice in choices) == "Hello there"
    reasoning = [(choice.delta.model_extra or {}).get("reasoning_content") or "" for choice in choices]
    assert "".join(reasoning) == "let me think more"
    [call] = [call for choice in choices for call in choice.delta.tool_calls or []]
    assert (call.index, call.id, call.type) == (0, WEATHER_CALL.id, "function")
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert [choice.finish_reason for choice in choices][-1] == "tool_calls"
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (12, 7, 19)


def test_prefill_progress_is_an_sse_comment_every_sdk_skips():
    body = recorded_body(chat_chunks(), [*PREFILLING, *RUN])
    assert b': prefill_progress {"processed_tokens":512,"total_tokens":1500}\n\n' in body
    client = openai_client(body)
    with_progress = list(client.chat.completions.create(model=MODEL, messages=USER_TURN, stream=True))
    plain = list(
        openai_client(recorded_body(chat_chunks())).chat.completions.create(
            model=MODEL, messages=USER_TURN, stream=True
        )
    )
    assert [c.model_dump() for c in with_progress] == [c.model_dump() for c in plain]
    messages = anthropic_client(recorded_body(message_events(), [*PREFILLING, *RUN]))
    with messages.messages.stream(model=MODEL, max_tokens=64, messages=USER_TURN) as stream:
        assert_thinking_text_and_tool_use(stream.get_final_message().content)
    ndjson = ChatLines(MODEL, CREATED, 100.0)
    assert recorded_body(ndjson, [*PREFILLING, *RUN]) == recorded_body(ndjson)  # Ollama: no frame


def test_chat_stream_numbers_several_tool_calls_in_order():
    second = ToolCall("get_time", '{"zone": "CET"}')
    events = [Delta(tool_calls=[WEATHER_CALL]), Delta(tool_calls=[second])]
    chunks = list(
        openai_client(recorded_body(chat_chunks(), events)).chat.completions.create(
            model=MODEL, messages=USER_TURN, stream=True
        )
    )
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert [(call.index, call.id, call.function.name) for call in calls] == [
        (0, WEATHER_CALL.id, "get_weather"),
        (1, second.id, "get_time"),
    ]


def test_chat_stream_helper_assembles_the_final_completion():
    client = openai_client(recorded_body(chat_chunks()))
    with client.chat.completions.stream(model=MODEL, messages=USER_TURN) as stream:
        event_types = [event.type for event in stream]
        final = stream.get_final_completion()

    assert "content.delta" in event_types and "tool_calls.function.arguments.done" in event_types
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Hello there"
    [call] = choice.message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == (
        WEATHER_CALL.id,
        "get_weather",
        '{"city": "Paris"}',
    )
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_chat_stream_failure_mid_stream_raises_api_error():
    body = recorded_body(chat_chunks(), RUN[:3], Failed("boom"))
    stream = openai_client(body).chat.completions.create(model=MODEL, messages=USER_TURN, stream=True)
    received = []
    with pytest.raises(openai.APIError, match="boom") as raised:
        for chunk in stream:
            received.append(chunk)
    assert len(received) == 4  # role, two reasoning chunks and "Hello" came before the error
    assert received[-1].choices[0].delta.content == "Hello"
    assert raised.value.body["type"] == "service_unavailable"


def test_chat_completion_body_parses_with_tool_calls_and_reasoning():
    choices = [chat_choice(0, WHOLE_RUN, "stop")]
    body = completion_response("chatcmpl-test", MODEL, CREATED, choices, choices_usage([TOOL_FINISH]))
    client = openai_client(json_body(body), "application/json")
    completion = client.chat.completions.create(model=MODEL, messages=USER_TURN)

    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Hello there"
    assert choice.message.model_extra["reasoning_content"] == "let me think more"
    [call] = choice.message.tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        WEATHER_CALL.id,
        "get_weather",
        {"city": "Paris"},
    )
    assert (completion.usage.prompt_tokens, completion.usage.total_tokens) == (12, 19)


# ---------------------------------------------------------------- OpenAI text completions


def test_text_completion_stream_parses_text_finish_reason_and_usage():
    body = recorded_body(TextChunks("cmpl-test", MODEL, CREATED, True), RUN[:4], Finished("length", 5, 4))
    stream = openai_client(body).completions.create(
        model=MODEL, prompt="Once", stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)

    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert "".join(texts) == "Hello there"  # reasoning has no place in a text completion
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 4)


def test_text_completion_failure_raises_api_error():
    body = recorded_body(TextChunks("cmpl-test", MODEL, CREATED, False), RUN[2:3], Failed("boom"))
    stream = openai_client(body).completions.create(model=MODEL, prompt="Once", stream=True)
    with pytest.raises(openai.APIError, match="boom"):
        list(stream)


# ---------------------------------------------------------------- OpenAI Responses


def response_skeleton() -> dict:
    req = parse_responses_request(json_body({"model": MODEL, "input": "Weather in Paris?"}))
    return skeleton("resp_test", MODEL, req, CREATED)


RESPONSE_EVENT_TYPES = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",  # reasoning
    "response.content_part.added",
    "response.reasoning_text.delta",
    "response.reasoning_text.delta",
    "response.reasoning_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.output_item.added",  # message
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.output_item.added",  # function_call
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
]


def assert_reasoning_message_and_call(output) -> None:
    reasoning, message, call = output
    assert reasoning.type == "reasoning"
    assert [part.text for part in reasoning.content] == ["let me think more"]
    assert message.type == "message" and message.role == "assistant"
    assert [part.text for part in message.content] == ["Hello there"]
    assert call.type == "function_call"
    assert (call.call_id, call.name, json.loads(call.arguments)) == (
        WEATHER_CALL.id,
        "get_weather",
        {"city": "Paris"},
    )


def test_responses_stream_helper_assembles_reasoning_message_and_function_call():
    client = openai_client(recorded_body(ResponseEvents(response_skeleton())))
    with client.responses.stream(model=MODEL, input="Weather in Paris?") as stream:
        events = list(stream)
        final = stream.get_final_response()

    assert [event.type for event in events] == RESPONSE_EVENT_TYPES
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text_deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert [event.snapshot for event in text_deltas] == ["Hello", "Hello there"]
    assert final.id == "resp_test" and final.status == "completed"
    assert_reasoning_message_and_call(final.output)
    assert final.output_text == "Hello there"
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (12, 7, 19)


def test_responses_stream_failure_is_a_response_failed_event():
    body = recorded_body(ResponseEvents(response_skeleton()), RUN[:3], Failed("boom"))
    client = openai_client(body)
    with client.responses.stream(model=MODEL, input="Weather in Paris?") as stream:
        events = list(stream)
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            stream.get_final_response()

    failed = events[-1]
    assert failed.type == "response.failed"
    assert failed.response.status == "failed" and failed.response.error.message == "boom"
    reasoning, message = failed.response.output  # the open message was closed before the failure
    assert (reasoning.type, message.type, message.content[0].text) == ("reasoning", "message", "Hello")


def test_responses_stream_cut_at_max_tokens_is_a_response_incomplete_event():
    body = recorded_body(ResponseEvents(response_skeleton()), RUN[2:4], Finished("length", 12, 2))
    with openai_client(body).responses.stream(model=MODEL, input="Weather in Paris?") as stream:
        events = list(stream)

    incomplete = events[-1]
    assert incomplete.type == "response.incomplete"
    assert incomplete.response.status == "incomplete"
    assert incomplete.response.incomplete_details.reason == "max_output_tokens"
    assert incomplete.response.output_text == "Hello there"


def test_responses_body_parses_with_reasoning_message_and_function_call():
    body = response_body(response_skeleton(), WHOLE_RUN, TOOL_FINISH)
    response = openai_client(json_body(body), "application/json").responses.create(
        model=MODEL, input="Weather in Paris?"
    )
    assert response.status == "completed"
    assert_reasoning_message_and_call(response.output)
    assert response.output_text == "Hello there"


# ---------------------------------------------------------------- Anthropic Messages


def message_events() -> MessageEvents:
    return MessageEvents("msg_test", MODEL, 12)


def assert_thinking_text_and_tool_use(content) -> None:
    thinking, text, tool_use = content
    assert (thinking.type, thinking.thinking) == ("thinking", "let me think more")
    assert (text.type, text.text) == ("text", "Hello there")
    assert (tool_use.type, tool_use.name, tool_use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert tool_use.id == "toolu_0123456789abcdef01234567"


def test_messages_stream_helper_assembles_thinking_text_and_tool_use():
    client = anthropic_client(recorded_body(message_events()))
    with client.messages.stream(model=MODEL, max_tokens=64, messages=USER_TURN) as stream:
        event_types = [event.type for event in stream]
        final = stream.get_final_message()

    assert event_types[0] == "message_start" and event_types[-1] == "message_stop"
    assert final.id == "msg_test" and final.model == MODEL
    assert_thinking_text_and_tool_use(final.content)
    assert final.stop_reason == "tool_use" and final.stop_sequence is None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (12, 7)


def test_messages_stream_reports_the_stop_sequence_hit():
    finished = Finished("stop", 12, 2, stop_string="END")
    client = anthropic_client(recorded_body(message_events(), RUN[2:4], finished))
    with client.messages.stream(model=MODEL, max_tokens=64, messages=USER_TURN) as stream:
        final = stream.get_final_message()
    assert [block.text for block in final.content] == ["Hello there"]
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")


def test_messages_stream_failure_raises_api_status_error():
    body = recorded_body(message_events(), RUN[:3], Failed("boom"))
    client = anthropic_client(body)
    with pytest.raises(anthropic.APIStatusError, match="boom") as raised:
        with client.messages.stream(model=MODEL, max_tokens=64, messages=USER_TURN) as stream:
            stream.get_final_message()
    assert raised.value.body["error"] == {"type": "overloaded_error", "message": "boom"}


def test_message_body_parses_with_thinking_text_and_tool_use():
    body = message_body("msg_test", MODEL, WHOLE_RUN, TOOL_FINISH)
    message = anthropic_client(json_body(body), "application/json").messages.create(
        model=MODEL, max_tokens=64, messages=USER_TURN
    )
    assert_thinking_text_and_tool_use(message.content)
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (12, 7)


# ---------------------------------------------------------------- Ollama


def ollama_finish(reason: str = "tool_calls") -> Finished:
    return Finished(reason, 12, 7, first_token_at=100.25, finished_at=101.0)


def test_ollama_chat_stream_parses_thinking_content_and_tool_call():
    seen: list = []
    body = recorded_body(ChatLines(MODEL, CREATED, 100.0), RUN, ollama_finish())
    parts = list(ollama_client(body, seen).chat(model=MODEL, messages=USER_TURN, stream=True))

    assert seen[0].url.path == "/api/chat"
    assert "".join(part.message.thinking or "" for part in parts) == "let me think more"
    assert "".join(part.message.content or "" for part in parts) == "Hello there"
    [call] = [call for part in parts for call in part.message.tool_calls or []]
    assert call.function.name == "get_weather"
    assert call.function.arguments == {"city": "Paris"}
    assert not any(part.done for part in parts[:-1])
    last = parts[-1]
    assert last.done and last.done_reason == "stop"
    assert (last.prompt_eval_count, last.eval_count) == (12, 7)
    assert (last.total_duration, last.prompt_eval_duration, last.eval_duration) == (
        1_000_000_000,
        250_000_000,
        750_000_000,
    )
    assert last.model == MODEL and last.created_at.startswith("2023-11-14T22:13:20")


def test_ollama_generate_stream_parses_response_text():
    seen: list = []
    body = recorded_body(ChatLines(MODEL, CREATED, 100.0, generate=True), RUN[:4], ollama_finish("length"))
    parts = list(ollama_client(body, seen).generate(model=MODEL, prompt="Once", stream=True))

    assert seen[0].url.path == "/api/generate"
    assert "".join(part.response for part in parts) == "Hello there"
    assert "".join(part.thinking or "" for part in parts) == "let me think more"
    assert parts[-1].done and parts[-1].done_reason == "length" and parts[-1].eval_count == 7


def test_ollama_failure_line_raises_response_error():
    body = recorded_body(ChatLines(MODEL, CREATED, 100.0), RUN[2:3], Failed("boom"))
    parts = ollama_client(body).chat(model=MODEL, messages=USER_TURN, stream=True)
    with pytest.raises(ollama.ResponseError, match="boom"):
        list(parts)


# ---------------------------------------------------------------- the SDKs' declared types, strictly

# The SDKs build their objects without validating them (a missing field reads as None), so the tests
# above would not notice a field the SDK declares required; this validates every frame strictly.


def sse_data_objects(body: bytes) -> list[dict]:
    lines = body.decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def by_event_type(union) -> typing.Callable[[dict], object]:
    """Validates an event with the member of the SDK's event union its `type` names."""
    members = typing.get_args(typing.get_args(union)[0])  # Annotated[Union[...], discriminator]
    models = {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in members}
    return lambda data: models[data["type"]].model_validate(data)


def schema_errors(validate: typing.Callable[[dict], object], frames: list[dict]) -> set[str]:
    """`<frame type>: <field path>` for every field of every frame the SDK's model rejects."""
    errors: set[str] = set()
    for frame in frames:
        try:
            validate(frame)
        except pydantic.ValidationError as error:
            kind = frame.get("type") or frame.get("object")
            errors |= {f"{kind}: {'.'.join(map(str, e['loc']))}" for e in error.errors()}
    return errors


def ndjson_objects(body: bytes) -> list[dict]:
    return [json.loads(line) for line in body.splitlines()]


# Text completion chunks are left out: the SDK types them as `Completion`, whose finish_reason may not be
# null, yet every chunk but the last carries null there (as OpenAI's own stream does).
STRICT_CASES = [
    pytest.param(
        ChatCompletionChunk.model_validate,
        sse_data_objects(recorded_body(chat_chunks(include_usage=True))),
        id="openai-chat-chunks",
    ),
    pytest.param(
        ChatCompletion.model_validate,
        [
            completion_response(
                "c", MODEL, CREATED, [chat_choice(0, WHOLE_RUN, "stop")], choices_usage([TOOL_FINISH])
            )
        ],
        id="openai-chat-body",
    ),
    pytest.param(
        by_event_type(ResponseStreamEvent),
        sse_data_objects(recorded_body(ResponseEvents(response_skeleton()))),
        id="openai-responses-events",
    ),
    pytest.param(
        Response.model_validate,
        [response_body(response_skeleton(), WHOLE_RUN, TOOL_FINISH)],
        id="openai-responses-body",
    ),
    pytest.param(
        by_event_type(ResponseStreamEvent),
        sse_data_objects(recorded_body(ResponseEvents(response_skeleton()), RUN[:3], Failed("boom"))),
        id="openai-responses-failed-events",
    ),
    pytest.param(
        by_event_type(ResponseStreamEvent),
        sse_data_objects(
            recorded_body(ResponseEvents(response_skeleton()), RUN[2:4], Finished("length", 1, 2))
        ),
        id="openai-responses-incomplete-events",
    ),
    pytest.param(
        by_event_type(RawMessageStreamEvent),
        # `ping` is a documented event, but the SDK's event union has no model for it
        [e for e in sse_data_objects(recorded_body(message_events())) if e["type"] != "ping"],
        id="anthropic-events",
    ),
    pytest.param(
        Message.model_validate,
        [message_body("msg_test", MODEL, WHOLE_RUN, TOOL_FINISH)],
        id="anthropic-body",
    ),
    pytest.param(
        ollama.ChatResponse.model_validate,
        ndjson_objects(recorded_body(ChatLines(MODEL, CREATED, 100.0), RUN, ollama_finish())),
        id="ollama-chat-lines",
    ),
    pytest.param(
        ollama.GenerateResponse.model_validate,
        ndjson_objects(recorded_body(ChatLines(MODEL, CREATED, 100.0, generate=True), RUN, ollama_finish())),
        id="ollama-generate-lines",
    ),
]


@pytest.mark.parametrize(("validate", "frames"), STRICT_CASES)
def test_every_frame_validates_against_the_sdk_types(validate, frames):
    assert schema_errors(validate, frames) == set()
