"""Anthropic Messages adapter, pure: POST /v1/messages request -> ChatTurn, results -> a `message`
body or its event stream (message_start, content_block_start/delta/stop per block, message_delta,
message_stop), as the Messages API reference describes them.

Content blocks in: text, tool_use (assistant), tool_result (user), thinking (assistant; dropped, as
Anthropic drops earlier turns' thinking); images are refused. Out: thinking blocks (the model's
reasoning, whenever it produced some: `thinking` in the request cannot turn a model's thinking off),
text, tool_use. Tools render through the model's chat template like OpenAI tools.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

import msgspec

from fleet_gateway.content import NotText, joined_text
from fleet_gateway.errors import ApiError, anthropic_error_body, decode_json_body
from fleet_gateway.frames import SSE, Finished, sse_event
from fleet_gateway.parsing.output import Delta, ToolCall
from fleet_gateway.sampling import SamplingAsk
from fleet_gateway.tool_grammar import ForcedCalls, forced_calls
from fleet_gateway.turns import ChatTurn

ROLES = ("user", "assistant")
TOOL_CHOICES = ("auto", "none", "any", "tool")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# Documented for the OpenAPI schema; validated by `template_messages` (clearer errors, by path).
MessageSchema = Annotated[
    dict[str, Any],
    msgspec.Meta(
        extra_json_schema={
            "required": ["role", "content"],
            "properties": {
                "role": {"enum": list(ROLES)},
                "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
            },
        }
    ),
]


class MessagesRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    model: str
    messages: list[MessageSchema]
    max_tokens: int
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    model: str
    messages: list[MessageSchema]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def parse_messages_request(body: bytes) -> MessagesRequest:
    req = decode_json_body(body, MessagesRequest)
    if req.max_tokens < 1:
        raise _bad("max_tokens", f"max_tokens: {req.max_tokens} must be at least 1")
    if req.temperature is not None and not 0 <= req.temperature <= 1:
        raise _bad("temperature", f"temperature: {req.temperature} must be between 0 and 1")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise _bad("top_p", f"top_p: {req.top_p} must be in (0, 1]")
    if req.top_k is not None and req.top_k < 0:
        raise _bad("top_k", f"top_k: {req.top_k} must be >= 0")
    forced_tool_calls(req)  # for its 400s
    return req


def parse_count_tokens_request(body: bytes) -> CountTokensRequest:
    return decode_json_body(body, CountTokensRequest)


def _text_of(content: Any, where: str) -> str:
    """A string, or text blocks joined by newlines (a tool_result's content is either)."""
    try:
        return joined_text(content, ("text",))
    except NotText as exc:
        if exc.index is None:
            raise _bad(where, f"{where}: expected a string or a list of content blocks") from None
        raise _bad(
            f"{where}.{exc.index}", f"{where}.{exc.index}: only text blocks are supported here"
        ) from None


def _message_items(index: int, message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message -> template messages (a user turn's tool_result blocks become tool
    messages, in order; an assistant's tool_use blocks become its tool_calls)."""
    where = f"messages.{index}"
    role = message.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"{where}.role: Input should be 'user' or 'assistant'")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content", f"{where}.content: expected a string or a list of content blocks")
    items: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []

    def flush_text() -> None:
        if texts:
            items.append({"role": role, "content": "\n".join(texts)})
            texts.clear()

    for block_index, block in enumerate(content):
        at = f"{where}.content.{block_index}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise _bad(at, f"{at}: tool_use needs a name and an input object")
            function = {"name": block["name"], "arguments": block.get("input", {})}
            calls.append({"id": block.get("id", ""), "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad(f"{at}.tool_use_id", f"{at}.tool_use_id: Field required")
            flush_text()
            result = _text_of(block.get("content", ""), f"{at}.content")
            items.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            raise _bad(f"{at}.type", f"{at}: content block type {kind!r} is not supported for {role} turns")
    if role == "assistant":
        reply: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        return [*items, reply | ({"tool_calls": calls} if calls else {})]
    flush_text()
    return items


def template_messages(
    system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    if not messages:
        raise _bad("messages", "messages: at least one message is required")
    items: list[dict[str, Any]] = (
        [{"role": "system", "content": _text_of(system, "system")}] if system else []
    )
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages.{index}", f"messages.{index}: expected an object")
        items.extend(_message_items(index, message))
    return items


def template_tools(
    tools: list[dict[str, Any]] | None, tool_choice: dict[str, Any] | None
) -> list[dict[str, Any]] | None:
    """Anthropic tools as the OpenAI function tools chat templates render; none for tool_choice none."""
    if not tools or (tool_choice or {}).get("type") == "none":
        return None
    rendered = []
    for index, tool in enumerate(tools):
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema", {}), dict):
            raise _bad(f"tools.{index}", f"tools.{index}: a tool needs a name and an input_schema object")
        function = {"name": tool["name"], "description": tool.get("description", "")}
        rendered.append(
            {"type": "function", "function": function | {"parameters": tool.get("input_schema", {})}}
        )
    return rendered


def forced_tool_calls(req: MessagesRequest) -> ForcedCalls | None:
    """tool_choice {"type": "any"} (calls of any tool) or {"type": "tool", "name": f} (a call of f):
    one call with disable_parallel_tool_use. None for "auto" and "none"."""
    choice = req.tool_choice or {}
    kind = choice.get("type", "auto")
    if kind not in TOOL_CHOICES:
        expected = ", ".join(f'"{k}"' for k in TOOL_CHOICES)
        raise _bad("tool_choice", f'tool_choice.type: "{kind}" is not one of {expected}')
    if kind in ("auto", "none"):
        return None
    name = choice.get("name") if kind == "tool" else None
    if kind == "tool" and not isinstance(name, str):
        raise _bad("tool_choice.name", 'tool_choice.name: Field required for "type": "tool"')
    parallel = not choice.get("disable_parallel_tool_use", False)
    return forced_calls(template_tools(req.tools, req.tool_choice), name, parallel, "tool_choice")


def chat_turn(req: MessagesRequest) -> ChatTurn:
    ask = SamplingAsk(
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k
    )
    return ChatTurn(
        model=req.model,
        messages=template_messages(req.system, req.messages),
        sampling=ask,
        stops=[stop for stop in req.stop_sequences or [] if stop],
        tools=template_tools(req.tools, req.tool_choice),
        forced=forced_tool_calls(req),
    )


# ---------------------------------------------------------------- responses


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_reason(finished: Finished) -> str:
    return "stop_sequence" if finished.stop_string else STOP_REASONS.get(finished.reason, "end_turn")


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": f"toolu_{call.id.removeprefix('call_')}",
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def message_body(id: str, model: str, text: Delta, finished: Finished) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if text.reasoning:
        content.append({"type": "thinking", "thinking": text.reasoning, "signature": ""})
    if text.content:
        content.append({"type": "text", "text": text.content})
    content.extend(tool_use_block(call) for call in text.tool_calls)
    return {
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(finished),
        "stop_sequence": finished.stop_string,
        "usage": {"input_tokens": finished.prompt_tokens, "output_tokens": finished.completion_tokens},
    }


class MessageEvents:
    """A message's event stream (a StreamFormat). Blocks open as their kind of text arrives: thinking,
    then text; each tool call is a whole tool_use block (its input in one input_json_delta)."""

    content_type = SSE

    def __init__(self, id: str, model: str, prompt_tokens: int) -> None:
        self.id, self.model, self.prompt_tokens = id, model, prompt_tokens
        self._index = -1
        self._open: str | None = None  # "thinking" | "text"

    def start(self) -> list[bytes]:
        message = message_body(self.id, self.model, Delta(), Finished("stop", self.prompt_tokens, 0))
        message |= {"stop_reason": None, "stop_sequence": None}
        message["usage"]["output_tokens"] = 0
        return [
            sse_event("message_start", {"type": "message_start", "message": message}),
            sse_event("ping", {"type": "ping"}),
        ]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _begin(self, block: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self._index += 1
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return [*frames, sse_event("content_block_start", start)]

    def _text(self, kind: str, text: str) -> list[bytes]:
        frames: list[bytes] = []
        if self._open != kind:
            empty = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            frames = self._begin(empty)
            self._open = kind
        delta = (
            {"type": "thinking_delta", "thinking": text}
            if kind == "thinking"
            else {"type": "text_delta", "text": text}
        )
        return [
            *frames,
            sse_event(
                "content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}
            ),
        ]

    def delta(self, delta: Delta) -> list[bytes]:
        frames = self._text("thinking", delta.reasoning) if delta.reasoning else []
        frames += self._text("text", delta.content) if delta.content else []
        for call in delta.tool_calls:
            frames += self._begin(tool_use_block(call) | {"input": {}})
            json_delta = {"type": "input_json_delta", "partial_json": call.arguments}
            frames.append(
                sse_event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": self._index, "delta": json_delta},
                )
            )
            frames.append(
                sse_event("content_block_stop", {"type": "content_block_stop", "index": self._index})
            )
        return frames

    def finish(self, finished: Finished) -> list[bytes]:
        message_delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(finished), "stop_sequence": finished.stop_string},
            "usage": {"output_tokens": finished.completion_tokens},
        }
        return [
            *self._close(),
            sse_event("message_delta", message_delta),
            sse_event("message_stop", {"type": "message_stop"}),
        ]

    def fail(self, message: str) -> list[bytes]:
        return [*self._close(), sse_event("error", anthropic_error_body(503, message))]
