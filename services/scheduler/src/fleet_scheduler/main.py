"""Scheduler service: the cluster's only decision maker, wired to the bus.

Every replica follows State and answers `fleet.route` and `fleet.placements`; the replica holding
the leader lease also consumes commands (placement), times out silent workers (failover), places
failed pipelines again, moves instances to engines their nodes measured faster and scales models
whose policy asks it to their demand (scaler.py). Decisions are
pure functions (placement.py, liveness.py, replacement.py, engine_choice.py, fleet_proto.routing);
every placement change they make, commanded or not, is published by one Placer (placer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TypeVar

import msgspec
import redis.asyncio as aioredis
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from fleet_bus import Delivery, consume_commands
from fleet_proto import (
    Command,
    CreateInstance,
    DeleteInstance,
    InstanceFailed,
    InstancePlaced,
    InstanceReady,
    NodeJoined,
    NodeMetrics,
    PlacementsReply,
    PlacementsRequest,
    RouteDecided,
    RouteReply,
    RouteRequest,
    ScalingPolicySet,
    ServiceKind,
    SetScaling,
    State,
)
from fleet_proto.engines import engine_facts
from fleet_proto.messages import AdmissionSample, RequestStats
from fleet_proto.routing import route, routed_work
from fleet_proto.routing_view import RoutingView, view_of
from fleet_proto.subjects import (
    ALL_ADMISSION_SUBJECT,
    ALL_METRICS_SUBJECT,
    PLACEMENTS_SUBJECT,
    REQUEST_STATS_SUBJECT,
    ROUTE_DECIDED_SUBJECT,
    ROUTE_SUBJECT,
)
from fleet_runtime.service import ServiceContext, run
from fleet_scheduler.demand import DemandFeed
from fleet_scheduler.engine_choice import faster_engine, moved_to_engine
from fleet_scheduler.leader import LeaderLease
from fleet_scheduler.liveness import failover_events, timed_out_nodes
from fleet_scheduler.placement import PlacementError, placed_again, placement_options
from fleet_scheduler.placer import Placer, created, deletion
from fleet_scheduler.replacement import failed_pipeline, replacement
from fleet_scheduler.routed_prefixes import RoutedPrefixes
from fleet_scheduler.scaler import Autoscaler
from fleet_store.kv_index import TIER2, KVIndex, tokens_by_holder

log = logging.getLogger("fleet_scheduler")
LIVENESS_CHECK_S = 1.0
KV_LOOKUP_TIMEOUT_S = 0.2  # per route request: Redis down costs a request no more
# (instance id, generation) of each failure the leader has answered (failed over, placed again or not):
# every rank of a pipeline may report the same one, and our own InstanceFailed events come back to us.
Answered = set[tuple[str, int]]
T = TypeVar("T")


class LoadTracker:
    """Per instance, the work a new request waits behind, in prompt tokens: its worker's last report
    (prompt tokens still to prefill, plus one per request in flight, so fewer streams win a tie) plus
    the prompt tokens new to it routed there since (fleet_proto.routing.routed_work). Not the context
    of the requests decoding: a conversation whose last turn is still streaming would weigh there as
    its whole history, and its next turn would be sent away from that history's KV."""

    def __init__(self) -> None:
        self.reported: dict[str, int] = {}
        self.routed_since_report: dict[str, int] = {}
        self.last_seen: dict[str, float] = {}  # node_id -> monotonic time of its last metrics
        # reported + routed_since_report per instance, kept as either changes: a decision reads it
        # as it is rather than summing 1,000 entries again
        self._load: dict[str, int] = {}
        self._load_view: Mapping[str, int] = MappingProxyType(self._load)

    def on_metrics(self, metrics: NodeMetrics) -> None:
        self.last_seen[metrics.node_id] = time.monotonic()
        for instance_id in metrics.active_requests:
            in_flight = metrics.active_requests[instance_id]
            self.reported[instance_id] = metrics.queued_tokens.get(instance_id, 0) + in_flight
            self.routed_since_report.pop(instance_id, None)
            self._load[instance_id] = self.reported[instance_id]

    def on_routed(self, instance_id: str, tokens: int) -> None:
        self.routed_since_report[instance_id] = self.routed_since_report.get(instance_id, 0) + tokens
        self._load[instance_id] = self._load.get(instance_id, 0) + tokens

    def load(self) -> Mapping[str, int]:
        """Per instance, reported + routed_since_report. A read-only view that follows the tracker,
        not a copy: read it within one decision (route() is synchronous), not across an await."""
        return self._load_view


