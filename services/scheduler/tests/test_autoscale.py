"""Instances follow demand (autoscale.py): added on an idle worker as load rises, drained after it
stops, within min/max, down to zero after idle and back on a request, without flapping."""

from __future__ import annotations

import msgspec
import pytest

from fleet_proto import (
    EngineInfo,
    Instance,
    InstanceDeleted,
    InstancePlaced,
    InstanceReady,
    ModelCard,
    ModelStaged,
    NodeInfo,
    NodeJoined,
    State,
    replay,
)
from fleet_proto.events import Event
from fleet_proto.scaling import ScalingPolicy
from fleet_scheduler.autoscale import (
    Hold,
    InstanceDemand,
    ModelDemand,
    ScaleDown,
    ScaleUp,
    Scaling,
    ScalingHistory,
    autoscale,
)

pytestmark = pytest.mark.unit

GiB = 2**30
MODEL = "org/small"
CARD = ModelCard(
    model_id=MODEL,
    architecture="llama",
    num_layers=4,
    hidden_size=256,
    num_kv_heads=2,
    head_dim=64,
    dtype="bfloat16",
    storage_bytes=GiB,
)
POLICY = ScalingPolicy(
    enabled=True,
    min_instances=1,
    max_instances=2,
    scale_up_window_s=10.0,
    scale_up_cooldown_s=60.0,
    scale_down_delay_s=300.0,
    idle_s=900.0,
)


def joined(node_id: str, free_gib: float = 16.0) -> NodeJoined:
    return NodeJoined(
        node=NodeInfo(
            node_id=node_id, hostname=node_id, system="Linux", machine="x86_64", cpu_count=8,
            memory_total_bytes=64 * GiB, memory_available_bytes=int(free_gib * GiB),
            disk_total_bytes=1, disk_free_bytes=1, engines=(EngineInfo(name="mlx", version="1"),),
        )
    )  # fmt: skip


def ready(instance_id: str, node_id: str) -> list[Event]:
    instance = Instance(instance_id=instance_id, model_id=MODEL, node_id=node_id, engine="mlx")
    return [InstancePlaced(instance=instance), InstanceReady(instance_id=instance_id)]


def state_of(*events: Event) -> State:
    return replay(enumerate(events, start=1))


def then(state: State, *events: Event) -> State:
    return replay(enumerate(events, start=state.last_seq + 1), state)


def demand(waiting: int = 0, last_demand_at: float | None = 0.0, **in_flight: int) -> ModelDemand:
    """Requests in flight per instance (4 slots each, no prompt backlog)."""
    per_instance = {i: InstanceDemand(in_flight=n, request_slots=4) for i, n in in_flight.items()}
    return ModelDemand(instances=per_instance, waiting_requests=waiting, last_demand_at=last_demand_at)


def step(
    state: State,
    asked: ModelDemand,
    now: float,
    history: ScalingHistory | None = None,
    policy: ScalingPolicy = POLICY,
) -> Scaling:
    return autoscale(state, {MODEL: policy}, {MODEL: asked}, {MODEL: history or ScalingHistory()}, now)


# One ready instance on worker a; worker b joined and runs nothing.
ONE_BUSY = state_of(joined("a"), joined("b"), ModelStaged(card=CARD), *ready("i1", "a"))
SATURATED = demand(waiting=3, i1=4)  # 7 requests for 4 slots at 0.8: wants 3, capped at 2


def test_rising_load_on_one_instance_adds_one_on_the_idle_joined_worker_after_the_window():
    first = step(ONE_BUSY, SATURATED, now=100.0)
    assert [type(d) for d in first.decisions] == [Hold]
    assert "above target for 0 s of the 10 s window" in first.decisions[0].reason
    still = step(ONE_BUSY, SATURATED, now=109.0, history=first.history[MODEL])
    assert [type(d) for d in still.decisions] == [Hold]
    added = step(ONE_BUSY, SATURATED, now=110.0, history=still.history[MODEL])
    (up,) = added.decisions
    assert isinstance(up, ScaleUp)
    assert (up.instance.model_id, up.instance.node_id, up.instance.engine) == (MODEL, "b", "mlx")
    assert up.instance.instance_id == f"auto-{110_000:x}-0"
    assert up.reason == (
        "1 -> 2 instances: 7 in flight or waiting (target 3.2 per instance), capped by max_instances 2; "
        "7 requests (3 waiting), 0 prompt tokens queued on 1 instance of 4 slots"
    )
    assert added.history[MODEL] == ScalingHistory(last_up_at=110.0)


