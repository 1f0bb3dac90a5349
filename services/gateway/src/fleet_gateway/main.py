"""Gateway service: the HTTP APIs on FLEET_GATEWAY_HOST:FLEET_GATEWAY_PORT.

/health, /state, /events, /kv; admin: /models, /instances; OpenAI: /v1/chat/completions,
/v1/completions, /v1/responses, /v1/models; Anthropic: /v1/messages; Ollama: /api/* and /ollama/api/*;
the dashboard at / (its assets under /ui/, node series at /dashboard/series).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import redis.asyncio as aioredis
from aiohttp import web

from fleet_gateway.admin import admin_routes
from fleet_gateway.admission import Admission, AdmissionLimits
from fleet_gateway.admission_routes import KeyPriorities, admission_routes, publish_samples
from fleet_gateway.anthropic_routes import anthropic_routes
from fleet_gateway.app import state_routes
from fleet_gateway.auth import KeyRing, auth_middleware
from fleet_gateway.dashboard_routes import dashboard_routes
from fleet_gateway.embedding_routes import embedding_routes
from fleet_gateway.errors import error_middleware
from fleet_gateway.generation import Generator
from fleet_gateway.kv_routes import kv_routes
from fleet_gateway.limits import RateLimiter, StreamLimiter, limits_middleware
from fleet_gateway.liveness import NodeLiveness
from fleet_gateway.models import ModelCatalog
from fleet_gateway.ollama_routes import ollama_routes
from fleet_gateway.openai_routes import openai_routes
from fleet_gateway.openapi import openapi_document
from fleet_gateway.sampling import RequestLimits
from fleet_gateway.scaling_routes import scaling_routes
from fleet_gateway.trace_routes import trace_routes, tracing_middleware
from fleet_gateway.turns import Turns
from fleet_proto import NodeMetrics, ServiceKind
from fleet_proto.routing_view import KeptView
from fleet_proto.subjects import ALL_METRICS_SUBJECT
from fleet_runtime.health import health_handler, start_http
from fleet_runtime.service import ServiceContext, run
from fleet_store import ObjectStore
from fleet_store.kv_index import KVIndex

log = logging.getLogger("fleet_gateway")
# A limit check must not wait on a dead Redis: it fails open after this.
LIMITS_REDIS_TIMEOUT_S = 0.5
# Every other Redis call (KV index summary, dashboard series) answers a 503 within seconds.
REDIS_SOCKET_TIMEOUT_S = 2.0


async def main(ctx: ServiceContext) -> None:
    store = ObjectStore.from_settings(ctx.settings)
    await asyncio.to_thread(store.check)
    settings = ctx.settings
    # One client for the KV index summary, the dashboard's series, the rate limiter and priorities.
    redis = aioredis.from_url(
        settings.redis_url,
        socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
        socket_timeout=REDIS_SOCKET_TIMEOUT_S,
    )
    priorities = KeyPriorities(redis)
    ctx.spawn(priorities.keep_fresh(), "admission-priorities")
    admission_limits = AdmissionLimits(
        settings.admission_queue,
        settings.admission_queue_per_key,
        settings.admission_timeout_s,
        settings.cold_start_timeout_s,
    )
    # The follower's State indexed, kept per State object: model resolution, admission, the
    # fallback route() and /state all read it (no scan of every instance per request).
    view = KeptView(lambda: ctx.follower.state)
    admission = Admission(view, admission_limits, priorities.of)
    ctx.spawn(publish_samples(ctx.bus, ctx.service_id, admission), "admission-samples")

    def on_sample(sample: NodeMetrics) -> None:
        admission.load.on_sample(sample)
        admission.wake()  # a report may show room

    liveness = NodeLiveness(ctx.bus, on_sample)
    metrics_sub = await ctx.bus.nc.subscribe(ALL_METRICS_SUBJECT, cb=liveness.on_metrics)
    catalog = ModelCatalog(store, Path(ctx.settings.state_dir) / "gateway" / "tokenizers")
    generator = Generator(
        ctx.bus,
        ctx.follower,
        liveness,
        ctx.tracing,
        ctx.settings.kv_block_size,
        ctx.settings.disagg_min_tokens,
        ctx.settings.max_migrations,
        admission,
        view,
    )

    keys = KeyRing.from_settings(settings.api_keys, settings.admin_keys)
    if not keys.enabled:
        log.warning("no FLEET_API_KEYS or FLEET_ADMIN_KEYS: the gateway's APIs are open to anyone")
    middlewares = [
        tracing_middleware(ctx.tracing),  # outermost: the root span covers the whole request
        error_middleware,
        auth_middleware(keys),
        limits_middleware(
            StreamLimiter(settings.max_streams_per_key),
            RateLimiter(redis, settings.rate_limit_per_s, settings.rate_limit_burst, LIMITS_REDIS_TIMEOUT_S),
        ),
    ]
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    app.router.add_get("/health", health_handler(ctx.service_id, ctx.health_checks))
    app.add_routes(state_routes(ctx.follower, view))
    app.add_routes(admin_routes(ctx.bus, ctx.follower, store))
    app.add_routes(scaling_routes(ctx.bus, ctx.follower))
    app.add_routes(admission_routes(admission, admission_limits, priorities))
    limits = RequestLimits(settings.max_prompt_tokens, settings.max_completion_tokens, settings.max_n)
    turns = Turns(generator, catalog, ctx.follower, ctx.tracing, limits, view)
    app.add_routes(openai_routes(turns, ctx.follower))
    app.add_routes(anthropic_routes(turns))
    app.add_routes(ollama_routes(turns, ctx.follower))
    app.add_routes(embedding_routes(turns, ctx.follower))
    document = openapi_document()

    async def openapi_json(_: web.Request) -> web.Response:
        return web.json_response(document)

    app.router.add_get("/openapi.json", openapi_json)
    app.add_routes(dashboard_routes(ctx.follower, redis, liveness.live_samples))
    app.add_routes(trace_routes(ctx.bus))
    app.add_routes(kv_routes(KVIndex(redis), ctx.settings.kv_block_size, liveness.live_samples))
    runner = await start_http(
        app, ctx.settings.gateway_host, ctx.settings.gateway_port, cancel_on_disconnect=True
    )

    async def close() -> None:
        await runner.cleanup()
        await metrics_sub.unsubscribe()
        await redis.aclose()
        store.close()

    ctx.on_shutdown(close)


def cli() -> None:
    run(ServiceKind.GATEWAY, main, health_port=0)  # /health is on the API port
