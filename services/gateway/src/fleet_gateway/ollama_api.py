"""Ollama adapter, pure: /api/chat and /api/generate requests -> ChatTurn / raw prompts, results ->
Ollama's NDJSON lines (streamed by default, as Ollama does) or one object; /api/tags, /api/ps and
/api/show bodies from the cluster state and model cards.

Options mapped: num_predict, temperature, top_p, top_k, min_p, repeat_penalty (vLLM's
repetition_penalty, over the whole context rather than llama.cpp's last repeat_last_n tokens),
presence_penalty, frequency_penalty, seed, stop; others (num_ctx, num_thread, mirostat ...) are
engine settings Fleet chooses itself, or samplers it does not have, and are ignored like Ollama
ignores options a runner does not take. `format`: "json" or a JSON schema constrains the output.
Reasoning goes to `thinking`, tool calls to `message.tool_calls` with arguments as objects.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec

from fleet_gateway import structured
from fleet_gateway.aliases import ready_models
from fleet_gateway.errors import ApiError, decode_json_body
from fleet_gateway.frames import NDJSON, Finished, ndjson_line
from fleet_gateway.parsing.output import Delta
from fleet_gateway.sampling import SamplingAsk, check_sampling
from fleet_gateway.turns import ChatTurn
from fleet_proto import ModelCard, State

# Ollama generates until EOS or the context is full when num_predict is unset (or -1 / -2).
UNBOUNDED_TOKENS = 1 << 30
OLLAMA_API_VERSION = "0.12.0"  # the Ollama API revision these endpoints follow
ROLES = ("system", "user", "assistant", "tool")
NS = 1_000_000_000
PREFIXES = ("/api", "/ollama/api")  # Ollama's own paths, and exo's


class Options(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    num_predict: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None


# SamplingAsk's fields -> the options that set them, for errors
OPTION_NAMES = {
    "max_tokens": "options.num_predict",
    "temperature": "options.temperature",
    "top_p": "options.top_p",
    "top_k": "options.top_k",
    "min_p": "options.min_p",
    "repetition_penalty": "options.repeat_penalty",
    "presence_penalty": "options.presence_penalty",
    "frequency_penalty": "options.frequency_penalty",
}


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    role: Annotated[
        str, msgspec.Meta(extra_json_schema={"enum": list(ROLES)})
    ]  # checked with a clearer error
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class ChatRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    model: str
    messages: list[ChatMessage] = []
    tools: list[dict[str, Any]] | None = None
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    think: bool | str | None = None
    keep_alive: str | int | None = None


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    model: str
    prompt: str = ""
    system: str | None = None
    suffix: str | None = None
    images: list[str] | None = None
    raw: bool = False
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    think: bool | str | None = None
    keep_alive: str | int | None = None


class ShowRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    model: str = ""
    name: str = ""  # older clients send `name`


def _check_common(req: ChatRequest | GenerateRequest) -> None:
    if not req.model.strip():
        raise ApiError(400, "model is required", param="model")
    check_sampling(sampling_ask(req), names=OPTION_NAMES)


def sampling_ask(req: ChatRequest | GenerateRequest) -> SamplingAsk:
    options = req.options or Options()
    num_predict = options.num_predict
    return SamplingAsk(
        max_tokens=max(num_predict, 1) if num_predict is not None and num_predict >= 0 else None,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        min_p=options.min_p,
        repetition_penalty=options.repeat_penalty,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        seed=options.seed,
        max_tokens_param=OPTION_NAMES["max_tokens"],
        default_max_tokens=UNBOUNDED_TOKENS,
        constraint=structured.ollama_format(req.format),
    )


def stops(options: Options | None) -> list[str]:
    return [stop for stop in (options.stop if options else None) or [] if stop]


def parse_chat_request(body: bytes) -> ChatRequest:
    req = decode_json_body(body, ChatRequest)
    _check_common(req)
    for index, message in enumerate(req.messages):
        if message.role not in ROLES:
            raise ApiError(400, f"messages[{index}]: invalid role {message.role!r}", param="messages")
        if message.images:
            raise ApiError(400, "images are not supported: Fleet serves text models", param="messages")
    return req


def parse_generate_request(body: bytes) -> GenerateRequest:
    req = decode_json_body(body, GenerateRequest)
    _check_common(req)
    if req.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    if req.images:
        raise ApiError(400, "images are not supported: Fleet serves text models", param="images")
    return req


def parse_show_request(body: bytes) -> str:
    req = decode_json_body(body, ShowRequest)
    name = req.model or req.name
    if not name:
        raise ApiError(400, "model is required", param="model")
    return name


def _template_call(index: int, call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, "a tool call needs function.name", param="messages")
    arguments = function.get("arguments") or {}
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Ollama messages as chat templates take them; a tool message answers the latest call by name."""
    items: list[dict[str, Any]] = []
    call_ids: dict[str, str] = {}
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            calls = [_template_call(len(call_ids) + i, call) for i, call in enumerate(message.tool_calls)]
            call_ids |= {call["function"]["name"]: call["id"] for call in calls}
            item["tool_calls"] = calls
        if message.role == "tool":
            item["tool_call_id"] = call_ids.get(message.tool_name or "", message.tool_name or "")
            if message.tool_name:
                item["name"] = message.tool_name
        items.append(item)
    return items