def test_a_spike_shorter_than_the_window_adds_nothing():
    history = step(ONE_BUSY, SATURATED, now=100.0).history[MODEL]
    calm = step(ONE_BUSY, demand(i1=2), now=105.0, history=history)
    assert calm.decisions == () and calm.history[MODEL].above_since is None
    again = step(ONE_BUSY, SATURATED, now=111.0, history=calm.history[MODEL])
    assert [type(d) for d in again.decisions] == [Hold]  # the window starts over


def test_a_second_instance_never_shares_a_node_with_the_first():
    alone = state_of(joined("a"), ModelStaged(card=CARD), *ready("i1", "a"))
    history = ScalingHistory(above_since=0.0)
    (held,) = step(alone, SATURATED, now=100.0, history=history).decisions
    assert isinstance(held, Hold)
    assert "wants 2, has 1: every node runs an instance of it already" in held.reason


TWO = then(ONE_BUSY, *ready("i2", "b"))


def test_load_that_stops_drains_the_least_loaded_instance_after_the_delay():
    light = demand(i1=1, i2=0)  # fits one instance at half its target (1.6)
    first = step(TWO, light, now=1000.0, history=ScalingHistory(last_down_at=0.0))
    (held,) = first.decisions
    assert isinstance(held, Hold) and "fits 1 for 0 s of the 300 s delay" in held.reason
    waited = step(TWO, light, now=1299.0, history=first.history[MODEL])
    assert [type(d) for d in waited.decisions] == [Hold]
    (down,) = step(TWO, light, now=1300.0, history=waited.history[MODEL]).decisions
    assert isinstance(down, ScaleDown) and down.instance_id == "i2"
    assert down.reason.startswith("2 -> 1 instances, i2 drains (least loaded: 0 in flight, 0 tokens queued)")


def test_load_between_the_up_and_down_thresholds_changes_nothing():
    # 3 requests: within two instances' target (6.4), above one instance's down threshold (1.6)
    scaling = step(TWO, demand(i1=2, i2=1), now=1000.0, history=ScalingHistory(below_since=0.0))
    assert scaling.decisions == ()
    assert scaling.history[MODEL] == ScalingHistory()  # the down delay starts over


