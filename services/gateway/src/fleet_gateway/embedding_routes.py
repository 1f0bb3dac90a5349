"""Embedding endpoints: OpenAI's POST /v1/embeddings, Ollama's POST /api/embed and the legacy
POST /api/embeddings (also under /ollama/api). Each resolves an embedding model, tokenizes its
inputs (fleet_gateway.embeddings) and sends them to one instance as one EmbedTask."""

from __future__ import annotations

import time

from aiohttp import web

from fleet_bus import StateFollower
from fleet_gateway import embeddings as emb
from fleet_gateway.errors import ApiError
from fleet_gateway.ollama_api import PREFIXES
from fleet_gateway.turns import Turns
from fleet_proto import EmbeddingFacts
from fleet_proto.messages import EMBED_TASK, TokenChunk


def embedding_routes(turns: Turns, follower: StateFollower) -> list[web.RouteDef]:
    def facts(model_id: str) -> EmbeddingFacts:
        card = follower.state.models.get(model_id)
        if card is None or card.embedding is None:  # resolve() checked it; the model left since
            raise ApiError(503, f"{model_id!r} is no longer staged")
        return card.embedding

    async def embed(
        prefix: str, model_name: str, items: list[str | list[int]], truncate: bool, dimensions: int | None
    ) -> tuple[str, emb.EmbeddingInputs, TokenChunk]:
        model = await turns.resolve(model_name, EMBED_TASK)
        model_facts = facts(model.model_id)
        emb.check_dimensions(dimensions, model_facts)
        inputs = emb.token_inputs(items, model.tokenizer, model_facts, truncate)
        last = await turns.embed(f"{prefix}-{time.time_ns()}", model, inputs.token_ids)
        return model.model_id, inputs, last

    async def openai_embeddings(request: web.Request) -> web.Response:
        req = emb.parse_openai(await request.read())
        model_id, inputs, last = await embed(
            "embd", req.model, emb.openai_inputs(req.input), False, req.dimensions
        )
        return web.json_response(
            emb.openai_body(model_id, last.embeddings, req.encoding_format, inputs.tokens)
        )

    async def ollama_embed(request: web.Request) -> web.Response:
        started = time.monotonic()
        req = emb.parse_ollama(await request.read())
        items = emb.ollama_inputs(req.input)
        model_id, inputs, last = await embed("ollama-embed", req.model, items, req.truncate, req.dimensions)
        duration = time.monotonic() - started
        return web.json_response(emb.ollama_body(model_id, last.embeddings, inputs.tokens, duration))

    async def ollama_embeddings(request: web.Request) -> web.Response:
        req = emb.parse_ollama_legacy(await request.read())
        items = emb.ollama_inputs(req.prompt)
        _, _, last = await embed("ollama-embed", req.model, items, True, None)
        return web.json_response(emb.ollama_legacy_body(last.embeddings))

    routes = [web.post("/v1/embeddings", openai_embeddings)]
    for prefix in PREFIXES:
        routes += [
            web.post(f"{prefix}/embed", ollama_embed),
            web.post(f"{prefix}/embeddings", ollama_embeddings),
        ]
    return routes