def chat_turn(req: ChatRequest) -> ChatTurn:
    if not req.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    return ChatTurn(
        model=req.model,
        messages=template_messages(req.messages),
        sampling=sampling_ask(req),
        stops=stops(req.options),
        tools=req.tools or None,
    )


def generate_turn(req: GenerateRequest) -> ChatTurn:
    """A templated /api/generate prompt: the system and the prompt as one user turn."""
    messages = [{"role": "system", "content": req.system}] if req.system else []
    messages.append({"role": "user", "content": req.prompt})
    return ChatTurn(req.model, messages, sampling_ask(req), stops(req.options))


# ---------------------------------------------------------------- responses


def created_at(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).isoformat().replace("+00:00", "Z")


def done_fields(finished: Finished, started_at: float) -> dict[str, Any]:
    """The last line's counts and durations (nanoseconds, as Ollama reports them)."""
    first = finished.first_token_at or finished.finished_at
    return {
        "done": True,
        "done_reason": "length" if finished.reason == "length" else "stop",
        "total_duration": int((finished.finished_at - started_at) * NS),
        "load_duration": 0,
        "prompt_eval_count": finished.prompt_tokens,
        "prompt_eval_duration": int((first - started_at) * NS),
        "eval_count": finished.completion_tokens,
        "eval_duration": int((finished.finished_at - first) * NS),
    }


def tool_calls(delta: Delta) -> list[dict[str, Any]]:
    return [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in delta.tool_calls]


def chat_message(delta: Delta) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": delta.content}
    if delta.reasoning:
        message["thinking"] = delta.reasoning
    if delta.tool_calls:
        message["tool_calls"] = tool_calls(delta)
    return message


class ChatLines:
    """/api/chat's NDJSON (a StreamFormat); `generate=True` gives /api/generate's `response` lines."""

    content_type = NDJSON

    def __init__(self, model: str, now: float, started_at: float, generate: bool = False) -> None:
        self.model, self.now, self.started_at, self.generate = model, now, started_at, generate

    def line(self, delta: Delta, done: dict[str, Any] | None = None) -> dict[str, Any]:
        head = {"model": self.model, "created_at": created_at(self.now)}
        body: dict[str, Any]
        if self.generate:
            body = {"response": delta.content} | ({"thinking": delta.reasoning} if delta.reasoning else {})
        else:
            body = {"message": chat_message(delta)}
        return head | body | (done or {"done": False})

    def start(self) -> list[bytes]:
        return []

    def delta(self, delta: Delta) -> list[bytes]:
        return [ndjson_line(self.line(delta))]

    def finish(self, finished: Finished) -> list[bytes]:
        return [ndjson_line(self.line(Delta(), done_fields(finished, self.started_at)))]

    def fail(self, message: str) -> list[bytes]:
        return [ndjson_line({"error": message})]


def model_details(card: ModelCard | None) -> dict[str, Any]:
    if card is None:
        return {"format": "", "family": "", "families": [], "parameter_size": "", "quantization_level": ""}
    gguf = card.quantization.startswith("gguf")
    return {
        "parent_model": card.base_model,
        "format": "gguf" if gguf else "safetensors",
        "family": card.architecture,
        "families": [card.architecture],
        "parameter_size": "",
        "quantization_level": card.quantization or card.dtype,
    }


def digest(model_id: str) -> str:
    """A stable id for the model name (Fleet models are folders, not one blob with a digest)."""
    return hashlib.sha256(model_id.encode()).hexdigest()


def _listed(model_id: str, card: ModelCard | None) -> dict[str, Any]:
    return {
        "name": model_id,
        "model": model_id,
        "size": card.storage_bytes if card else 0,
        "digest": digest(model_id),
        "details": model_details(card),
    }


def tags_body(state: State, now: float) -> dict[str, Any]:
    """Every model staged in the cluster (Ollama: the models pulled locally)."""
    return {
        "models": [
            _listed(model_id, card) | {"modified_at": created_at(now)}
            for model_id, card in sorted(state.models.items())
        ]
    }


def ps_body(state: State) -> dict[str, Any]:
    """Models with a ready instance (Ollama: loaded in memory); they stay until deleted."""
    return {
        "models": [
            _listed(model_id, state.models.get(model_id))
            | {"expires_at": "9999-12-31T23:59:59Z", "size_vram": 0}
            for model_id in ready_models(state)
        ]
    }


def show_body(
    card: ModelCard | None, template: str, context_length: int, capabilities: list[str]
) -> dict[str, Any]:
    architecture = card.architecture if card else ""
    info: dict[str, Any] = {"general.architecture": architecture}
    if architecture:
        info[f"{architecture}.context_length"] = context_length
        info[f"{architecture}.block_count"] = card.num_layers if card else 0
    return {
        "modelfile": "",
        "parameters": "",
        "template": template,
        "details": model_details(card),
        "model_info": info,
        "capabilities": capabilities,
    }
