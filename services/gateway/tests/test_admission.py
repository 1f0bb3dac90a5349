"""Admission at saturation (fleet_gateway.admission): when an instance is full, its order, bounds
and deadline; the queue's pure rules, then the queue itself over a replayed State (no servers);
and a model scaled to zero, whose requests wait for its first instance."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from fleet_gateway.admission import (
    Admission,
    AdmissionLimits,
    InstanceLoad,
    Waiter,
    next_waiter,
    occupancy,
)
from fleet_gateway.errors import ApiError
from fleet_proto import (
    Instance,
    InstancePlaced,
    InstanceReady,
    InstanceStatus,
    ModelCard,
    ModelStaged,
    NodeJoined,
    NodeMetrics,
    ScalingDecided,
    ScalingDecision,
    ScalingPolicy,
    ScalingPolicySet,
    State,
)
from fleet_proto.routing import ready_instances
from fleet_proto.routing_view import KeptView
from fleet_proto.testing import bare_node, state_of, then

pytestmark = pytest.mark.unit


def full_instances(candidates: list[str], slots: dict[str, int], running: dict[str, int]) -> set[str]:
    """The scan Admission's rooms keep up to date: candidates running as many requests as their slots."""
    return {i for i in candidates if slots.get(i, 0) > 0 and running.get(i, 0) >= slots[i]}


def free_slots(candidates: list[str], slots: dict[str, int], running: dict[str, int]) -> int:
    """The scan's free slots: one of unknown capacity counts as one."""
    return sum(max(slots[i] - running.get(i, 0), 0) if slots.get(i, 0) > 0 else 1 for i in candidates)


def test_an_instance_is_full_at_its_slots_and_one_of_unknown_capacity_never_is():
    slots, running = {"a": 2, "b": 2}, {"a": 2, "b": 1, "c": 50}
    assert occupancy(slots["a"], running["a"]) == (0, True)
    assert occupancy(slots["b"], running["b"]) == (1, False)
    assert occupancy(0, running["c"]) == (1, False)
    assert full_instances(["a", "b", "c"], slots, running) == {"a"}
    assert free_slots(["a", "b", "c"], slots, running) == 0 + 1 + 1


def test_the_next_waiter_is_by_priority_then_the_caller_served_longest_ago_then_the_oldest():
    def waiter(caller: str, priority: int, number: int) -> Waiter:
        return Waiter(caller, priority, number, asyncio.Future(loop=asyncio.new_event_loop()))

    a1, a2, b1 = waiter("a", 0, 1), waiter("a", 0, 2), waiter("b", 0, 3)
    assert next_waiter([a1, a2, b1], {}) is a1  # nobody served yet: the oldest
    assert next_waiter([a2, b1], {"a": 5}) is b1  # b never served: b's turn before a's second
    assert next_waiter([a2, b1], {"a": 5, "b": 7}) is a2
    urgent = waiter("c", 9, 4)
    assert next_waiter([a1, b1, urgent], {}) is urgent


def test_the_load_is_the_report_corrected_by_what_this_gateway_sent_and_saw_finish():
    load = InstanceLoad()
    load.on_sample(sample({"i": 3}, {"i": 4}))
    load.sent("i")
    assert load.running() == {"i": 4}
    load.finished("i")
    load.finished("i")  # one that was running at the report
    assert load.running() == {"i": 2}
    load.on_sample(sample({"i": 1}, {"i": 4}))  # the next report is the truth again
    assert load.running() == {"i": 1}
    load.sent("i")
    load.sent("i")
    load.on_sample(sample({"i": 0}, {"i": 4}))  # a report that has not seen them yet
    assert load.running() == {"i": 2}  # never less than this gateway has in flight


