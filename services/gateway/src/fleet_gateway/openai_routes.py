"""OpenAI HTTP endpoints: POST /v1/chat/completions and /v1/completions (streamed and not),
GET /v1/models, and
POST /bench/chat/completions (a non-streamed chat completion with its generation stats; the seed's
bench endpoint: `disaggregated` true / false forces or forbids remote prefill, `transport` picks
"stream" or "staged")."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from fleet_bus import StateFollower, StreamBroken
from fleet_gateway import completions_api as capi
from fleet_gateway import openai_api as oai
from fleet_gateway.detokenize import IncrementalDetokenizer
from fleet_gateway.errors import ApiError, decode_json_body, error_body
from fleet_gateway.generation import Generator, NoInstance
from fleet_gateway.models import ModelCatalog, ModelInfo
from fleet_gateway.parsing.output import Delta
from fleet_gateway.parsing.reasoning import OPEN as THINK_OPEN
from fleet_gateway.parsing.reasoning import ThinkParser
from fleet_gateway.parsing.tools import PARSERS, infer_tool_parser
from fleet_gateway.stops import StopMatcher
from fleet_proto import InstanceStatus, State, TokenChunk
from fleet_proto.messages import TRANSPORTS
from fleet_store import StoreError

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def ready_models(state: State) -> list[str]:
    return sorted({i.model_id for i in state.instances.values() if i.status == InstanceStatus.READY})


def known_models(state: State) -> set[str]:
    return {i.model_id for i in state.instances.values()} | {d.model_id for d in state.downloads.values()}


class TextStep:
    """Token ids -> text deltas, cut at the first stop string, then split into reasoning (when the
    model thinks in <think> tags: its chat template says so), answer and tool calls (when the
    request offers tools: in the format the chat template implies)."""

    def __init__(
        self,
        model: ModelInfo,
        stops: list[str],
        prompt_text: str = "",
        tool_format: str = "",
        split_reasoning: bool = True,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(model.tokenizer)
        self.stops = StopMatcher(stops)
        self.completion_tokens = 0
        self.hit_stop = False
        self.tool_calls = 0  # emitted so far
        thinks = split_reasoning and THINK_OPEN in (model.tokenizer.chat_template or "")
        self.reasoning = ThinkParser.for_prompt(prompt_text) if thinks else None
        self.tools = PARSERS[tool_format]() if tool_format else None

    def push(self, token_ids: tuple[int, ...]) -> Delta:
        self.completion_tokens += len(token_ids)
        text, self.hit_stop = self.stops.feed(self.detokenizer.push(token_ids))
        return self._split(text)

    def finish(self) -> Delta:
        text = ""
        if not self.hit_stop:
            text, self.hit_stop = self.stops.feed(self.detokenizer.flush())
            text += "" if self.hit_stop else self.stops.flush()
        return self._split(text, final=True)

    def finish_reason(self, engine_reason: str) -> str:
        if self.hit_stop:
            return "stop"
        return "tool_calls" if self.tool_calls and engine_reason == "stop" else engine_reason

    def _split(self, text: str, final: bool = False) -> Delta:
        delta = Delta(content=text)
        if self.reasoning is not None:
            delta = self.reasoning.push(text)
            delta = delta.merge(self.reasoning.flush()) if final else delta
        if self.tools is not None:
            parsed = self.tools.push(delta.content)
            parsed = parsed.merge(self.tools.flush()) if final else parsed
            delta = Delta(parsed.content, delta.reasoning, parsed.tool_calls)
        self.tool_calls += len(delta.tool_calls)
        return delta


def tool_format(model: ModelInfo, req: oai.ChatCompletionRequest) -> str:
    """The tool-call format to parse ("" when the request offers no tools); 400 when the model's
    chat template cannot render tools or its format is not parsed yet."""
    if oai.tools_for_template(req) is None:
        return ""
    found = infer_tool_parser(model.tokenizer.chat_template or "")
    if found not in PARSERS:
        problem = (
            "does not render tools" if not found else f"calls tools in the {found} format, not supported yet"
        )
        raise ApiError(400, f"The chat template of {model.model_id!r} {problem}.", param="tools")
    return found


class BenchOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The bench endpoint's fields beside a chat completion's."""

    disaggregated: bool | None = None  # None: as routing decides
    transport: str = "auto"


def disaggregate_mode(options: BenchOptions) -> str:
    if options.transport not in TRANSPORTS:
        raise ApiError(400, f"'transport' must be one of {', '.join(TRANSPORTS)}.", param="transport")
    return {None: "auto", True: "always", False: "never"}[options.disaggregated]


