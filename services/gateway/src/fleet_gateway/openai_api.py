"""OpenAI chat completions adapter, pure: parse and validate a request, map it to SamplingParams,
build response bodies and SSE frames. No I/O; the HTTP handler wires these around a generation.

Shapes follow the OpenAI API reference (`chat.completion`, `chat.completion.chunk`, error bodies).
Fleet extensions accepted in the body: top_k, min_p, repetition_penalty, ignore_eos (as in vLLM).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

import msgspec

from fleet_gateway.errors import ApiError, decode_json_body, error_body
from fleet_gateway.frames import SSE, Finished, sse_data
from fleet_gateway.parsing.output import Delta, TokenScore
from fleet_gateway.sampling import SamplingAsk, check_sampling

MAX_STOP_STRINGS = 4
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto")
MAX_TOP_LOGPROBS = 20
SSE_DONE = b"data: [DONE]\n\n"


class ContentPart(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    type: Annotated[str, msgspec.Meta(extra_json_schema={"enum": ["text"]})]
    text: str | None = None


class FunctionCall(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCallItem(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    function: FunctionCall
    id: str = ""
    type: str = "function"


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    role: Annotated[
        str, msgspec.Meta(extra_json_schema={"enum": list(ROLES)})
    ]  # checked with a clearer error
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call they answer


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The body of POST /v1/chat/completions; unknown fields are ignored."""

    model: str
    messages: list[ChatMessage]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension; 0 or -1: off
    min_p: float | None = None  # extension
    repetition_penalty: float | None = None  # extension
    ignore_eos: bool = False  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None


# ---------------------------------------------------------------- parsing and validation


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Decode and validate a request body; raises ApiError(400, ..., param=<field>) when it is wrong."""
    request = decode_json_body(body, ChatCompletionRequest)
    validate_chat_request(request)
    return request


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ApiError(400, message, param=param, code="invalid_value")


def validate_chat_request(req: ChatCompletionRequest) -> None:
    """Value checks that the types alone do not express."""
    _check(bool(req.model.strip()), "model", "'model' must be a non-empty string.")
    _check(bool(req.messages), "messages", "'messages' must contain at least one message.")
    for index, message in enumerate(req.messages):
        _validate_message(index, message)
    validate_sampling(req)
    if req.top_logprobs is not None:
        _check(
            0 <= req.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            f"Invalid 'top_logprobs': {req.top_logprobs}; expected an integer in [0, {MAX_TOP_LOGPROBS}].",
        )
        _check(bool(req.logprobs), "top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")
    for index, tool in enumerate(req.tools or []):
        function = tool.get("function")
        _check(
            tool.get("type") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str),
            f"tools[{index}]",
            f'Invalid \'tools[{index}]\': expected {{"type": "function", "function": {{"name": ...}}}}.',
        )
    check_text_format((req.response_format or {}).get("type", "text"), "response_format")
    if req.tool_choice is not None and req.tool_choice not in TOOL_CHOICES:
        raise ApiError(
            400,
            'Only \'tool_choice\' "auto" and "none" are supported (no constrained decoding yet).',
            param="tool_choice",
        )


def check_text_format(kind: str, param: str) -> None:
    """Only free text: JSON modes need constrained decoding, which Fleet's engines do not offer."""
    if kind != "text":
        raise ApiError(
            400,
            f"{param} {kind!r} is not supported: Fleet has no constrained (JSON) decoding yet; "
            "ask for JSON in the prompt instead.",
            param=param,
        )


