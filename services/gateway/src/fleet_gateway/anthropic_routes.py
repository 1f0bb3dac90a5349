"""Anthropic HTTP endpoints: POST /v1/messages (streamed and not), POST /v1/messages/count_tokens."""

from __future__ import annotations

from aiohttp import web

from fleet_gateway import anthropic_api as api
from fleet_gateway.fanout import collect
from fleet_gateway.streaming import stream_run
from fleet_gateway.turns import Turns, render_prompt


def anthropic_routes(turns: Turns) -> list[web.RouteDef]:
    async def messages(request: web.Request) -> web.StreamResponse:
        req = api.parse_messages_request(await request.read())
        prepared = await turns.prepare_chat(api.chat_turn(req))
        message_id = api.new_message_id()
        run = await turns.start(message_id, prepared)
        name = prepared.model.model_id
        if req.stream:
            return await stream_run(request, run, api.MessageEvents(message_id, name, run.prompt_tokens))
        text, finished = await collect(run)
        return web.json_response(api.message_body(message_id, name, text, finished))

    async def count_tokens(request: web.Request) -> web.Response:
        req = api.parse_count_tokens_request(await request.read())
        model = await turns.resolve(req.model)
        messages = api.template_messages(req.system, req.messages)
        text = render_prompt(model, messages, api.template_tools(req.tools, None))
        return web.json_response({"input_tokens": len(model.tokenizer.encode(text))})

    return [web.post("/v1/messages", messages), web.post("/v1/messages/count_tokens", count_tokens)]