def generation_stats(last: TokenChunk, started: float, first_token_at: float, finished: float) -> dict:
    """The bench endpoint's numbers: the engine's and the gateway's timings and the KV handoff."""
    decode_s = finished - first_token_at if first_token_at else 0.0
    tokens = last.completion_tokens
    stats = {
        "prompt_tokens": last.prompt_tokens,
        "generation_tokens": tokens,
        "prefix_cached_tokens": last.prefix_cached_tokens,
        "ttft_s": (first_token_at or finished) - started,
        "total_s": finished - started,
        "prompt_time_s": last.prompt_time_s,
        "decode_time_s": last.decode_time_s,
        "generation_tps": (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0,
        "disaggregated": bool(last.handoff and last.handoff.transport and not last.handoff.fallback),
        "handoff": msgspec.to_builtins(last.handoff) if last.handoff else None,
    }
    return stats


def openai_routes(generator: Generator, catalog: ModelCatalog, follower: StateFollower) -> list[web.RouteDef]:
    async def resolve(model_id: str) -> ModelInfo:
        state = follower.state
        if model_id not in known_models(state):
            available = ", ".join(ready_models(state)) or "none"
            raise ApiError(
                404,
                f"The model {model_id!r} does not exist. Available models: {available}",
                param="model",
                code="model_not_found",
            )
        if model_id not in ready_models(state):
            raise ApiError(503, f"The model {model_id!r} has no ready instance yet; try again shortly")
        try:
            return await catalog.get(model_id)
        except StoreError as exc:
            raise ApiError(503, f"cannot load the tokenizer of {model_id!r}: {exc}") from None

    async def tokens(
        request_id: str, model: ModelInfo, prompt: list[int], sampling, **choices: str
    ) -> AsyncIterator[TokenChunk]:
        try:
            async for chunk in generator.generate(
                request_id, model.model_id, prompt, sampling, model.kv_fingerprint, **choices
            ):
                yield chunk
        except NoInstance as exc:
            raise ApiError(503, str(exc)) from None

    async def prepare(body: bytes):
        req = oai.parse_chat_request(body)
        model = await resolve(req.model)
        formats = tool_format(model, req)
        try:
            text = model.tokenizer.render_chat(
                oai.messages_for_template(req), tools=oai.tools_for_template(req)
            )
        except ValueError as exc:
            raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from None
        prompt = model.tokenizer.encode(text)
        sampling = oai.to_sampling(req, model.tokenizer.eos_token_ids, model.max_model_len, len(prompt))
        return req, model, prompt, sampling, TextStep(model, oai.stop_strings(req), text, formats)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        req, model, prompt, sampling, step = await prepare(await request.read())
        completion_id, created = oai.new_completion_id(), int(time.time())
        if not req.stream:
            body, _, _ = await _complete(completion_id, created, req.model, model, prompt, sampling, step)
            return web.json_response(body)
        return await _stream(request, completion_id, created, req, model, prompt, sampling, step)

    async def bench_chat_completions(request: web.Request) -> web.Response:
        raw = await request.read()
        options = decode_json_body(raw, BenchOptions)
        choices = {"disaggregate": disaggregate_mode(options), "transport": options.transport}
        req, model, prompt, sampling, step = await prepare(raw)
        completion_id, created = oai.new_completion_id(), int(time.time())
        started = time.monotonic()
        body, last, first_token_at = await _complete(
            completion_id, created, req.model, model, prompt, sampling, step, **choices
        )
        body["generation_stats"] = generation_stats(last, started, first_token_at, time.monotonic())
        return web.json_response(body)

    async def _complete(
        completion_id, created, name, model, prompt, sampling, step, **choices: str
    ) -> tuple[dict, TokenChunk, float]:
        """The completion's body, its last chunk and when its first token came (monotonic)."""
        text, finish = Delta(), "stop"
        last, first_token_at = TokenChunk(request_id=completion_id), 0.0
        try:
            async for chunk in tokens(completion_id, model, prompt, sampling, **choices):
                if chunk.finish_reason == "error":
                    raise ApiError(503, f"generation failed: {chunk.error}")
                if chunk.token_ids and not first_token_at:
                    first_token_at = time.monotonic()
                last = chunk
                text = text.merge(step.push(chunk.token_ids))
                if step.hit_stop:
                    break
                if chunk.finish_reason:
                    finish = oai.openai_finish_reason(chunk.finish_reason)
        except StreamBroken as exc:
            raise ApiError(503, str(exc)) from None
        text = text.merge(step.finish())
        body = oai.completion_response(
            completion_id,
            name,
            created,
            text.content,
            step.finish_reason(finish),
            len(prompt),
            step.completion_tokens,
            text.reasoning,
            oai.tool_call_items(text.tool_calls),
        )
        return body, last, first_token_at

    async def _stream(
        request, completion_id, created, req, model, prompt, sampling, step
    ) -> web.StreamResponse:
        usage = oai.include_usage(req)
        # Route and start before answering 200, so "no instance" is still a proper 503.
        chunks = aiter(tokens(completion_id, model, prompt, sampling))
        try:
            first = await anext(chunks)
        except StreamBroken as exc:
            raise ApiError(503, str(exc)) from None
        except StopAsyncIteration:
            first = None
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        await response.write(oai.sse(oai.first_chunk(completion_id, req.model, created, include_usage=usage)))

        async def emit(text: Delta, finish: str | None = None) -> None:
            delta: dict = {"content": text.content} if text.content else {}
            if text.reasoning:
                delta["reasoning_content"] = text.reasoning
            if text.tool_calls:
                first = step.tool_calls - len(text.tool_calls)
                items = oai.tool_call_items(text.tool_calls)
                delta["tool_calls"] = [item | {"index": first + i} for i, item in enumerate(items)]
            await response.write(
                oai.sse(oai.chunk(completion_id, req.model, created, delta, finish, include_usage=usage))
            )

        finish, failed = "stop", False
        try:
            pending = [first] if first is not None else []
            while True:
                chunk = pending.pop() if pending else await anext(chunks)
                if chunk.finish_reason == "error":
                    await response.write(oai.sse(error_body(503, f"generation failed: {chunk.error}")))
                    failed = True
                    break
                text = step.push(chunk.token_ids)
                if text:
                    await emit(text)
                if step.hit_stop:
                    break
                if chunk.finish_reason:
                    finish = oai.openai_finish_reason(chunk.finish_reason)
                    break
        except StopAsyncIteration:
            pass
        except StreamBroken as exc:
            await response.write(oai.sse(error_body(503, str(exc))))
            failed = True
        finally:
            await chunks.aclose()  # not finished: the engine is told to cancel
        if not failed:
            tail = step.finish()
            await emit(tail, step.finish_reason(finish))
        if usage:
            await response.write(
                oai.sse(
                    oai.usage_chunk(completion_id, req.model, created, len(prompt), step.completion_tokens)
                )
            )
        await response.write(oai.SSE_DONE)
        return response

    async def completions(request: web.Request) -> web.StreamResponse:
        """POST /v1/completions: a raw prompt (no chat template), streamed or not."""
        req = capi.parse_completion_request(await request.read())
        model = await resolve(req.model)
        prompt = capi.prompt_token_ids(req, model.tokenizer)
        sampling = oai.to_sampling(req, model.tokenizer.eos_token_ids, model.max_model_len, len(prompt))
        step = TextStep(model, oai.stop_strings(req), split_reasoning=False)
        completion_id, created = capi.new_text_completion_id(), int(time.time())
        chunks = aiter(tokens(completion_id, model, prompt, sampling))
        try:
            first = await anext(chunks, None)  # routed and started before any 200
        except StreamBroken as exc:
            raise ApiError(503, str(exc)) from None
        if not req.stream:
            parts, finish = [], "stop"
            try:
                pending = [first] if first is not None else []
                while pending or not step.hit_stop:
                    chunk = pending.pop() if pending else await anext(chunks, None)
                    if chunk is None:
                        break
                    if chunk.finish_reason == "error":
                        raise ApiError(503, f"generation failed: {chunk.error}")
                    parts.append(step.push(chunk.token_ids).content)
                    if chunk.finish_reason:
                        finish = oai.openai_finish_reason(chunk.finish_reason)
                        break
            except StreamBroken as exc:
                raise ApiError(503, str(exc)) from None
            finally:
                await chunks.aclose()
            parts.append(step.finish().content)
            counts = (len(prompt), step.completion_tokens)
            body = capi.text_completion_response(
                completion_id, req.model, created, "".join(parts), step.finish_reason(finish), counts
            )
            return web.json_response(body)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        finish = "stop"
        try:
            chunk = first
            while chunk is not None:
                if chunk.finish_reason == "error":
                    await response.write(oai.sse(error_body(503, f"generation failed: {chunk.error}")))
                    break
                text = step.push(chunk.token_ids).content
                if text:
                    await response.write(oai.sse(capi.text_chunk(completion_id, req.model, created, text)))
                if step.hit_stop or chunk.finish_reason:
                    finish = oai.openai_finish_reason(chunk.finish_reason or "stop")
                    break
                chunk = await anext(chunks, None)
        except StreamBroken as exc:
            await response.write(oai.sse(error_body(503, str(exc))))
        finally:
            await chunks.aclose()
        tail = step.finish().content
        done = capi.text_chunk(completion_id, req.model, created, tail, step.finish_reason(finish))
        await response.write(oai.sse(done))
        if oai.include_usage(req):
            counts = (len(prompt), step.completion_tokens)
            usage_chunk = capi.text_usage_chunk(completion_id, req.model, created, counts)
            await response.write(oai.sse(usage_chunk))
        await response.write(oai.SSE_DONE)
        return response

    async def list_models(_: web.Request) -> web.Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "fleet"}
            for m in ready_models(follower.state)
        ]
        return web.json_response({"object": "list", "data": data})

    return [
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/completions", completions),
        web.post("/bench/chat/completions", bench_chat_completions),
        web.get("/v1/models", list_models),
    ]