def test_the_rooms_kept_as_the_load_and_state_change_answer_as_the_scans_of_both():
    """Each model's free slots and full instances, kept per State and updated per load change, equal
    free_slots and full_instances over ready_instances, scanned afresh after every change."""
    rng = random.Random(11)
    ids = [f"i{k}" for k in range(14)]

    def random_state(seq: int) -> State:
        instances = {
            i: Instance(
                instance_id=i,
                model_id=rng.choice(("m0", "m1")),
                node_id=f"n{rng.randrange(4)}",  # n3 is not in the cluster
                engine="mlx",
                status=rng.choice((InstanceStatus.READY, InstanceStatus.READY, InstanceStatus.LOADING)),
                role=rng.choice(("both", "decode", "prefill")),
            )
            for i in ids
            if rng.random() < 0.8
        }
        return State(last_seq=seq, nodes={n: bare_node(n) for n in ("n0", "n1", "n2")}, instances=instances)

    states = [random_state(0)]
    gate = Admission(KeptView(lambda: states[-1]))
    load = gate.load
    checked = 0
    for step in range(3000):
        match rng.randrange(10):
            case 0:  # a new State: changed, or the same facts in a new object (what apply() returns)
                fresh = random_state(step) if rng.random() < 0.5 else msgspec.structs.replace(states[-1])
                states.append(fresh)
            case 1 | 2:
                chosen = rng.sample(ids, 3)
                load.on_sample(
                    sample({i: rng.randrange(5) for i in chosen}, {i: rng.randrange(4) for i in chosen})
                )
            case 3 | 4 | 5:
                load.sent(rng.choice(ids))
            case _:
                load.finished(rng.choice(ids))
        for model_id in rng.sample(("m0", "m1", "absent"), 2):
            candidates = [i.instance_id for i in ready_instances(states[-1], model_id)]
            running = load.running()
            assert gate.full(model_id) == tuple(sorted(full_instances(candidates, load.slots, running)))
            free = free_slots(candidates, load.slots, running) if candidates else 1
            assert gate.room(model_id) == free, step
            checked += bool(gate.full(model_id))
    assert checked > 300  # full instances were common: the comparison covers them


def sample(active: dict[str, int], slots: dict[str, int]) -> NodeMetrics:
    return NodeMetrics(
        node_id="n",
        at=0.0,
        memory_used_bytes=0,
        memory_available_bytes=0,
        cpu_percent=0.0,
        disk_free_bytes=0,
        active_requests=active,
        request_slots=slots,
    )


def one_instance_state():
    instance = Instance(instance_id="i", model_id="m", node_id="n", engine="mlx")
    return state_of(InstancePlaced(instance=instance), InstanceReady(instance_id="i"))


DEFAULTS = AdmissionLimits()


def admission(limits: AdmissionLimits = DEFAULTS, priorities: dict[str, int] | None = None):
    state = one_instance_state()
    gate = Admission(KeptView(lambda: state), limits, lambda caller: (priorities or {}).get(caller, 0))
    gate.load.on_sample(sample({"i": 0}, {"i": 2}))
    return gate


async def hold(gate: Admission, caller: str, release: asyncio.Event, order: list[str]) -> None:
    """A request that takes a slot on instance i until `release`."""
    async with gate.entry("m", caller) as ticket:
        order.append(caller)
        ticket.sent("i")
        await release.wait()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_requests_wait_while_the_model_is_full_and_enter_as_slots_open():
    gate = admission()
    release, order = asyncio.Event(), []
    running = [asyncio.create_task(hold(gate, f"k{n}", release, order)) for n in range(2)]
    await settle()
    assert gate.full("m") == ("i",)
    third = asyncio.create_task(hold(gate, "k2", asyncio.Event(), order))
    await settle()
    assert order == ["k0", "k1"] and gate.waiting() == {"m": 1}
    release.set()  # both finish: the waiter enters
    await asyncio.gather(*running)
    await settle()
    assert order == ["k0", "k1", "k2"] and gate.waiting() == {}
    third.cancel()


async def test_a_higher_priority_caller_enters_first_and_callers_take_turns():
    gate = admission(priorities={"vip": 5})
    release, order = asyncio.Event(), []
    running = [asyncio.create_task(hold(gate, "bulk", release, order)) for _ in range(2)]
    await settle()
    later = asyncio.Event()
    waiting = [asyncio.create_task(hold(gate, c, later, order)) for c in ("bulk", "bulk", "other", "vip")]
    await settle()
    release.set()  # two slots open: the vip, then the caller served longest ago (other, never)
    await settle()
    assert order[2:] == ["vip", "other"]
    later.set()
    await asyncio.gather(*running, *waiting)
    assert order[4:] == ["bulk", "bulk"]


async def test_over_the_bounds_or_past_the_deadline_the_request_is_refused_with_retry_after():
    gate = admission(AdmissionLimits(queue=2, queue_per_key=1, timeout_s=0.2))
    release, order = asyncio.Event(), []
    running = [asyncio.create_task(hold(gate, f"k{n}", release, order)) for n in range(2)]
    await settle()
    first = asyncio.create_task(hold(gate, "a", release, order))
    await settle()
    with pytest.raises(ApiError) as per_key:
        await hold(gate, "a", release, order)
    assert per_key.value.status == 429 and per_key.value.headers["Retry-After"]
    second = asyncio.create_task(hold(gate, "b", release, order))
    await settle()
    with pytest.raises(ApiError) as full:
        await hold(gate, "c", release, order)
    assert full.value.status == 503 and "Retry-After" in full.value.headers
    for waiter in (first, second):  # nobody finished within the deadline
        with pytest.raises(ApiError) as late:
            await waiter
        assert late.value.status == 503 and "stayed busy" in late.value.message
    assert gate.refused == {"key_queue_full": 1, "queue_full": 1, "timeout": 2}
    assert gate.waiting() == {}
    release.set()
    await asyncio.gather(*running)