def test_no_flapping_when_load_swings_faster_than_the_windows():
    history, changes = ScalingHistory(), []
    for second in range(600):
        swing = SATURATED if (second // 5) % 2 else demand(i1=0)
        scaling = step(ONE_BUSY, swing, now=float(second), history=history)
        history = scaling.history[MODEL]
        changes += [d for d in scaling.decisions if not isinstance(d, Hold)]
    assert changes == []


def test_after_a_change_the_cooldown_holds_and_a_starting_instance_counts_first():
    (up,) = step(ONE_BUSY, SATURATED, now=110.0, history=ScalingHistory(above_since=0.0)).decisions
    assert isinstance(up, ScaleUp)
    three = msgspec.structs.replace(POLICY, max_instances=3)
    loading = then(ONE_BUSY, InstancePlaced(instance=up.instance))
    history = ScalingHistory(last_up_at=110.0, above_since=0.0)
    (held,) = step(loading, SATURATED, now=200.0, history=history, policy=three).decisions
    assert isinstance(held, Hold) and f"{up.instance.instance_id} is placed: its capacity" in held.reason
    serving = then(loading, InstanceReady(instance_id=up.instance.instance_id), joined("c"))
    busy = demand(waiting=6, i1=4, **{up.instance.instance_id: 4})
    (held,) = step(serving, busy, now=150.0, history=history, policy=three).decisions
    assert isinstance(held, Hold) and "changed 40 s ago, cooldown 60 s" in held.reason
    (later,) = step(serving, busy, now=170.0, history=history, policy=three).decisions
    assert isinstance(later, ScaleUp) and later.instance.node_id == "c"


def test_never_below_min_instances():
    quiet = demand(last_demand_at=None, i1=0)
    scaling = step(ONE_BUSY, quiet, now=10_000.0)  # idle for ever, min 1
    assert scaling.decisions == ()
    two_min = msgspec.structs.replace(POLICY, min_instances=2)
    (up,) = step(ONE_BUSY, quiet, now=0.0, policy=two_min).decisions  # no window to prove load
    assert isinstance(up, ScaleUp) and up.instance.node_id == "b"
    assert up.reason.startswith("1 -> 2 instances: min_instances 2;")


def test_never_above_max_instances():
    crowd = demand(waiting=40, i1=4, i2=4)
    history = ScalingHistory(above_since=0.0)
    (held,) = step(then(TWO, joined("c")), crowd, now=1000.0, history=history).decisions
    assert isinstance(held, Hold)
    assert held.reason.startswith("wants 15, has 2: at max_instances; 48 in flight or waiting")
    one_max = msgspec.structs.replace(POLICY, max_instances=1)
    (down,) = step(TWO, crowd, now=1000.0, history=ScalingHistory(last_up_at=999.0), policy=one_max).decisions
    assert isinstance(down, ScaleDown)  # over the maximum: at once, busy or not


ZERO_POLICY = msgspec.structs.replace(POLICY, min_instances=0, idle_s=60.0, scale_down_delay_s=30.0)


def test_scale_to_zero_after_idle_then_back_up_on_a_waiting_request():
    quiet = demand(last_demand_at=100.0, i1=0)
    history = ScalingHistory(last_down_at=0.0)
    assert step(ONE_BUSY, quiet, now=159.0, history=history, policy=ZERO_POLICY).decisions == ()
    gone = step(ONE_BUSY, quiet, now=160.0, history=history, policy=ZERO_POLICY)
    (down,) = gone.decisions
    assert isinstance(down, ScaleDown) and down.instance_id == "i1"
    assert down.reason.startswith(
        "1 -> 0 instances, i1 drains (least loaded: 0 in flight, 0 tokens queued): "
    )
    assert "no demand for 60 s" in down.reason
    zero = then(ONE_BUSY, InstanceDeleted(instance_id="i1"))
    assert step(zero, demand(last_demand_at=100.0), now=170.0, policy=ZERO_POLICY).decisions == ()
    # a request waits at a gateway: placed at once, cooldown or not (the client waits for it)
    waiting = demand(waiting=1, last_demand_at=175.0)
    (up,) = step(zero, waiting, now=175.0, history=gone.history[MODEL], policy=ZERO_POLICY).decisions
    assert isinstance(up, ScaleUp) and up.instance.node_id in ("a", "b")
    assert up.reason.startswith("0 -> 1 instances: 1 in flight or waiting (no slots reported yet)")


def test_a_request_for_a_model_at_zero_is_demand_even_before_a_gateway_reports_it_waiting():
    zero = state_of(joined("a"), ModelStaged(card=CARD))
    (up,) = step(zero, ModelDemand(last_demand_at=50.0), now=51.0, policy=ZERO_POLICY).decisions
    assert isinstance(up, ScaleUp)
    assert up.reason.startswith("0 -> 1 instances: demand 1 s ago (idle after 60 s)")
    tight = state_of(joined("a", free_gib=0.5), ModelStaged(card=CARD))
    (held,) = step(tight, ModelDemand(waiting_requests=1), now=51.0, policy=ZERO_POLICY).decisions
    assert isinstance(held, Hold)
    assert "wants 1, has 0: no node without an instance of it fits: no node fits org/small" in held.reason


def test_a_placement_not_yet_in_state_is_not_made_twice():
    zero = state_of(joined("a"), joined("b"), ModelStaged(card=CARD))
    first = step(zero, ModelDemand(waiting_requests=2), now=10.0, policy=ZERO_POLICY)
    assert [type(d) for d in first.decisions] == [ScaleUp]
    # the next call comes before the follower applied the InstancePlaced: the same State
    (held,) = step(zero, ModelDemand(waiting_requests=2), 11.0, first.history[MODEL], ZERO_POLICY).decisions
    assert isinstance(held, Hold) and "wants 1, has 0: added one 1 s ago, cooldown 60 s" in held.reason


def test_queued_prompt_tokens_and_ttft_ask_for_more_too():
    policy = msgspec.structs.replace(POLICY, target_queued_tokens=1000, target_ttft_p90_s=2.0)
    backlog = ModelDemand(instances={"i1": InstanceDemand(in_flight=1, request_slots=4, queued_tokens=1500)})
    (up,) = step(
        ONE_BUSY, backlog, now=100.0, history=ScalingHistory(above_since=0.0), policy=policy
    ).decisions
    assert isinstance(up, ScaleUp) and "1500 prompt tokens queued (target 1000 each)" in up.reason
    slow = msgspec.structs.replace(demand(i1=1), ttft_p90_s=3.5)
    (up,) = step(ONE_BUSY, slow, now=100.0, history=ScalingHistory(above_since=0.0), policy=policy).decisions
    assert isinstance(up, ScaleUp) and "TTFT p90 over its 2 s target" in up.reason
    assert "TTFT p90 3.50 s" in up.reason


def test_the_default_policy_changes_nothing_and_decisions_are_plain_data():
    assert autoscale(ONE_BUSY, {MODEL: ScalingPolicy()}, {MODEL: SATURATED}, {}, now=1e9) == Scaling()
    scaling = step(ONE_BUSY, SATURATED, now=110.0, history=ScalingHistory(above_since=0.0))
    assert msgspec.json.decode(msgspec.json.encode(scaling), type=Scaling) == scaling
