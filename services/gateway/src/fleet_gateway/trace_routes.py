"""Request traces at the gateway: the root span of every API request, and the trace queries.

`tracing_middleware` opens each traced request's root span (category http); the spans the request
causes anywhere hang from it. GET /v1/traces (newest first, ?limit=), GET /v1/traces/{id} (its
spans; id: a trace id or the request's id, e.g. chatcmpl-...), GET /v1/traces/{id}/stats (time
per category, exo's compute_stats) and DELETE /v1/traces[/{id}] (admin) ask the metrics-collector,
which keeps the recent traces, over NATS.
"""

from __future__ import annotations

import msgspec
from aiohttp import web
from opentelemetry.trace import SpanKind

from fleet_bus import Bus, RequestFailed
from fleet_gateway.errors import ApiError
from fleet_proto.subjects import TRACE_DELETE_SUBJECT, TRACE_GET_SUBJECT, TRACE_LIST_SUBJECT
from fleet_proto.traces import (
    TraceDeleteReply,
    TraceDeleteRequest,
    TraceListReply,
    TraceListRequest,
    TraceReply,
    TraceRequest,
)
from fleet_runtime.tracing import Tracing

TRACED_PREFIXES = (
    "/v1/chat/",
    "/v1/completions",
    "/v1/messages",
    "/v1/responses",
    "/bench/",
    "/api/",
    "/ollama/",
)
QUERY_TIMEOUT_S = 5.0


def traced(path: str) -> bool:
    return path.startswith(TRACED_PREFIXES)


def tracing_middleware(tracing: Tracing):
    @web.middleware
    async def middleware(request: web.Request, handler):
        if not traced(request.path):
            return await handler(request)
        name = f"{request.method} {request.path}"
        with tracing.span(name, "http", {"http.method": request.method}, kind=SpanKind.SERVER) as span:
            response = await handler(request)
            span.set_attribute("http.status_code", response.status)
            return response

    return middleware


def trace_routes(bus: Bus) -> list[web.RouteDef]:
    async def ask(subject: str, message: msgspec.Struct, reply_type: type):
        try:
            return await bus.request(subject, message, reply_type, QUERY_TIMEOUT_S)
        except RequestFailed as error:
            raise ApiError(503, f"the trace store (metrics-collector) did not answer: {error}") from None

    async def trace_of(request: web.Request) -> TraceReply:
        key = request.match_info["trace_id"]
        reply = await ask(TRACE_GET_SUBJECT, TraceRequest(key=key), TraceReply)
        if not reply.trace_id:
            raise ApiError(
                404,
                f"no trace {key!r} (traces are kept for the most recent requests)",
                code="trace_not_found",
            )
        return reply

    async def list_traces(request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", "100"))
        except ValueError:
            raise ApiError(400, "limit must be an integer", param="limit") from None
        if not 1 <= limit <= 1000:
            raise ApiError(400, "limit must be between 1 and 1000", param="limit")
        reply = await ask(TRACE_LIST_SUBJECT, TraceListRequest(limit=limit), TraceListReply)
        return web.json_response({"object": "list", "data": msgspec.to_builtins(reply.traces)})

    async def get_trace(request: web.Request) -> web.Response:
        reply = await trace_of(request)
        return web.json_response({"trace_id": reply.trace_id, "spans": msgspec.to_builtins(reply.spans)})

    async def get_stats(request: web.Request) -> web.Response:
        reply = await trace_of(request)
        return web.json_response(msgspec.to_builtins(reply.stats))

    async def delete_traces(request: web.Request) -> web.Response:
        key = request.match_info.get("trace_id", "")
        reply = await ask(TRACE_DELETE_SUBJECT, TraceDeleteRequest(key=key), TraceDeleteReply)
        if key and not reply.deleted:
            raise ApiError(404, f"no trace {key!r}", code="trace_not_found")
        return web.json_response({"deleted": reply.deleted})

    return [
        web.get("/v1/traces", list_traces),
        web.get("/v1/traces/{trace_id}", get_trace),
        web.get("/v1/traces/{trace_id}/stats", get_stats),
        web.delete("/v1/traces", delete_traces),
        web.delete("/v1/traces/{trace_id}", delete_traces),
    ]
