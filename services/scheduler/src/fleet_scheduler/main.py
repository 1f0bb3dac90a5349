"""Scheduler service: places instances (CreateInstance/DeleteInstance commands) and routes requests.

It is the only service that decides; decisions are pure functions (placement.py, routing.py) and this
module only wires them to the bus.
"""

from __future__ import annotations

import logging
import time

import msgspec
import redis.asyncio as aioredis
from nats.aio.msg import Msg

from fleet_bus import Delivery, consume_commands
from fleet_proto import (
    Command,
    CreateInstance,
    DeleteInstance,
    Instance,
    InstanceDeleted,
    InstancePlaced,
    InstanceStatus,
    NodeMetrics,
    RouteRequest,
    ServiceKind,
)
from fleet_proto.routing import route
from fleet_proto.subjects import ROUTE_SUBJECT
from fleet_runtime.service import ServiceContext, run
from fleet_scheduler.placement import PlacementError, place

log = logging.getLogger("fleet_scheduler")


class LoadTracker:
    """Active requests per instance: the workers' last report plus what was routed since."""

    def __init__(self) -> None:
        self.reported: dict[str, int] = {}
        self.routed_since_report: dict[str, int] = {}

    def on_metrics(self, metrics: NodeMetrics) -> None:
        for instance_id, active in metrics.active_requests.items():
            self.reported[instance_id] = active
            self.routed_since_report.pop(instance_id, None)

    def on_routed(self, instance_id: str) -> None:
        self.routed_since_report[instance_id] = self.routed_since_report.get(instance_id, 0) + 1

    def load(self) -> dict[str, int]:
        keys = self.reported.keys() | self.routed_since_report.keys()
        return {k: self.reported.get(k, 0) + self.routed_since_report.get(k, 0) for k in keys}


async def handle_command(ctx: ServiceContext, command: Command, _: Delivery) -> None:
    state = ctx.follower.state
    match command:
        case CreateInstance():
            if command.instance_id in state.instances:
                return  # a redelivered command already placed
            try:
                instance = place(state, command.model_id, command.instance_id, command.engine or "mlx")
            except PlacementError as exc:
                instance = Instance(
                    instance_id=command.instance_id,
                    model_id=command.model_id,
                    node_id="",
                    engine=command.engine or "mlx",
                    status=InstanceStatus.FAILED,
                    reason=str(exc),
                )
            log.info(
                "placing %s: %s on %s %s",
                instance.instance_id,
                instance.model_id,
                instance.node_id,
                instance.reason,
            )
            await ctx.bus.publish_event(
                InstancePlaced(instance=instance, origin=ctx.service_id, at=time.time())
            )
        case DeleteInstance():
            if command.instance_id in state.instances:
                await ctx.bus.publish_event(
                    InstanceDeleted(instance_id=command.instance_id, origin=ctx.service_id, at=time.time())
                )


async def main(ctx: ServiceContext) -> None:
    client = aioredis.from_url(ctx.settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
    await client.ping()  # fail at start, with the URL in the error, rather than later

    async def check_redis() -> None:
        await client.ping()

    ctx.health_checks["redis"] = check_redis
    ctx.on_shutdown(client.aclose)

    tracker = LoadTracker()
    metrics_decoder = msgspec.json.Decoder(NodeMetrics)

    async def on_metrics(msg: Msg) -> None:
        try:
            tracker.on_metrics(metrics_decoder.decode(msg.data))
        except msgspec.ValidationError:
            return

    metrics_sub = await ctx.bus.nc.subscribe("fleet.metrics.*", cb=on_metrics)
    ctx.on_shutdown(metrics_sub.unsubscribe)

    async def on_route(request: RouteRequest):
        reply = route(ctx.follower.state, request, tracker.load())
        if reply.instance_id:
            tracker.on_routed(reply.instance_id)
        log.debug(
            "route %s -> %s (%s)", request.request_id, reply.instance_id or "-", reply.reason or reply.error
        )
        return reply

    # a queue group: scheduler replicas share the routing load
    route_sub = await ctx.bus.serve(ROUTE_SUBJECT, RouteRequest, on_route, queue="scheduler")
    ctx.on_shutdown(route_sub.unsubscribe)

    async def on_command(command: Command, delivery: Delivery) -> None:
        await handle_command(ctx, command, delivery)

    ctx.spawn(
        consume_commands(ctx.bus, "scheduler", (CreateInstance, DeleteInstance), on_command), "commands"
    )


def cli() -> None:
    run(ServiceKind.SCHEDULER, main)
