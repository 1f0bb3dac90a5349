"""OpenAI HTTP endpoints: POST /v1/chat/completions, /v1/completions and /v1/responses (streamed
and not), GET /v1/models, and
POST /bench/chat/completions (a non-streamed chat completion with its generation stats; the seed's
bench endpoint: `disaggregated` true / false forces or forbids remote prefill, `transport` picks
"stream" or "staged", `overlap` false sends the KV after the whole prefill instead of layer by layer)."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from fleet_bus import StateFollower
from fleet_gateway import completions_api as capi
from fleet_gateway import openai_api as oai
from fleet_gateway import responses_api as rapi
from fleet_gateway.aliases import servable_models
from fleet_gateway.errors import ApiError, decode_json_body
from fleet_gateway.fanout import collect, collect_choices
from fleet_gateway.frames import Finished
from fleet_gateway.generation import SplitChoice
from fleet_gateway.parsing.output import Delta
from fleet_gateway.streaming import stream_choices, stream_run
from fleet_gateway.turns import ChatTurn, Prepared, Turns
from fleet_proto import TokenChunk
from fleet_proto.messages import TRANSPORTS


class BenchOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The bench endpoint's fields beside a chat completion's."""

    disaggregated: bool | None = None  # None: as routing decides
    transport: str = "auto"
    overlap: bool = True  # False: batch mode, the KV goes out once the prefill is done


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


def chat_turn(req: oai.ChatCompletionRequest) -> ChatTurn:
    return ChatTurn(
        model=req.model,
        messages=oai.messages_for_template(req),
        sampling=oai.sampling_ask(req),
        stops=oai.stop_strings(req),
        tools=oai.tools_for_template(req),
        forced=oai.chat_forced_calls(req),
    )


def openai_routes(turns: Turns, follower: StateFollower) -> list[web.RouteDef]:
    async def prepare_chat(body: bytes) -> tuple[oai.ChatCompletionRequest, Prepared]:
        req = oai.parse_chat_request(body)
        return req, await turns.prepare_chat(chat_turn(req))

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        req, prepared = await prepare_chat(await request.read())
        completion_id, created = oai.new_completion_id(), int(time.time())
        runs = await turns.start_choices(completion_id, prepared, req.n or 1)
        name = prepared.model.model_id
        if req.stream:
            chunks = oai.ChatChunks(completion_id, name, created, oai.include_usage(req), len(runs))
            return await stream_choices(request, runs, chunks)
        results = await collect_choices(runs)
        return web.json_response(chat_body(completion_id, created, name, results))

    async def bench_chat_completions(request: web.Request) -> web.Response:
        raw = await request.read()
        options = decode_json_body(raw, BenchOptions)
        choice = SplitChoice(disaggregate_mode(options), options.transport, options.overlap)
        _, prepared = await prepare_chat(raw)
        completion_id, created = oai.new_completion_id(), int(time.time())
        started = time.monotonic()
        run = await turns.start(completion_id, prepared, choice)
        text, finished = await collect(run)
        body = chat_body(completion_id, created, prepared.model.model_id, [(text, finished)])
        last = finished.last or TokenChunk(request_id=completion_id)
        body["generation_stats"] = generation_stats(last, started, finished.first_token_at, time.monotonic())
        return web.json_response(body)

    async def completions(request: web.Request) -> web.StreamResponse:
        """POST /v1/completions: a raw prompt (no chat template), streamed or not."""
        req = capi.parse_completion_request(await request.read())
        model = await turns.resolve(req.model)
        prompt = capi.prompt_token_ids(req, model.tokenizer)
        prepared = turns.prepare_text(model, prompt, capi.sampling_ask(req), oai.stop_strings(req))
        completion_id, created = capi.new_text_completion_id(), int(time.time())
        runs = await turns.start_choices(completion_id, prepared, req.n or 1)
        if req.stream:
            chunks = capi.TextChunks(
                completion_id, model.model_id, created, oai.include_usage(req), len(runs)
            )
            return await stream_choices(request, runs, chunks)
        results = await collect_choices(runs)
        return web.json_response(
            capi.text_completion_response(completion_id, model.model_id, created, results)
        )

    async def responses(request: web.Request) -> web.StreamResponse:
        """POST /v1/responses: one response, streamed as events or not; nothing is stored."""
        req = rapi.parse_responses_request(await request.read())
        prepared = await turns.prepare_chat(rapi.chat_turn(req))
        response_id = rapi.new_response_id()
        run = await turns.start(response_id, prepared)
        skeleton = rapi.skeleton(response_id, prepared.model.model_id, req, int(time.time()))
        if req.stream:
            return await stream_run(request, run, rapi.ResponseEvents(skeleton))
        text, finished = await collect(run)
        return web.json_response(rapi.response_body(skeleton, text, finished))

    async def list_models(_: web.Request) -> web.Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "fleet"}
            for m in servable_models(follower.state)
        ]
        return web.json_response({"object": "list", "data": data})

    return [
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/completions", completions),
        web.post("/v1/responses", responses),
        web.post("/bench/chat/completions", bench_chat_completions),
        web.get("/v1/models", list_models),
    ]


def chat_body(completion_id: str, created: int, model: str, results: list[tuple[Delta, Finished]]) -> dict:
    """A `chat.completion` of n choices, each (its text, its finish)."""
    choices = [oai.chat_choice(i, text, finished.reason) for i, (text, finished) in enumerate(results)]
    usage = oai.choices_usage([finished for _, finished in results])
    return oai.completion_response(completion_id, model, created, choices, usage)