class KVLookup:
    """The KV index reads of routing, bounded by `timeout_s`: the index is advisory, so a Redis that is
    down or slow costs a request at most that, and routing falls back to load alone. One warning
    when lookups start failing and one line when they work again, not one per request."""

    def __init__(self, index: KVIndex, block_size: int, timeout_s: float = KV_LOOKUP_TIMEOUT_S) -> None:
        self._index = index
        self._block_size = block_size
        self._timeout_s = timeout_s
        self.failing = False

    async def cached_prefixes(self, request: RouteRequest) -> tuple[dict[str, int], int, str]:
        """Per node, the request's leading prompt tokens in memory there; those in object storage;
        and why the index was not used ("" when it was, or when the request has no block hashes)."""
        if not request.block_hashes or not request.kv_fingerprint:
            return {}, 0, ""
        try:
            blocks = await asyncio.wait_for(
                self._index.prefix_blocks(request.kv_fingerprint, request.block_hashes), self._timeout_s
            )
        except Exception as exc:
            why = str(exc) or f"no answer within {self._timeout_s} s"
            if not self.failing:
                log.warning("KV index (Redis) lookups fail, routing by load only: %s", why)
            self.failing = True
            return {}, 0, f"KV index unavailable ({why}): routed by load only"
        if self.failing:
            log.info("KV index (Redis) answers again: KV-aware routing resumed")
            self.failing = False
        tokens = tokens_by_holder(blocks, self._block_size)
        return tokens, tokens.pop(TIER2, 0), ""


async def handle_command(ctx: ServiceContext, placer: Placer, command: Command) -> None:
    state = ctx.follower.state
    match command:
        case CreateInstance():
            instance = created(state, command)
            if instance is None:
                return  # a redelivered command already placed
            log.info(
                "placing %s (%s) on %s %s",
                instance.instance_id,
                instance.model_id,
                instance.node_id,
                instance.reason,
            )
            await placer.place(instance)
        case DeleteInstance():
            if (event := deletion(state, command)) is not None:
                await placer.publish(event)
        case SetScaling():
            if command.model_id not in state.models:
                log.warning("scaling policy for %s ignored: the model is not staged", command.model_id)
            elif problems := command.policy.problems():
                log.warning("scaling policy for %s ignored: %s", command.model_id, "; ".join(problems))
            else:
                log.info("scaling policy for %s: %s", command.model_id, command.policy)
                await placer.publish(ScalingPolicySet(model_id=command.model_id, policy=command.policy))


async def watch_liveness(
    ctx: ServiceContext, placer: Placer, tracker: LoadTracker, answered: Answered
) -> None:
    """Leader only: fail over nodes whose metrics stopped (a node starts its clock when first seen)."""
    timeout_s = ctx.settings.node_timeout_s
    # A new leader gives every node a full timeout: what it heard before it led says nothing, e.g. it
    # stepped down because NATS was down (no metrics came from anyone) and leads again now.
    for node_id in ctx.follower.state.nodes:
        tracker.last_seen[node_id] = time.monotonic()
    while True:
        await asyncio.sleep(LIVENESS_CHECK_S)
        state = ctx.follower.state
        for node_id in state.nodes:
            tracker.last_seen.setdefault(node_id, time.monotonic())
        for node_id in timed_out_nodes(state, tracker.last_seen, time.monotonic(), timeout_s):
            reason = f"missed heartbeats for {timeout_s:.0f} s"
            log.warning("node %s timed out: failing over its instances", node_id)

            events = failover_events(state, node_id, reason, placed_again)
            # answered before they are published: the pipeline reactor must not place these again
            answered.update((e.instance_id, e.generation) for e in events if isinstance(e, InstanceFailed))
            await placer.publish(*events)
            tracker.last_seen.pop(node_id, None)
            with contextlib.suppress(TimeoutError):  # our own NodeLeft, applied before the next check
                await ctx.follower.wait_for(_node_gone(node_id), 10.0)


def _node_gone(node_id: str) -> Callable[[State], bool]:
    return lambda state: node_id not in state.nodes


