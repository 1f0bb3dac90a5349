"""Metrics collector: node samples from `fleet.metrics.<node>` and request stats from
`fleet.stats.request`, exported on /metrics (Prometheus) and as recent series (Redis) on /api."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial

import msgspec
import redis.asyncio as aioredis
from aiohttp import web
from nats.aio.msg import Msg
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fleet_bus import error_text
from fleet_metrics.api import nodes_view
from fleet_metrics.registry import CONTENT_TYPE, FleetMetrics
from fleet_metrics.traces import TraceStore
from fleet_proto import NodeMetrics, ServiceKind
from fleet_proto.messages import AdmissionSample, RequestStats
from fleet_proto.subjects import (
    ALL_ADMISSION_SUBJECT,
    ALL_METRICS_SUBJECT,
    REQUEST_STATS_SUBJECT,
    TRACE_DELETE_SUBJECT,
    TRACE_GET_SUBJECT,
    TRACE_LIST_SUBJECT,
    TRACE_SPANS_SUBJECT,
)
from fleet_proto.traces import (
    SpanBatch,
    TraceDeleteReply,
    TraceDeleteRequest,
    TraceListReply,
    TraceListRequest,
    TraceReply,
    TraceRequest,
    trace_stats,
)
from fleet_runtime.service import ServiceContext, run
from fleet_runtime.settings import load_settings
from fleet_store import series
from fleet_store.series import BadQuery, parse_series_query

log = logging.getLogger("fleet_metrics")

SERIES_INTERVAL_S = 1.0  # at most one Redis write per node per interval
MAX_REQUESTS_PER_FLUSH = 1000  # finished requests written per interval (the rest wait for the next)

REDIS_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)

_metrics_decoder = msgspec.json.Decoder(NodeMetrics)
_stats_decoder = msgspec.json.Decoder(RequestStats)
_admission_decoder = msgspec.json.Decoder(AdmissionSample)
GATEWAY_SILENCE_S = 10.0
_spans_decoder = msgspec.json.Decoder(SpanBatch)


class SeriesWriter:
    """Writes one interval's series points to Redis. The series are advisory: when Redis cannot be
    reached, the rest of that interval's batch is dropped (a Redis that hangs costs one socket timeout
    per interval, not one per point) and the outage is logged once, with one line when writes work
    again; any other Redis error costs only its own point."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self.failing = False

    async def flush(
        self, requests: list[tuple[RequestStats, float]], samples: dict[str, NodeMetrics]
    ) -> None:
        writes = [
            *((r.node_id, partial(series.record_request, self._client, r, at)) for r, at in requests),
            *((n, partial(series.record, self._client, n, sample)) for n, sample in samples.items()),
        ]
        for node_id, write in writes:
            try:
                await write()
            except REDIS_UNREACHABLE as exc:
                if not self.failing:
                    log.warning("series writes to Redis fail, dropping points until it answers: %s", exc)
                self.failing = True
                return
            except RedisError as exc:
                log.warning("series write for %s failed: %s", node_id, exc)
        if self.failing and writes:
            log.info("series writes to Redis work again")
            self.failing = False


