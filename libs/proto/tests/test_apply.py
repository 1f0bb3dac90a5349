"""The reducer: one test per event kind, plus properties over random event sequences."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet_proto import (
    DownloadPhase,
    DownloadProgressed,
    EventOrderError,
    Instance,
    InstanceDeleted,
    InstanceFailed,
    InstanceLoading,
    InstancePlaced,
    InstanceReady,
    NodeInfo,
    NodeJoined,
    NodeLeft,
    ServiceInfo,
    ServiceKind,
    ServiceStarted,
    ServiceStopped,
    State,
    UnknownEventError,
    apply,
    decode_event,
    encode,
    replay,
)
from fleet_proto.events import ModelDeleted, ScalingDecided, ScalingPolicySet
from fleet_proto.scaling import KEPT_DECISIONS, ScalingDecision, ScalingPolicy
from fleet_proto.testing import state_of, then

pytestmark = pytest.mark.unit

NODE = NodeInfo(
    node_id="n1",
    hostname="h",
    system="Linux",
    machine="x86_64",
    cpu_count=2,
    memory_total_bytes=8,
    memory_available_bytes=4,
    disk_total_bytes=10,
    disk_free_bytes=5,
)
SERVICE = ServiceInfo(
    service_id="s1", kind=ServiceKind.GATEWAY, hostname="h", pid=1, version="0", started_at=0.0
)
INSTANCE = Instance(instance_id="i1", model_id="m", node_id="n1", engine="mlx")


def test_service_started_then_stopped():
    state = apply(State(), ServiceStarted(service=SERVICE), 1)
    assert state.services == {"s1": SERVICE}
    assert apply(state, ServiceStopped(service_id="s1"), 2).services == {}


def test_node_joined_then_left():
    state = apply(State(), NodeJoined(node=NODE), 1)
    assert state.nodes == {"n1": NODE}
    assert apply(state, NodeLeft(node_id="n1"), 2).nodes == {}


def test_instance_lifecycle():
    state = apply(State(), InstancePlaced(instance=INSTANCE), 1)
    assert state.instances["i1"].status == "placed"
    state = apply(state, InstanceLoading(instance_id="i1", progress=0.5), 2)
    assert (state.instances["i1"].status, state.instances["i1"].progress) == ("loading", 0.5)
    state = apply(state, InstanceReady(instance_id="i1"), 3)
    assert state.instances["i1"].status == "ready"
    failed = apply(state, InstanceFailed(instance_id="i1", reason="oom"), 4)
    assert (failed.instances["i1"].status, failed.instances["i1"].reason) == ("failed", "oom")
    assert apply(failed, InstanceDeleted(instance_id="i1"), 5).instances == {}


def test_a_failure_about_another_generation_changes_nothing():
    second = apply(State(), InstancePlaced(instance=msgspec.structs.replace(INSTANCE, generation=1)), 1)
    stale = apply(second, InstanceFailed(instance_id="i1", reason="rank 1 died", generation=0), 2)
    assert stale.instances == second.instances
    current = apply(second, InstanceFailed(instance_id="i1", reason="rank 1 died", generation=1), 3)
    whichever = apply(second, InstanceFailed(instance_id="i1", reason="rank 1 died"), 3)  # generation -1
    assert current.instances == whichever.instances
    assert (current.instances["i1"].status, current.instances["i1"].reason) == ("failed", "rank 1 died")


def test_a_failed_instance_keeps_its_first_reason_unless_a_later_one_extends_it():
    state = apply(State(), InstancePlaced(instance=INSTANCE), 1)
    state = apply(state, InstanceFailed(instance_id="i1", reason="rank 0: out of memory"), 2)
    state = apply(state, InstanceFailed(instance_id="i1", reason="rank 1: ring connection lost"), 3)
    assert state.instances["i1"].reason == "rank 0: out of memory"
    extended = "rank 0: out of memory; not re-placed: no node fits"
    state = apply(state, InstanceFailed(instance_id="i1", reason=extended), 4)
    assert (state.instances["i1"].status, state.instances["i1"].reason) == ("failed", extended)
    # once it runs again, a new failure names its own cause
    state = apply(state, InstanceLoading(instance_id="i1", progress=0.0), 5)
    state = apply(state, InstanceFailed(instance_id="i1", reason="load failed"), 6)
    assert state.instances["i1"].reason == "load failed"


def test_update_for_unknown_instance_changes_nothing_but_the_seq():
    state = apply(State(), InstanceReady(instance_id="gone"), 1)
    assert state == State(last_seq=1)


def test_download_progress_replaces_the_models_status():
    state = apply(State(), DownloadProgressed(model_id="m", phase=DownloadPhase.DOWNLOADING, done_bytes=1), 1)
    state = apply(
        state, DownloadProgressed(model_id="m", phase=DownloadPhase.DONE, done_bytes=9, total_bytes=9), 2
    )
    assert state.downloads["m"].phase == "done"
    assert state.downloads["m"].done_bytes == 9


def test_apply_does_not_mutate_its_input():
    before = apply(State(), NodeJoined(node=NODE), 1)
    snapshot = encode(before)
    apply(before, NodeLeft(node_id="n1"), 2)
    assert encode(before) == snapshot


def test_out_of_order_event_is_rejected():
    state = apply(State(), NodeJoined(node=NODE), 5)
    with pytest.raises(EventOrderError, match="seq 5 is not after"):
        apply(state, NodeLeft(node_id="n1"), 5)


def test_unknown_event_kinds_are_rejected_clearly():
    with pytest.raises(UnknownEventError, match="nope"):
        decode_event(b'{"kind": "nope"}')

    class Foreign(msgspec.Struct):
        pass

    with pytest.raises(UnknownEventError, match="Foreign"):
        apply(State(), Foreign(), 1)  # type: ignore[arg-type]


ids = st.sampled_from(["a", "b", "c"])
node_infos = st.builds(
    NodeInfo,
    node_id=ids,
    hostname=st.text(max_size=5),
    system=st.just("Linux"),
    machine=st.just("x86_64"),
    cpu_count=st.integers(1, 64),
    memory_total_bytes=st.integers(0, 2**40),
    memory_available_bytes=st.integers(0, 2**40),
    disk_total_bytes=st.integers(0, 2**40),
    disk_free_bytes=st.integers(0, 2**40),
)
instances = st.builds(
    Instance,
    instance_id=ids,
    model_id=st.sampled_from(["m1", "m2"]),
    node_id=ids,
    engine=st.just("mlx"),
    generation=st.integers(0, 2),
)
events = st.one_of(
    st.builds(
        ServiceStarted,
        service=st.builds(
            ServiceInfo,
            service_id=ids,
            kind=st.sampled_from(ServiceKind),
            hostname=st.just("h"),
            pid=st.integers(1, 9),
            version=st.just("0"),
            started_at=st.floats(0, 1),
        ),
    ),
    st.builds(ServiceStopped, service_id=ids),
    st.builds(NodeJoined, node=node_infos),
    st.builds(NodeLeft, node_id=ids),
    st.builds(InstancePlaced, instance=instances),
    st.builds(InstanceLoading, instance_id=ids, progress=st.floats(0, 1)),
    st.builds(InstanceReady, instance_id=ids),
    st.builds(InstanceFailed, instance_id=ids, reason=st.text(max_size=5), generation=st.integers(-1, 2)),
    st.builds(InstanceDeleted, instance_id=ids),
    st.builds(
        DownloadProgressed, model_id=ids, phase=st.sampled_from(DownloadPhase), done_bytes=st.integers(0, 9)
    ),
)


@given(st.lists(events, max_size=30))
def test_replaying_the_same_events_twice_gives_the_same_state(sequence):
    numbered = list(enumerate(sequence, start=1))
    first, second = replay(numbered), replay(numbered)
    assert first == second
    assert encode(first) == encode(second)
    assert first.last_seq == len(sequence)


@given(st.lists(events, max_size=30), st.integers(0, 30))
def test_replay_from_a_midpoint_state_equals_a_full_replay(sequence, cut):
    numbered = list(enumerate(sequence, start=1))
    middle = replay(numbered[:cut])
    assert replay(numbered[cut:], middle) == replay(numbered)


@given(events)
def test_every_event_round_trips_through_json(event):
    assert decode_event(encode(event)) == event


def test_model_staged_records_the_card_and_status_changes_move_instances():
    from fleet_proto import InstanceStatusChanged, ModelCard, ModelStaged

    card = ModelCard(
        model_id="m", architecture="llama", num_layers=2, hidden_size=64, num_kv_heads=2, head_dim=16,
        dtype="bfloat16", storage_bytes=10,
    )  # fmt: skip
    state = replay(
        enumerate(
            [
                ModelStaged(card=card),
                InstancePlaced(instance=INSTANCE),
                InstanceStatusChanged(instance_id="i1", status="warming", progress=0.9),
                InstanceStatusChanged(instance_id="i1", status="from-the-future"),
            ],
            start=1,
        )
    )
    assert state.models == {"m": card}
    assert (state.instances["i1"].status, state.instances["i1"].progress) == ("warming", 0.9)


def test_scaling_keeps_the_policy_and_the_last_decisions_and_goes_with_the_model():
    policy = ScalingPolicy(enabled=True, min_instances=0, max_instances=2)
    state = state_of(ScalingPolicySet(model_id="m", policy=policy))
    decisions = [ScalingDecision(kind="hold", reason=f"r{n}", at=float(n)) for n in range(KEPT_DECISIONS + 3)]
    state = then(state, *(ScalingDecided(model_id="m", decision=d) for d in decisions))
    state = then(state, ScalingPolicySet(model_id="m", policy=ScalingPolicy()))  # decisions stay
    assert state.scaling["m"].policy == ScalingPolicy()
    assert state.scaling["m"].decisions == tuple(decisions[-KEPT_DECISIONS:])
    assert "m" not in then(state, ModelDeleted(model_id="m")).scaling