async def replace_failed_pipelines(ctx: ServiceContext, placer: Placer, answered: Answered) -> None:
    """Leader only: a pipeline instance a rank's failure left failed is placed again (replacement.py)."""
    replaced_at: dict[str, list[float]] = {}  # instance id -> monotonic times it was placed again
    async with ctx.follower.listen() as live:
        async for _, event in live:
            if not isinstance(event, InstanceFailed):
                continue
            state = ctx.follower.state
            instance = failed_pipeline(state, event)
            if instance is None or (instance.instance_id, instance.generation) in answered:
                continue
            answered.add((instance.instance_id, instance.generation))
            now = time.monotonic()
            times = replaced_at.setdefault(instance.instance_id, [])
            answer = replacement(state, instance, placed_again, times, now)
            if isinstance(answer, InstancePlaced):
                times.append(now)
                where = ", ".join(s.ring_address for s in answer.instance.shards)
                log.warning(
                    "pipeline %s failed (%s): placing it again as generation %d on %s",
                    instance.instance_id,
                    instance.reason,
                    answer.instance.generation,
                    where,
                )
            else:
                log.error("pipeline %s stays failed: %s", instance.instance_id, answer.reason)
            await placer.publish(answer)


async def move_to_faster_engines(ctx: ServiceContext, placer: Placer) -> None:
    """Leader only: an instance whose node measured another engine faster for its model is placed
    again on that engine (engine_choice.py), when a node reports calibrations or an instance is ready."""
    moved: set[tuple[str, int]] = set()  # (instance, generation) already placed again
    async with ctx.follower.listen() as live:
        async for _, event in live:
            if not isinstance(event, NodeJoined | InstanceReady):
                continue
            state = ctx.follower.state
            for instance in list(state.instances.values()):
                engine = faster_engine(state, instance)
                if not engine or (instance.instance_id, instance.generation) in moved:
                    continue
                moved.add((instance.instance_id, instance.generation))
                try:
                    placed = moved_to_engine(state, instance, engine)
                except PlacementError as exc:
                    log.info(
                        "%s stays on %s: %s does not fit: %s",
                        instance.instance_id,
                        instance.engine,
                        engine,
                        exc,
                    )
                    continue
                log.warning(
                    "%s: %s measured faster than %s for %s on %s: placing it again on %s",
                    instance.instance_id,
                    engine,
                    instance.engine,
                    instance.model_id,
                    instance.node_id,
                    engine,
                )
                await placer.place(placed)


