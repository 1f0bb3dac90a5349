"""The autoscaler's wiring, without servers: DemandFeed folds what the bus carries into each model's
demand (stale reports dropped, TTFT p90 without cold starts), and Autoscaler turns autoscale()'s
decisions into the events a Placer publishes (here into a list: FakeBus stands in for NATS),
recorded with their reasons, holds rate-limited, windows seeded from the State on a new leader."""

from __future__ import annotations

import msgspec
import pytest

from fleet_proto import (
    Event,
    InstanceDeleted,
    InstanceFailed,
    InstancePlaced,
    InstanceStatus,
    InstanceStatusChanged,
    ModelStaged,
    NodeMetrics,
    RequestStats,
    RouteDecided,
    RouteReply,
    ScalingDecided,
    ScalingDecision,
    ScalingPolicy,
    ScalingPolicySet,
    State,
    apply,
)
from fleet_proto.messages import AdmissionSample
from fleet_proto.testing import then
from fleet_scheduler.autoscale import ScalingHistory
from fleet_scheduler.demand import DemandFeed, percentile
from fleet_scheduler.placer import Placer
from fleet_scheduler.scaler import HOLD_EVERY_S, Autoscaler, seeded_history

from .test_autoscale import CARD, MODEL, ONE_BUSY, joined, ready, state_of

pytestmark = pytest.mark.unit

FAST = ScalingPolicy(
    enabled=True, min_instances=0, max_instances=2, scale_up_window_s=0, scale_up_cooldown_s=0, idle_s=30
)


def metrics(node_id: str, **in_flight: int) -> NodeMetrics:
    return NodeMetrics(
        node_id=node_id, at=0.0, memory_used_bytes=0, memory_available_bytes=0, cpu_percent=0,
        disk_free_bytes=0, active_requests=in_flight, request_slots=dict.fromkeys(in_flight, 4),
        queued_tokens={i: 100 * n for i, n in in_flight.items()},
    )  # fmt: skip


def stats(ttft_s: float, cold_start_s: float = 0.0, finish: str = "stop") -> RequestStats:
    return RequestStats(
        request_id="r", model_id=MODEL, instance_id="i1", node_id="a", prompt_tokens=1,
        completion_tokens=1, ttft_s=ttft_s, tpot_s=0, total_s=ttft_s, finish_reason=finish,
        cold_start_s=cold_start_s,
    )  # fmt: skip


def test_the_feed_sums_fresh_reports_per_model_and_drops_stale_ones():
    feed = DemandFeed()
    feed.on_metrics(metrics("a", i1=3, gone=5), now=100.0)
    feed.on_metrics(metrics("b", i2=1), now=90.0)  # silent since: its worker died
    feed.on_admission(AdmissionSample(gateway_id="g1", at=0, waiting={MODEL: 2}), now=100.0)
    feed.on_admission(AdmissionSample(gateway_id="g2", at=0, waiting={MODEL: 1}), now=101.0)
    asked = feed.demand(102.0, {"i1": MODEL, "i2": MODEL})[MODEL]
    assert set(asked.instances) == {"i1"}  # "gone" is no instance of State's; i2's report is stale
    assert (asked.instances["i1"].in_flight, asked.instances["i1"].queued_tokens) == (3, 300)
    assert asked.waiting_requests == 3 and asked.last_demand_at == 102.0


def test_a_route_to_a_model_at_zero_is_demand_for_it():
    feed = DemandFeed()
    reply = RouteReply(error=f"no ready instance of {MODEL}")
    feed.on_route(RouteDecided(request_id="r", model_id=MODEL, at=0, reply=reply), now=50.0)
    asked = feed.demand(51.0, {})[MODEL]
    assert asked.instances == {} and asked.last_demand_at == 50.0


def test_ttft_p90_leaves_out_cold_starts_errors_and_old_requests():
    feed = DemandFeed()
    feed.on_stats(stats(9.0), now=0.0)  # older than the window at 100
    for ttft in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        feed.on_stats(stats(ttft), now=90.0)
    feed.on_stats(stats(30.5, cold_start_s=30.0), now=95.0)  # 0.5 s once its instance was up
    feed.on_stats(stats(50.0, finish="error"), now=95.0)
    assert feed.demand(100.0, {})[MODEL].ttft_p90_s == 0.9
    assert percentile([], 0.9) == -1.0 and percentile([3.0], 0.9) == 3.0


