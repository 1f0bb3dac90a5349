"""OpenAI chat completions adapter, pure: parse and validate a request, map it to SamplingParams,
build response bodies and SSE frames. No I/O; the HTTP handler wires these around a generation.

Shapes follow the OpenAI API reference (`chat.completion`, `chat.completion.chunk`, error bodies);
`n` choices are numbered by `index`. The sampling fields, vLLM's extensions among them, are
`openai_sampling`'s (shared with text completions).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from fleet_gateway.errors import ApiError, decode_json_body, error_body
from fleet_gateway.frames import SSE, Finished, sse_data
from fleet_gateway.openai_sampling import SamplingFields, validate_sampling
from fleet_gateway.openai_sampling import sampling_ask as shared_sampling_ask
from fleet_gateway.parsing.output import Delta, TokenScore, ToolCall
from fleet_gateway.sampling import SamplingAsk
from fleet_gateway.tool_grammar import ForcedCalls, forced_calls

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")
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


class ChatCompletionRequest(SamplingFields, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The body of POST /v1/chat/completions; unknown fields are ignored."""

    model: str
    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


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
    chat_forced_calls(req)  # for its 400s


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


def chat_forced_calls(req: ChatCompletionRequest) -> ForcedCalls | None:
    """tool_choice "required" (calls of any tool) or {"type": "function", "function": {"name": f}}
    (a call of f): one call when parallel_tool_calls is false. None for "auto" and "none"."""
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        return forced_calls(req.tools, None, parallel, "tool_choice")
    name = _named_function(choice)
    if name is None:
        raise ApiError(
            400,
            f"Invalid 'tool_choice': {json.dumps(choice)}; expected one of {', '.join(TOOL_CHOICES)} or "
            '{"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
            code="invalid_value",
        )
    return forced_calls(req.tools, name, parallel, "tool_choice")


def _named_function(choice: str | dict[str, Any]) -> str | None:
    """f of {"type": "function", "function": {"name": f}}; None for any other choice."""
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def tool_call_items(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """Parsed tool calls as OpenAI's message.tool_calls."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def stop_strings(req: SamplingFields) -> list[str]:
    """The request's stop strings (empty strings dropped)."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    return [stop for stop in stops if stop]


def include_usage(req: SamplingFields) -> bool:
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)


def sampling_ask(req: ChatCompletionRequest) -> SamplingAsk:
    """The shared mapping, with chat's logprobs (a flag, and top_logprobs for how many)."""
    return shared_sampling_ask(req, (req.top_logprobs or 0) if req.logprobs is True else None)


# ---------------------------------------------------------------- responses


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def choices_usage(finishes: Sequence[Finished]) -> dict[str, Any]:
    """Usage as OpenAI counts n choices of one prompt: the prompt once, the completions summed; the
    cached tokens are the first choice's (the others read the same prompt's cache)."""
    if not finishes:
        return usage(0, 0)
    first = finishes[0]
    return usage(first.prompt_tokens, sum(f.completion_tokens for f in finishes), first.cached_tokens)


def _score(score: TokenScore) -> dict[str, Any]:
    return {"token": score.token, "logprob": score.logprob, "bytes": score.bytes}


def chat_logprobs(scores: list[TokenScore]) -> dict[str, Any]:
    """choices[].logprobs of a chat completion (or chunk)."""
    content = [_score(s) | {"top_logprobs": [_score(t) for t in s.top]} for s in scores]
    return {"content": content, "refusal": None}


def chat_choice(index: int, text: Delta, finish_reason: str) -> dict[str, Any]:
    """One choice of a `chat.completion`: reasoning goes to `reasoning_content` (as vLLM and
    DeepSeek's API do); with tool calls the content is null and finish_reason "tool_calls"."""
    message: dict[str, Any] = {"role": "assistant", "content": text.content, "refusal": None}
    if text.reasoning:
        message["reasoning_content"] = text.reasoning
    if text.tool_calls:
        # the whitespace a tool-call format leaves around its calls is no content (OpenAI: null)
        content = text.content if text.content.strip() else None
        message |= {"content": content, "tool_calls": tool_call_items(text.tool_calls)}
        finish_reason = "tool_calls"
    logprobs = chat_logprobs(text.logprobs) if text.logprobs else None
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(
    id: str, model: str, created: int, choices: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    """A non-streamed `chat.completion` body."""
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
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
    index: int = 0,
) -> dict[str, Any]:
    """One `chat.completion.chunk` of choice `index`; with include_usage, `usage: null` as OpenAI
    sends on every chunk."""
    body: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if include_usage:
        body["usage"] = None
    return body


def first_chunk(
    id: str, model: str, created: int, *, include_usage: bool = False, index: int = 0
) -> dict[str, Any]:
    """A choice's first chunk: the assistant role with empty content."""
    delta = {"role": "assistant", "content": ""}
    return chunk(id, model, created, delta, include_usage=include_usage, index=index)


def usage_chunk(id: str, model: str, created: int, usage: dict[str, Any]) -> dict[str, Any]:
    """The last chunk before [DONE] when stream_options.include_usage: no choices, the usage."""
    return {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [],
        "usage": usage,
    }


class ChatChunks:
    """The `chat.completion.chunk` stream of n choices (a ChoicesFormat): each choice's role first,
    then content / reasoning_content / tool_calls deltas (each call whole, numbered by `index`
    within its choice) as they come, each choice's finish reason; after the last, the usage chunk
    when asked and `[DONE]`. A failure is an error frame, then [DONE]."""

    content_type = SSE

    def __init__(self, id: str, model: str, created: int, include_usage: bool, n: int = 1) -> None:
        self.id, self.model, self.created, self.include_usage = id, model, created, include_usage
        self.n = n
        self._calls = [0] * n  # tool calls sent in each choice
        self._finished: dict[int, Finished] = {}

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        scores: list[TokenScore] | None = None,
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
            index=index,
        )
        return sse_data(body)

    def start(self) -> list[bytes]:
        return [
            sse_data(
                first_chunk(self.id, self.model, self.created, include_usage=self.include_usage, index=i)
            )
            for i in range(self.n)
        ]

    def delta(self, delta: Delta, index: int = 0) -> list[bytes]:
        fields: dict[str, Any] = {"content": delta.content} if delta.content else {}
        if delta.reasoning:
            fields["reasoning_content"] = delta.reasoning
        if delta.tool_calls:
            items = tool_call_items(delta.tool_calls)
            fields["tool_calls"] = [item | {"index": self._calls[index] + i} for i, item in enumerate(items)]
            self._calls[index] += len(items)
        return [self._chunk(index, fields, scores=delta.logprobs)] if fields or delta.logprobs else []

    def finish(self, finished: Finished, index: int = 0) -> list[bytes]:
        self._finished[index] = finished
        frames = [self._chunk(index, {}, finished.reason)]
        return [*frames, *self._end()] if len(self._finished) == self.n else frames

    def fail(self, message: str) -> list[bytes]:
        return [sse_data(error_body(503, message)), *self._end()]

    def _end(self) -> list[bytes]:
        finishes = [self._finished[i] for i in sorted(self._finished)]
        usage_frame = sse_data(usage_chunk(self.id, self.model, self.created, choices_usage(finishes)))
        return [*([usage_frame] if self.include_usage else []), SSE_DONE]
