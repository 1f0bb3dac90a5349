"""Ollama HTTP endpoints, at /api/... (Ollama's own paths) and /ollama/api/... (exo's): chat,
generate, tags, ps, show, version (embed and embeddings: embedding_routes.py)."""

from __future__ import annotations

import time

from aiohttp import web

from fleet_bus import StateFollower
from fleet_gateway import ollama_api as api
from fleet_gateway.aliases import serving_model
from fleet_gateway.errors import ApiError
from fleet_gateway.fanout import collect
from fleet_gateway.parsing.reasoning import OPEN as THINK_OPEN
from fleet_gateway.parsing.tools import infer_tool_parser
from fleet_gateway.streaming import stream_run
from fleet_gateway.turns import Prepared, Turns
from fleet_proto.messages import EMBED_TASK, GENERATE_TASK


def ollama_routes(turns: Turns, follower: StateFollower) -> list[web.RouteDef]:
    async def answer(request: web.Request, prepared: Prepared, stream: bool, generate: bool):
        started, now = time.monotonic(), time.time()
        request_id = f"ollama-{time.time_ns()}"
        run = await turns.start(request_id, prepared)
        lines = api.ChatLines(prepared.model.model_id, now, started, generate=generate)
        if stream:
            return await stream_run(request, run, lines)
        text, finished = await collect(run)
        return web.json_response(lines.line(text, api.done_fields(finished, started)))

    async def chat(request: web.Request) -> web.StreamResponse:
        req = api.parse_chat_request(await request.read())
        prepared = await turns.prepare_chat(api.chat_turn(req))
        return await answer(request, prepared, req.stream, generate=False)

    async def generate(request: web.Request) -> web.StreamResponse:
        req = api.parse_generate_request(await request.read())
        if not req.prompt and not req.system:  # Ollama: an empty prompt only loads the model
            model = await turns.resolve(req.model)
            loaded = {"model": model.model_id, "created_at": api.created_at(time.time()), "response": ""}
            return web.json_response(loaded | {"done": True, "done_reason": "load"})
        if req.raw:
            model = await turns.resolve(req.model)
            ask, prompt = api.sampling_ask(req), model.tokenizer.encode(req.prompt)
            prepared = turns.prepare_text(model, prompt, ask, api.stops(req.options))
        else:
            prepared = await turns.prepare_chat(api.generate_turn(req))
        return await answer(request, prepared, req.stream, generate=True)

    async def tags(_: web.Request) -> web.Response:
        return web.json_response(api.tags_body(follower.state, time.time()))

    async def ps(_: web.Request) -> web.Response:
        return web.json_response(api.ps_body(follower.state))

    async def show(request: web.Request) -> web.Response:
        name = api.parse_show_request(await request.read())
        view = turns.view()
        state = view.state
        serving = serving_model(view, name)  # with a ready instance: its tokenizer tells the rest
        model_id = serving or (name if name in state.models else None)
        if model_id is None:
            raise ApiError(404, f"model '{name}' not found", param="model")
        card = state.models.get(model_id)
        embeds = card is not None and card.embedding is not None
        model = await turns.resolve(serving, EMBED_TASK if embeds else GENERATE_TASK) if serving else None
        template = (model.tokenizer.chat_template or "") if model and not embeds else ""
        capabilities = ["embedding"] if embeds else ["completion"]
        capabilities += ["tools"] if infer_tool_parser(template) else []
        capabilities += ["thinking"] if THINK_OPEN in template else []
        context = model.max_model_len if model else 0
        return web.json_response(api.show_body(card, template, context, capabilities))

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": api.OLLAMA_API_VERSION})

    routes = []
    for prefix in api.PREFIXES:
        routes += [
            web.post(f"{prefix}/chat", chat),
            web.post(f"{prefix}/generate", generate),
            web.get(f"{prefix}/tags", tags),
            web.get(f"{prefix}/ps", ps),
            web.post(f"{prefix}/show", show),
            web.get(f"{prefix}/version", version),
        ]
    return routes