class FakeBus:
    """Collects what the Placer publishes and folds it into a State, as the follower would."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.published: list[Event] = []

    async def publish(self, event: Event) -> None:
        self.published.append(event)
        self.state = apply(self.state, event, self.state.last_seq + 1)


def with_policy(state: State, policy: ScalingPolicy = FAST) -> State:
    return apply(state, ScalingPolicySet(model_id=MODEL, policy=policy), state.last_seq + 1)


async def test_a_scale_up_is_placed_and_recorded_with_its_reason():
    bus = FakeBus(with_policy(ONE_BUSY))
    feed = DemandFeed()
    feed.on_metrics(metrics("a", i1=4), now=100.0)
    feed.on_admission(AdmissionSample(gateway_id="g", at=0, waiting={MODEL: 4}), now=100.0)
    scaler = Autoscaler(lambda: bus.state, feed, Placer(bus.publish, "sched-1", lambda: 100.0), lambda: 100.0)
    await scaler.tick()
    placed, decided = bus.published
    assert isinstance(placed, InstancePlaced) and placed.instance.node_id == "b"
    assert isinstance(decided, ScalingDecided) and decided.decision.kind == "scale_up"
    assert decided.decision.instance_id == placed.instance.instance_id and decided.origin == "sched-1"
    assert "1 -> 2 instances" in decided.decision.reason
    assert bus.state.scaling[MODEL].decisions[-1] == decided.decision


async def test_idle_past_idle_s_drains_the_last_instance():
    clock = [1000.0]
    bus = FakeBus(with_policy(ONE_BUSY))
    feed = DemandFeed()
    feed.on_metrics(metrics("a", i1=0), now=clock[0])
    scaler = Autoscaler(lambda: bus.state, feed, Placer(bus.publish, "s", lambda: clock[0]), lambda: clock[0])
    await scaler.tick()  # no demand seen since this leader started: idle_s counts from its start
    assert bus.published == []
    clock[0] += 31
    feed.on_metrics(metrics("a", i1=0), now=clock[0])
    await scaler.tick()
    drained, decided = bus.published
    assert drained == InstanceStatusChanged(
        instance_id="i1", status=InstanceStatus.DRAINING, origin="s", at=clock[0]
    )
    assert isinstance(decided, ScalingDecided) and decided.decision.kind == "scale_down"
    assert "no demand for 30 s" in decided.decision.reason


async def test_a_hold_is_recorded_once_then_at_most_every_hold_every_s():
    clock = [100.0]
    saturated = msgspec.structs.replace(FAST, min_instances=1, max_instances=1)
    bus = FakeBus(with_policy(ONE_BUSY, saturated))
    feed = DemandFeed()
    scaler = Autoscaler(lambda: bus.state, feed, Placer(bus.publish, "s", lambda: clock[0]), lambda: clock[0])
    for _ in range(3):
        feed.on_metrics(metrics("a", i1=4), now=clock[0])
        feed.on_admission(AdmissionSample(gateway_id="g", at=0, waiting={MODEL: 5}), now=clock[0])
        await scaler.tick()
        clock[0] += 1
    holds = [e for e in bus.published if isinstance(e, ScalingDecided)]
    assert len(holds) == 1 and "at max_instances" in holds[0].decision.reason
    clock[0] += HOLD_EVERY_S
    feed.on_metrics(metrics("a", i1=4), now=clock[0])
    feed.on_admission(AdmissionSample(gateway_id="g", at=0, waiting={MODEL: 5}), now=clock[0])
    await scaler.tick()
    assert len([e for e in bus.published if isinstance(e, ScalingDecided)]) == 2


def test_a_new_leader_starts_from_the_last_changes_the_state_recorded():
    state = with_policy(state_of(joined("a"), ModelStaged(card=CARD), *ready("i1", "a")))
    for kind, at in (("scale_up", 10.0), ("hold", 20.0), ("scale_down", 30.0), ("scale_up", 40.0)):
        decision = ScalingDecision(kind=kind, reason="r", at=at)
        state = apply(state, ScalingDecided(model_id=MODEL, decision=decision), state.last_seq + 1)
    assert seeded_history(state) == {MODEL: ScalingHistory(last_up_at=40.0, last_down_at=30.0)}


async def test_a_failed_instance_is_tried_again_after_the_cooldown_and_deleted_then():
    clock = [100.0]
    policy = msgspec.structs.replace(FAST, min_instances=1, scale_up_cooldown_s=30)
    failed = InstanceFailed(instance_id="i1", reason="weights corrupt")
    bus = FakeBus(with_policy(then(ONE_BUSY, failed), policy))
    scaler = Autoscaler(
        lambda: bus.state, DemandFeed(), Placer(bus.publish, "s", lambda: clock[0]), lambda: clock[0]
    )
    await scaler.tick()  # below min_instances: at once
    deleted, placed, decided = bus.published
    assert deleted == InstanceDeleted(instance_id="i1", origin="s", at=100.0)
    assert (
        isinstance(placed, InstancePlaced)
        and "replaces i1 (failed: weights corrupt)" in decided.decision.reason
    )
    auto = placed.instance.instance_id
    bus.published.clear()
    bus.state = then(bus.state, InstanceFailed(instance_id=auto, reason="out of memory"))
    clock[0] += 10
    await scaler.tick()  # within the cooldown: holds (and says why)
    [held] = bus.published
    assert isinstance(held, ScalingDecided) and "added one 10 s ago, cooldown 30 s" in held.decision.reason
    clock[0] += 25
    await scaler.tick()
    assert [type(e) for e in bus.published[1:]] == [InstanceDeleted, InstancePlaced, ScalingDecided]
    assert [i for i in bus.state.instances.values() if i.status == InstanceStatus.FAILED] == []
