"""OpenAI Responses adapter, pure: POST /v1/responses request -> ChatTurn, results -> a `response`
object or its event stream (response.created, output items opened, their deltas, closed,
response.completed), as the Responses API reference orders them.

Input items: messages (roles user / system / developer / assistant, text parts), function_call and
function_call_output (rendered as the assistant's tool calls and tool turns), reasoning (dropped).
Output items: reasoning (reasoning_text content), message (output_text), function_call. Responses
are not stored (store is reported false), so previous_response_id is refused. `text.format`
json_object / json_schema constrain the output (`structured`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from fleet_gateway import structured
from fleet_gateway.content import NotText, joined_text
from fleet_gateway.errors import ApiError, decode_json_body
from fleet_gateway.frames import SSE, Finished, sse_event
from fleet_gateway.parsing.output import Delta, ToolCall
from fleet_gateway.sampling import SamplingAsk, check_sampling
from fleet_gateway.tool_grammar import ForcedCalls, forced_calls
from fleet_gateway.turns import ChatTurn

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class TextConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    format: structured.ResponsesTextFormat | None = None


class ResponsesRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension, as in chat completions
    seed: int | None = None  # extension
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    top_logprobs: int | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def parse_responses_request(body: bytes) -> ResponsesRequest:
    req = decode_json_body(body, ResponsesRequest)
    if not req.model.strip():
        raise _bad("model", "'model' must be a non-empty string.")
    if req.previous_response_id:
        raise _bad(
            "previous_response_id", "Responses are not stored; send the whole conversation as 'input'."
        )
    if req.top_logprobs:
        raise _bad("top_logprobs", "'top_logprobs' is not supported yet.")
    for index, tool in enumerate(req.tools or []):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{index}]", f"tools[{index}]: only function tools with a name are supported.")
    responses_forced_calls(req)  # for its 400s
    check_sampling(sampling_ask(req))
    return req


def sampling_ask(req: ResponsesRequest) -> SamplingAsk:
    return SamplingAsk(
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        max_tokens_param="max_output_tokens",
        constraint=structured.response_format(text_format(req), "text.format"),
    )


def text_format(req: ResponsesRequest) -> structured.ResponsesTextFormat | None:
    return req.text.format if req.text else None


def _content_text(content: Any, where: str) -> str:
    try:
        return joined_text(content, TEXT_PARTS)
    except NotText as exc:
        if exc.index is None:
            raise _bad(where, f"'{where}' must be a string or a list of content parts.") from None
        message = f"Content part type {exc.kind!r} is not supported; only text parts are."
        raise _bad(f"{where}[{exc.index}]", message) from None


def template_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """Input items -> chat template messages; function calls join the assistant turn before them."""
    items: list[dict[str, Any]] = (
        [{"role": "system", "content": req.instructions}] if req.instructions else []
    )
    inputs = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not inputs:
        raise _bad("input", "'input' must not be empty.")
    for index, item in enumerate(inputs):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"{where}.role", f"Invalid role {role!r}; expected one of {', '.join(ROLES)}.")
            role = "system" if role == "developer" else role
            items.append({"role": role, "content": _content_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            try:
                arguments = json.loads(item.get("arguments") or "{}")
            except (TypeError, ValueError):
                raise _bad(f"{where}.arguments", f"'{where}.arguments' is not JSON.") from None
            call = {"id": item.get("call_id", ""), "type": "function"}
            call["function"] = {"name": item.get("name", ""), "arguments": arguments}
            if not (items and items[-1]["role"] == "assistant"):
                items.append({"role": "assistant", "content": ""})
            items[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
            items.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise _bad(f"{where}.type", f"Input item type {kind!r} is not supported.")
    return items


def template_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Responses' flat function tools -> chat completions' nested ones (what templates render)."""
    if not req.tools or req.tool_choice == "none":
        return None
    fields = ("name", "description", "parameters")
    return [{"type": "function", "function": {k: t[k] for k in fields if k in t}} for t in req.tools]


