"""OpenAI HTTP endpoints: POST /v1/chat/completions (streamed and not) and GET /v1/models."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from aiohttp import web

from fleet_bus import StateFollower, StreamBroken
from fleet_gateway import openai_api as oai
from fleet_gateway.detokenize import IncrementalDetokenizer
from fleet_gateway.errors import ApiError, error_body
from fleet_gateway.generation import Generator, NoInstance
from fleet_gateway.models import ModelCatalog, ModelInfo
from fleet_gateway.stops import StopMatcher
from fleet_proto import InstanceStatus, State
from fleet_store import StoreError

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def ready_models(state: State) -> list[str]:
    return sorted({i.model_id for i in state.instances.values() if i.status == InstanceStatus.READY})


def known_models(state: State) -> set[str]:
    return {i.model_id for i in state.instances.values()} | {d.model_id for d in state.downloads.values()}


class TextStep:
    """Token ids -> text deltas, cut at the first stop string."""

    def __init__(self, model: ModelInfo, stops: list[str]) -> None:
        self.detokenizer = IncrementalDetokenizer(model.tokenizer)
        self.stops = StopMatcher(stops)
        self.completion_tokens = 0
        self.hit_stop = False

    def push(self, token_ids: tuple[int, ...]) -> str:
        self.completion_tokens += len(token_ids)
        text, self.hit_stop = self.stops.feed(self.detokenizer.push(token_ids))
        return text

    def finish(self) -> str:
        if self.hit_stop:
            return ""
        text, self.hit_stop = self.stops.feed(self.detokenizer.flush())
        return text + ("" if self.hit_stop else self.stops.flush())


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

    async def tokens(request_id: str, model: ModelInfo, prompt: list[int], sampling) -> AsyncIterator:
        try:
            async for chunk in generator.generate(
                request_id, model.model_id, prompt, sampling, model.kv_fingerprint
            ):
                yield chunk
        except NoInstance as exc:
            raise ApiError(503, str(exc)) from None

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        req = oai.parse_chat_request(await request.read())
        model = await resolve(req.model)
        try:
            prompt = model.tokenizer.encode_chat(oai.messages_for_template(req))
        except ValueError as exc:
            raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from None
        sampling = oai.to_sampling(req, model.tokenizer.eos_token_ids, model.max_model_len, len(prompt))
        completion_id, created = oai.new_completion_id(), int(time.time())
        step = TextStep(model, oai.stop_strings(req))
        if not req.stream:
            return await _complete(completion_id, created, req.model, model, prompt, sampling, step)
        return await _stream(request, completion_id, created, req, model, prompt, sampling, step)

    async def _complete(completion_id, created, name, model, prompt, sampling, step) -> web.Response:
        parts, finish = [], "stop"
        try:
            async for chunk in tokens(completion_id, model, prompt, sampling):
                if chunk.finish_reason == "error":
                    raise ApiError(503, f"generation failed: {chunk.error}")
                parts.append(step.push(chunk.token_ids))
                if step.hit_stop:
                    break
                if chunk.finish_reason:
                    finish = oai.openai_finish_reason(chunk.finish_reason)
        except StreamBroken as exc:
            raise ApiError(503, str(exc)) from None
        parts.append(step.finish())
        finish = "stop" if step.hit_stop else finish
        body = oai.completion_response(
            completion_id, name, created, "".join(parts), finish, len(prompt), step.completion_tokens
        )
        return web.json_response(body)

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

        async def emit(text: str, finish: str | None = None) -> None:
            delta = {"content": text} if text else {}
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
            await emit(tail, "stop" if step.hit_stop else finish)
        if usage:
            await response.write(
                oai.sse(
                    oai.usage_chunk(completion_id, req.model, created, len(prompt), step.completion_tokens)
                )
            )
        await response.write(oai.SSE_DONE)
        return response

    async def list_models(_: web.Request) -> web.Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "fleet"}
            for m in ready_models(follower.state)
        ]
        return web.json_response({"object": "list", "data": data})

    return [web.post("/v1/chat/completions", chat_completions), web.get("/v1/models", list_models)]