async def test_a_client_that_leaves_while_waiting_gives_its_place_back():
    gate = admission()
    release, order = asyncio.Event(), []
    running = [asyncio.create_task(hold(gate, f"k{n}", release, order)) for n in range(2)]
    await settle()
    gone = asyncio.create_task(hold(gate, "gone", asyncio.Event(), order))
    await settle()
    gone.cancel()
    await settle()
    assert gate.waiting() == {}
    stays = asyncio.create_task(hold(gate, "stays", asyncio.Event(), order))
    release.set()
    await asyncio.gather(*running)
    await settle()
    assert order == ["k0", "k1", "stays"]
    stays.cancel()


async def test_a_model_without_a_ready_instance_is_not_queued():
    gate = admission()
    async with gate.entry("no-such-model", "k") as ticket:  # routing answers that it has none
        assert ticket.model_id == "no-such-model"
    assert gate.waiting() == {}


async def test_a_request_for_a_model_scaled_to_zero_waits_for_its_instance_and_counts_as_demand():
    policy = ScalingPolicy(enabled=True, min_instances=0, max_instances=2)
    card = ModelCard(
        model_id="z", architecture="llama", num_layers=1, hidden_size=8, num_kv_heads=1, head_dim=8,
        dtype="float32", storage_bytes=1,
    )  # fmt: skip
    states = [
        state_of(
            NodeJoined(node=bare_node("n")),
            ModelStaged(card=card),
            ScalingPolicySet(model_id="z", policy=policy),
        ),
    ]
    gate = Admission(KeptView(lambda: states[-1]), DEFAULTS)
    assert gate.starting("z") and gate.room("z") == 0
    assert "waiting for the scheduler to place an instance of z" in gate.starting_status("z")
    order: list[str] = []
    waiter = asyncio.create_task(hold_model(gate, "z", "zi", order))
    await settle()
    assert gate.waiting() == {"z": 1} and order == []  # the autoscaler sees it waiting
    placed = Instance(
        instance_id="zi", model_id="z", node_id="n", engine="mlx", status=InstanceStatus.LOADING
    )
    states.append(then(states[-1], InstancePlaced(instance=placed)))
    gate.wake()
    await settle()
    assert order == [] and "zi on n: loading" in gate.starting_status("z")
    states.append(then(states[-1], InstanceReady(instance_id="zi")))
    gate.load.on_sample(sample({"zi": 0}, {"zi": 4}))
    gate.wake()  # a worker's report: the ready instance has room
    await settle()
    assert order == ["z"] and not gate.starting("z")
    waiter.cancel()


async def test_a_cold_start_past_its_deadline_is_refused_saying_where_the_start_is():
    policy = ScalingPolicy(enabled=True, min_instances=0, max_instances=1)
    state = state_of(ScalingPolicySet(model_id="z", policy=policy))
    gate = Admission(KeptView(lambda: state), AdmissionLimits(timeout_s=0.01, cold_start_timeout_s=0.2))
    with pytest.raises(ApiError) as late:
        await hold_model(gate, "z", "zi", [])
    assert late.value.status == 503 and "No instance of z started within 0.2 s" in late.value.message
    assert gate.refused == {"cold_start_timeout": 1}


async def hold_model(gate: Admission, model_id: str, instance_id: str, order: list[str]) -> None:
    async with gate.entry(model_id, "k") as ticket:
        order.append(model_id)
        ticket.sent(instance_id)
        await asyncio.Event().wait()


def test_a_cold_start_the_scheduler_holds_says_why():
    policy = ScalingPolicy(enabled=True, min_instances=0, max_instances=1)
    held = ScalingDecision(kind="hold", reason="wants 1, has 0: no node without an instance of it fits")
    state = state_of(
        ScalingPolicySet(model_id="z", policy=policy), ScalingDecided(model_id="z", decision=held)
    )
    status = Admission(KeptView(lambda: state)).starting_status("z")
    assert status.endswith("it holds (wants 1, has 0: no node without an instance of it fits)")