def responses_forced_calls(req: ResponsesRequest) -> ForcedCalls | None:
    """tool_choice "required" (calls of any tool) or {"type": "function", "name": f} (a call of f):
    one call when parallel_tool_calls is false. None for "auto" and "none"."""
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        return forced_calls(template_tools(req), None, parallel, "tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return forced_calls(template_tools(req), choice["name"], parallel, "tool_choice")
    raise _bad(
        "tool_choice",
        f'Invalid \'tool_choice\': {json.dumps(choice)}; expected "auto", "none", "required" or '
        '{"type": "function", "name": ...}.',
    )


def chat_turn(req: ResponsesRequest) -> ChatTurn:
    forced = responses_forced_calls(req)
    return ChatTurn(req.model, template_messages(req), sampling_ask(req), [], template_tools(req), forced)


# ---------------------------------------------------------------- responses


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def skeleton(id: str, model: str, req: ResponsesRequest, created_at: int) -> dict[str, Any]:
    """The response object before any output (the request's settings echoed, as OpenAI does)."""
    return {
        "id": id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": msgspec.to_builtins(text_format(req) or structured.TextFormat())},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def _usage(finished: Finished) -> dict[str, Any]:
    return {
        "input_tokens": finished.prompt_tokens,
        "input_tokens_details": {"cached_tokens": finished.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": finished.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
    }


def completed(skeleton: dict[str, Any], output: list[dict[str, Any]], finished: Finished) -> dict[str, Any]:
    cut = finished.reason == "length"
    return skeleton | {
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output,
        "usage": _usage(finished),
    }


def reasoning_item(id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": id, "summary": [], "content": content, "status": status}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [output_text(text)] if status == "completed" else []
    return {"type": "message", "id": id, "status": status, "role": "assistant", "content": content}


def function_call_item(id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    arguments = call.arguments if status == "completed" else ""
    return {
        "type": "function_call",
        "id": id,
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


def response_body(skeleton: dict[str, Any], text: Delta, finished: Finished) -> dict[str, Any]:
    output = [reasoning_item(_item_id("rs"), text.reasoning)] if text.reasoning else []
    output += [message_item(_item_id("msg"), text.content)] if text.content else []
    output += [function_call_item(_item_id("fc"), call) for call in text.tool_calls]
    return completed(skeleton, output, finished)


class ResponseEvents:
    """A response's event stream (a StreamFormat): every event numbered; text items (reasoning,
    message) open when their text starts and close when another kind begins or the run ends; each
    function call is added, its arguments sent in one delta, and done."""

    content_type = SSE

    def __init__(self, skeleton: dict[str, Any]) -> None:
        self.skeleton = skeleton
        self._sequence = 0
        self._output: list[dict[str, Any]] = []  # finished items
        self._open: tuple[str, str, str] | None = None  # (kind, item id, text so far)

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self._sequence} | fields
        self._sequence += 1
        return sse_event(kind, body)

    def start(self) -> list[bytes]:
        return [
            self._event("response.created", response=self.skeleton),
            self._event("response.in_progress", response=self.skeleton),
        ]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        kind, item_id, text = self._open
        self._open = None
        index = len(self._output)
        if kind == "reasoning":
            part, item = {"type": "reasoning_text", "text": text}, reasoning_item(item_id, text)
            frames = [
                self._event(
                    "response.reasoning_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            ]
        else:
            part, item = output_text(text), message_item(item_id, text)
            frames = [
                self._event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            ]
        frames.append(
            self._event(
                "response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part
            )
        )
        frames.append(self._event("response.output_item.done", output_index=index, item=item))
        self._output.append(item)
        return frames

    def _text(self, kind: str, text: str) -> list[bytes]:
        frames: list[bytes] = []
        if self._open is None or self._open[0] != kind:
            frames = self._close()
            item_id = _item_id("rs" if kind == "reasoning" else "msg")
            empty_item = (
                reasoning_item(item_id, "", "in_progress")
                if kind == "reasoning"
                else message_item(item_id, "", "in_progress")
            )
            empty_part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else output_text("")
            index = len(self._output)
            frames.append(self._event("response.output_item.added", output_index=index, item=empty_item))
            frames.append(
                self._event(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=empty_part,
                )
            )
            self._open = (kind, item_id, "")
        _, item_id, so_far = self._open
        self._open = (kind, item_id, so_far + text)
        index = len(self._output)
        if kind == "reasoning":
            frames.append(
                self._event(
                    "response.reasoning_text.delta",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    delta=text,
                )
            )
        else:
            frames.append(
                self._event(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        return frames

    def _call(self, call: ToolCall) -> list[bytes]:
        frames = self._close()
        item_id, index = _item_id("fc"), len(self._output)
        item = function_call_item(item_id, call)
        frames.append(
            self._event(
                "response.output_item.added",
                output_index=index,
                item=function_call_item(item_id, call, "in_progress"),
            )
        )
        frames.append(
            self._event(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=index,
                delta=call.arguments,
            )
        )
        frames.append(
            self._event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                name=call.name,
                arguments=call.arguments,
            )
        )
        frames.append(self._event("response.output_item.done", output_index=index, item=item))
        self._output.append(item)
        return frames

    def delta(self, delta: Delta) -> list[bytes]:
        frames = self._text("reasoning", delta.reasoning) if delta.reasoning else []
        frames += self._text("message", delta.content) if delta.content else []
        for call in delta.tool_calls:
            frames += self._call(call)
        return frames

    def finish(self, finished: Finished) -> list[bytes]:
        frames = self._close()
        body = completed(self.skeleton, self._output, finished)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [*frames, self._event(kind, response=body)]

    def fail(self, message: str) -> list[bytes]:
        frames = self._close()
        error = {"code": "server_error", "message": message}
        failed = self.skeleton | {"status": "failed", "error": error, "output": self._output}
        return [*frames, self._event("response.failed", response=failed)]
