"""Metrics collector: folds `fleet.metrics.<node>` into the latest sample per node, serves /metrics."""

from __future__ import annotations

import msgspec
from aiohttp import web
from nats.aio.msg import Msg

from fleet_metrics.prometheus import render
from fleet_proto import NodeMetrics, ServiceKind
from fleet_runtime.service import ServiceContext, run
from fleet_runtime.settings import load_settings

_decoder = msgspec.json.Decoder(NodeMetrics)


async def main(ctx: ServiceContext) -> None:
    latest: dict[str, NodeMetrics] = {}

    async def on_metrics(msg: Msg) -> None:
        try:
            sample = _decoder.decode(msg.data)
        except msgspec.ValidationError:
            return
        latest[sample.node_id] = sample

    sub = await ctx.bus.nc.subscribe("fleet.metrics.*", cb=on_metrics)
    ctx.on_shutdown(sub.unsubscribe)

    async def get_metrics(_: web.Request) -> web.Response:
        # only nodes the event stream still lists: a node that left stops being reported
        live = [m for node_id, m in latest.items() if node_id in ctx.follower.state.nodes]
        return web.Response(text=render(live), content_type="text/plain", charset="utf-8")

    ctx.routes.append(web.get("/metrics", get_metrics))


def cli() -> None:
    # /metrics and /health share FLEET_METRICS_PORT, the port Prometheus scrapes.
    run(ServiceKind.METRICS, main, health_port=load_settings().metrics_port)