async def main(ctx: ServiceContext) -> None:
    client = aioredis.from_url(ctx.settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
    await client.ping()  # fail at start, with the URL in the error, rather than later

    async def check_redis() -> None:
        await client.ping()

    ctx.health_checks["redis"] = check_redis
    ctx.on_shutdown(client.aclose)

    tracker = LoadTracker()
    feed = DemandFeed()  # the autoscaler's (leader only); the workers' metrics reach it from here
    metrics_decoder = msgspec.json.Decoder(NodeMetrics)

    async def on_metrics(msg: Msg) -> None:
        with contextlib.suppress(msgspec.ValidationError):
            metrics = metrics_decoder.decode(msg.data)
            tracker.on_metrics(metrics)
            feed.on_metrics(metrics, time.time())

    metrics_sub = await ctx.bus.nc.subscribe(ALL_METRICS_SUBJECT, cb=on_metrics)
    ctx.on_shutdown(metrics_sub.unsubscribe)

    lookup = KVLookup(KVIndex(client), ctx.settings.kv_block_size)
    sent = RoutedPrefixes()  # for engines that index no KV
    turns = itertools.count()  # the round-robin policy's
    # route()'s index of the State, made again when the follower's State is a new object (per event)
    view: RoutingView | None = None

    async def on_route(request: RouteRequest) -> RouteReply:
        nonlocal view
        with ctx.tracing.span("kv lookup (Redis)", "kv", {"fleet.blocks": len(request.block_hashes)}) as span:
            cached, tier2, unindexed = await lookup.cached_prefixes(request)
            span.set_attributes(
                {
                    "fleet.tier1_nodes": len(cached),  # nodes holding a prefix in memory
                    "fleet.tier1_tokens": max(cached.values(), default=0),
                    "fleet.tier2_tokens": tier2,  # in object storage
                }
            )
        remembered = sent.held(request)
        state = ctx.follower.state  # the decision's State, and the view indexing it
        view = view_of(state, view)
        with ctx.tracing.span("route decision", "route") as span:
            reply = route(
                state,
                request,
                tracker.load(),
                cached,
                tier2,
                ctx.settings.disagg_min_tokens,
                ctx.settings.disagg_link_bytes_per_s,
                remembered,
                ctx.settings.routing_policy,
                next(turns),
                view,
            )
            span.set_attribute("fleet.reason", reply.reason or reply.error)
        chosen = state.instances.get(reply.instance_id)
        if chosen is not None and engine_facts(chosen.engine).kv_local:
            sent.remember(request, chosen.instance_id)
        if unindexed and reply.instance_id:  # say so: "0 tokens cached" alone reads like a cold cache
            reply = msgspec.structs.replace(reply, reason=f"{reply.reason}; {unindexed}")
        for instance_id, tokens in routed_work(reply, request).items():
            tracker.on_routed(instance_id, tokens)
        decided = RouteDecided(
            request_id=request.request_id,
            model_id=request.model_id,
            at=time.time(),
            reply=reply,
            decided_by=ctx.service_id,
        )
        await ctx.bus.publish(ROUTE_DECIDED_SUBJECT, decided)
        return reply

    async def on_placements(request: PlacementsRequest) -> PlacementsReply:
        try:
            return PlacementsReply(options=tuple(placement_options(ctx.follower.state, request.model_id)))
        except PlacementError as exc:
            return PlacementsReply(error=str(exc))

    # queue groups: scheduler replicas share the request load
    route_sub = await ctx.bus.serve(ROUTE_SUBJECT, RouteRequest, on_route, queue="scheduler")
    ctx.on_shutdown(route_sub.unsubscribe)
    placements_sub = await ctx.bus.serve(
        PLACEMENTS_SUBJECT, PlacementsRequest, on_placements, queue="scheduler"
    )
    ctx.on_shutdown(placements_sub.unsubscribe)

    placer = Placer(ctx.bus.publish_event, ctx.service_id)  # every placement change leaves through it

    async def on_command(command: Command, _: Delivery) -> None:
        await handle_command(ctx, placer, command)

    async def commands() -> None:
        await consume_commands(ctx.bus, "scheduler", (CreateInstance, DeleteInstance, SetScaling), on_command)

    answered: Answered = set()

    async def liveness() -> None:
        await watch_liveness(ctx, placer, tracker, answered)

    async def pipelines() -> None:
        await replace_failed_pipelines(ctx, placer, answered)

    async def engines() -> None:
        await move_to_faster_engines(ctx, placer)

    async def autoscale() -> None:
        subscriptions = [  # what only the autoscaler reads, while this replica leads
            await _fed(ctx, ALL_ADMISSION_SUBJECT, AdmissionSample, feed.on_admission),
            await _fed(ctx, ROUTE_DECIDED_SUBJECT, RouteDecided, feed.on_route),
            await _fed(ctx, REQUEST_STATS_SUBJECT, RequestStats, feed.on_stats),
        ]
        try:
            await Autoscaler(lambda: ctx.follower.state, feed, placer).run(ctx.follower.wait_for)
        finally:
            for subscription in subscriptions:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()

    # Only the leader consumes commands, times out workers and re-places pipelines; a crashed duty ends
    # the leadership (and the service), so a healthy replica takes over. Routing stays on every replica.
    lease = LeaderLease(ctx.bus, ctx.service_id)
    jobs = {
        "commands": commands,
        "liveness": liveness,
        "pipelines": pipelines,
        "engines": engines,
        "autoscale": autoscale,
    }
    ctx.spawn(lease.lead(jobs), "leader")
    ctx.on_shutdown(lease.release)  # a follower takes over at once rather than after the lease expires


async def _fed(
    ctx: ServiceContext, subject: str, kind: type[T], on: Callable[[T, float], None]
) -> Subscription:
    """A core NATS subscription handing each decodable message to `on` with the time it came."""
    decoder = msgspec.json.Decoder(kind)

    async def handle(msg: Msg) -> None:
        with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
            on(decoder.decode(msg.data), time.time())

    return await ctx.bus.nc.subscribe(subject, cb=handle)


def cli() -> None:
    run(ServiceKind.SCHEDULER, main)