async def main(ctx: ServiceContext) -> None:
    client = aioredis.from_url(ctx.settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
    await client.ping()  # fail at start, with the URL in the error

    async def check_redis() -> None:
        await client.ping()

    ctx.health_checks["redis"] = check_redis
    ctx.on_shutdown(client.aclose)

    latest: dict[str, NodeMetrics] = {}
    pending: dict[str, NodeMetrics] = {}  # newest sample per node not yet written to Redis
    finished: list[tuple[RequestStats, float]] = []  # finished requests not yet written, with when

    def live_samples() -> list[NodeMetrics]:
        # only nodes the event stream still lists: a node that left stops being reported
        nodes = ctx.follower.state.nodes
        return [m for node_id, m in latest.items() if node_id in nodes]

    gateways: dict[str, AdmissionSample] = {}

    def live_gateways() -> list[AdmissionSample]:  # a gateway silent for a while is gone
        now = time.time()
        return [s for s in gateways.values() if now - s.at < GATEWAY_SILENCE_S]

    async def on_admission(msg: Msg) -> None:
        with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
            sample = _admission_decoder.decode(msg.data)
            gateways[sample.gateway_id] = sample

    metrics = FleetMetrics(live_samples, live_gateways, lambda: ctx.follower.state)

    async def on_metrics(msg: Msg) -> None:
        try:
            sample = _metrics_decoder.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return
        latest[sample.node_id] = sample
        pending[sample.node_id] = sample

    async def on_request_stats(msg: Msg) -> None:
        try:
            stats = _stats_decoder.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return
        metrics.observe_request(stats)
        finished.append((stats, time.time()))

    writer = SeriesWriter(client)

    async def write_series() -> None:
        # Flushes the newest pending sample of each node once per interval, so Redis sees at most
        # one write per node per second whatever the publish rate, and NATS callbacks never wait on it.
        while True:
            await asyncio.sleep(SERIES_INTERVAL_S)
            batch = dict(pending)
            pending.clear()
            requests = finished[:MAX_REQUESTS_PER_FLUSH]
            del finished[: len(requests)]
            await writer.flush(requests, batch)

    sub = await ctx.bus.nc.subscribe(ALL_METRICS_SUBJECT, cb=on_metrics)
    ctx.on_shutdown(sub.unsubscribe)
    stats_sub = await ctx.bus.nc.subscribe(REQUEST_STATS_SUBJECT, cb=on_request_stats)
    ctx.on_shutdown(stats_sub.unsubscribe)
    admission_sub = await ctx.bus.nc.subscribe(ALL_ADMISSION_SUBJECT, cb=on_admission)
    ctx.on_shutdown(admission_sub.unsubscribe)
    ctx.spawn(write_series(), name="series-writer")
    await serve_traces(ctx, TraceStore(ctx.settings.trace_store_traces))

    async def get_metrics(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def get_nodes(_: web.Request) -> web.Response:
        return web.json_response({"nodes": nodes_view(ctx.follower.state.nodes, latest)})

    async def get_series(request: web.Request) -> web.Response:
        node_id = request.match_info["node_id"]
        if node_id not in ctx.follower.state.nodes and node_id not in latest:
            return web.json_response({"error": f"unknown node {node_id!r}"}, status=404)
        try:
            metric, window_s = parse_series_query(request.query)
        except BadQuery as exc:
            return web.json_response({"error": str(exc)}, status=400)
        try:
            points = await series.read(client, node_id, metric, window_s)
        except (RedisError, OSError) as exc:  # the series live in Redis: say it is down
            reason = f"the metrics store (Redis) is unavailable: {error_text(exc)}"
            return web.json_response({"error": reason}, status=503)
        return web.json_response([[ts, value] for ts, value in points])

    ctx.routes += [
        web.get("/metrics", get_metrics),
        web.get("/api/nodes", get_nodes),
        web.get("/api/nodes/{node_id}/series", get_series),
    ]


async def serve_traces(ctx: ServiceContext, store: TraceStore) -> None:
    """Keep every service's spans, answer the gateway's trace queries."""

    async def on_spans(msg: Msg) -> None:
        try:
            store.add(_spans_decoder.decode(msg.data).spans)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return

    async def list_traces(request: TraceListRequest) -> TraceListReply:
        return TraceListReply(traces=tuple(store.summaries(request.limit)))

    async def get_trace(request: TraceRequest) -> TraceReply:
        trace_id, spans = store.trace_id(request.key), store.get(request.key)
        if not spans:
            return TraceReply()
        return TraceReply(trace_id=trace_id, spans=tuple(spans), stats=trace_stats(trace_id, spans))

    async def delete_traces(request: TraceDeleteRequest) -> TraceDeleteReply:
        return TraceDeleteReply(deleted=store.delete(request.key))

    subs = [
        await ctx.bus.nc.subscribe(TRACE_SPANS_SUBJECT, cb=on_spans),
        await ctx.bus.serve(TRACE_LIST_SUBJECT, TraceListRequest, list_traces),
        await ctx.bus.serve(TRACE_GET_SUBJECT, TraceRequest, get_trace),
        await ctx.bus.serve(TRACE_DELETE_SUBJECT, TraceDeleteRequest, delete_traces),
    ]
    for sub in subs:
        ctx.on_shutdown(sub.unsubscribe)


def cli() -> None:
    # /metrics, /api and /health share FLEET_METRICS_PORT, the port Prometheus scrapes.
    run(ServiceKind.METRICS, main, health_port=load_settings().metrics_port)