def validate_sampling(req) -> None:
    """The checks chat and text completions share (both request structs name these fields alike)."""
    check_sampling(sampling_ask(req))
    if req.max_completion_tokens is not None and req.max_tokens is not None:
        _check(
            req.max_tokens >= 1,
            "max_tokens",
            f"Invalid 'max_tokens': {req.max_tokens}; expected an integer >= 1.",
        )
    if req.n is not None:
        _check(req.n == 1, "n", f"Invalid 'n': {req.n}; only n=1 is supported.")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            _check(value == 0, name, f"'{name}' is not supported; only 0 is accepted.")
    if req.stream_options is not None and not req.stream:
        raise ApiError(
            400,
            "The 'stream_options' parameter is only allowed when 'stream' is true.",
            param="stream_options",
        )
    if isinstance(req.stop, list):
        _check(
            len(req.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"Invalid 'stop': {len(req.stop)} strings given; at most {MAX_STOP_STRINGS} are allowed.",
        )


def _validate_message(index: int, message: ChatMessage) -> None:
    where = f"messages[{index}]"
    if message.role not in ROLES:
        supported = ", ".join(f"'{role}'" for role in ROLES)
        raise ApiError(
            400,
            f"Invalid value: '{message.role}'. Supported values are: {supported}.",
            param=f"{where}.role",
            code="invalid_value",
        )
    if message.role == "tool":
        _check(bool(message.tool_call_id), f"{where}.tool_call_id", f"'{where}.tool_call_id' is required.")
    if message.content is None:
        _check(message.role == "assistant", f"{where}.content", f"'{where}.content' is required.")
    elif isinstance(message.content, list):
        for part_index, part in enumerate(message.content):
            part_where = f"{where}.content[{part_index}]"
            _check(
                part.type == "text",
                f"{part_where}.type",
                f"Unsupported content part type '{part.type}'; only 'text' is supported.",
            )
            _check(part.text is not None, f"{part_where}.text", f"'{part_where}.text' is required.")


# ---------------------------------------------------------------- mapping to the engine


def message_text(message: ChatMessage) -> str:
    """A message's content as one string (text parts joined by newlines)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(part.text or "" for part in message.content)


def messages_for_template(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Plain dicts for the chat template as Hugging Face templates expect them: `developer` is
    rendered as `system`; an assistant's tool calls carry their arguments as objects."""
    messages = []
    for message in req.messages:
        item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
        item["content"] = message_text(message)
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [_template_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        messages.append(item)
    return messages


def _template_call(call: ToolCallItem) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError:
        raise ApiError(400, f"tool call {call.id!r}: 'arguments' is not JSON.", param="messages") from None
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


def tools_for_template(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the template renders: none when tool_choice is "none" (OpenAI: no calls then)."""
    if not req.tools or req.tool_choice == "none":
        return None
    return req.tools


def tool_call_items(calls) -> list[dict[str, Any]]:
    """Parsed tool calls as OpenAI's message.tool_calls."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def stop_strings(req: ChatCompletionRequest) -> list[str]:
    """The request's stop strings (empty strings dropped)."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    return [stop for stop in stops if stop]


def include_usage(req: ChatCompletionRequest) -> bool:
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)


def sampling_ask(req) -> SamplingAsk:
    """What a chat or text completion request asks of sampling (both name the fields alike)."""
    uses_new_name = req.max_completion_tokens is not None
    return SamplingAsk(
        max_tokens=req.max_completion_tokens if uses_new_name else req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        seed=req.seed,
        max_tokens_param="max_completion_tokens" if uses_new_name else "max_tokens",
        logprobs=(req.top_logprobs or 0) if req.logprobs is True else None,
        ignore_eos=req.ignore_eos,
    )


# ---------------------------------------------------------------- responses


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _score(score: TokenScore) -> dict[str, Any]:
    return {"token": score.token, "logprob": score.logprob, "bytes": score.bytes}


def chat_logprobs(scores: list[TokenScore]) -> dict[str, Any]:
    """choices[].logprobs of a chat completion (or chunk)."""
    content = [_score(s) | {"top_logprobs": [_score(t) for t in s.top]} for s in scores]
    return {"content": content, "refusal": None}


def completion_response(
    id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    reasoning: str = "",
    tool_calls: list[dict[str, Any]] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A non-streamed `chat.completion` body; reasoning goes to `reasoning_content` (as vLLM and
    DeepSeek's API do); with tool calls the content is null and finish_reason "tool_calls"."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message |= {"content": text or None, "tool_calls": tool_calls}
        finish_reason = "tool_calls"
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
        "system_fingerprint": None,
    }


def chunk(
    id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    *,
    include_usage: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`; with include_usage, `usage: null` as OpenAI sends on every chunk."""
    body: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if include_usage:
        body["usage"] = None
    return body


def first_chunk(id: str, model: str, created: int, *, include_usage: bool = False) -> dict[str, Any]:
    """The stream's first chunk: the assistant role with empty content."""
    return chunk(id, model, created, {"role": "assistant", "content": ""}, include_usage=include_usage)


def usage_chunk(
    id: str, model: str, created: int, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """The last chunk before [DONE] when stream_options.include_usage: no choices, the usage."""
    return {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }


class ChatChunks:
    """The `chat.completion.chunk` stream of one completion (a StreamFormat): the role first, then
    content / reasoning_content / tool_calls deltas (each call whole, numbered by `index`), the
    finish reason, the usage chunk when asked, `[DONE]`; a failure is an error frame, then [DONE]."""

    content_type = SSE

    def __init__(self, id: str, model: str, created: int, include_usage: bool) -> None:
        self.id, self.model, self.created, self.include_usage = id, model, created, include_usage
        self._calls = 0
        self._usage = (0, 0)

    def _chunk(
        self, delta: dict[str, Any], finish_reason: str | None = None, scores: list[TokenScore] | None = None
    ) -> bytes:
        logprobs = chat_logprobs(scores) if scores else None
        body = chunk(
            self.id,
            self.model,
            self.created,
            delta,
            finish_reason,
            include_usage=self.include_usage,
            logprobs=logprobs,
        )
        return sse_data(body)

    def start(self) -> list[bytes]:
        return [sse_data(first_chunk(self.id, self.model, self.created, include_usage=self.include_usage))]

    def delta(self, delta: Delta) -> list[bytes]:
        fields: dict[str, Any] = {"content": delta.content} if delta.content else {}
        if delta.reasoning:
            fields["reasoning_content"] = delta.reasoning
        if delta.tool_calls:
            items = tool_call_items(delta.tool_calls)
            fields["tool_calls"] = [item | {"index": self._calls + i} for i, item in enumerate(items)]
            self._calls += len(items)
        return [self._chunk(fields, scores=delta.logprobs)] if fields or delta.logprobs else []

    def finish(self, finished: Finished) -> list[bytes]:
        self._usage = (finished.prompt_tokens, finished.completion_tokens)
        return [self._chunk({}, finished.reason), *self._end()]

    def fail(self, message: str) -> list[bytes]:
        return [sse_data(error_body(503, message)), *self._end()]

    def _end(self) -> list[bytes]:
        usage_frame = [sse_data(usage_chunk(self.id, self.model, self.created, *self._usage))]
        return [*(usage_frame if self.include_usage else []), SSE_DONE]
