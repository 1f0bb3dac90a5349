"""A pipeline whose rank failed is placed again, within a budget; otherwise its reason says why not."""

from __future__ import annotations

import msgspec
import pytest

from fleet_proto import (
    EngineInfo,
    Instance,
    InstanceFailed,
    InstancePlaced,
    InstanceReady,
    ModelCard,
    ModelStaged,
    NodeInfo,
    NodeJoined,
    State,
    apply,
    replay,
)
from fleet_scheduler.placement import PlacementError, place, placed_again
from fleet_scheduler.replacement import NOT_REPLACED, failed_pipeline, replacement

pytestmark = pytest.mark.unit

GiB = 2**30
MODEL = ModelCard(
    model_id="org/big",
    architecture="llama",
    num_layers=30,
    hidden_size=1024,
    num_kv_heads=8,
    head_dim=64,
    dtype="bfloat16",
    storage_bytes=10 * GiB,  # 13 GiB with headroom: no 8 GiB node holds it alone
)


def node(node_id: str) -> NodeJoined:
    return NodeJoined(
        node=NodeInfo(
            node_id=node_id, hostname=node_id, system="Linux", machine="x86_64", cpu_count=2,
            memory_total_bytes=8 * GiB, memory_available_bytes=8 * GiB, disk_total_bytes=1, disk_free_bytes=1,
            engines=(EngineInfo(name="mlx", version="1"),), ring_host="h", ring_port_base=52400,
        )
    )  # fmt: skip


def state_of(*events) -> State:
    return replay(enumerate(events, start=1))


JOINED = state_of(node("a"), node("b"), ModelStaged(card=MODEL))
PIPELINE = msgspec.structs.replace(place(JOINED, "org/big", "p1"), role="decode")
RANK_DIED = InstanceFailed(instance_id="p1", reason="rank 1: engine exited", generation=0)


def failed(*events) -> State:
    placed = [InstancePlaced(instance=PIPELINE), InstanceReady(instance_id="p1"), *events]
    return replay(enumerate(placed, start=JOINED.last_seq + 1), JOINED)


def test_a_rank_failure_of_the_current_generation_leaves_a_pipeline_to_place_again():
    state = failed(RANK_DIED)
    instance = failed_pipeline(state, RANK_DIED)
    assert instance is not None and (instance.status, instance.reason) == ("failed", "rank 1: engine exited")
    whichever = InstanceFailed(instance_id="p1", reason="rank 1: engine exited")  # generation -1
    assert failed_pipeline(failed(whichever), whichever) == instance


def test_what_is_not_a_failed_pipeline_of_the_current_generation_is_left_alone():
    stale = InstanceFailed(instance_id="p1", reason="late", generation=1)
    assert failed_pipeline(failed(stale), stale) is None  # ignored by the reducer: still ready
    recovered = failed(RANK_DIED, InstanceReady(instance_id="p1"))
    assert failed_pipeline(recovered, RANK_DIED) is None
    single = Instance(instance_id="s1", model_id="org/big", node_id="a", engine="mlx")
    alone = InstanceFailed(instance_id="s1", reason="crashed")
    state = replay([(1, InstancePlaced(instance=single)), (2, alone)])
    assert failed_pipeline(state, alone) is None  # its worker restarts it
    assert failed_pipeline(State(), RANK_DIED) is None  # deleted meanwhile


def test_a_failed_pipeline_is_placed_again_as_its_next_generation_on_fresh_ports():
    state = failed(RANK_DIED)
    answer = replacement(state, state.instances["p1"], placed_again, replaced_at=[], now=1000.0)
    assert isinstance(answer, InstancePlaced)
    again = answer.instance
    assert (again.instance_id, again.role, again.generation, again.status) == ("p1", "decode", 1, "placed")
    assert [s.ring_address for s in PIPELINE.shards] == ["h:52400", "h:52401"]
    assert [s.ring_address for s in again.shards] == ["h:52402", "h:52403"]
    # the old generation's ranks may still report: the reducer ignores them
    after = replay([(state.last_seq + 1, answer), (state.last_seq + 2, RANK_DIED)], state)
    assert after.instances["p1"] == again


def test_at_most_three_times_within_ten_minutes():
    state = failed(RANK_DIED)
    instance = state.instances["p1"]
    recent = [150.0, 400.0, 650.0]
    answer = replacement(state, instance, placed_again, recent, now=700.0)
    assert answer == InstanceFailed(
        instance_id="p1",
        generation=0,
        reason="rank 1: engine exited; not re-placed: placed again 3 times within 600 s already",
    )
    assert isinstance(replacement(state, instance, placed_again, recent, now=749.0), InstanceFailed)
    # 600 s after the first, only two are recent
    assert isinstance(replacement(state, instance, placed_again, recent, now=750.0), InstancePlaced)


def test_why_it_was_not_placed_again_shows_in_its_reason_and_is_final():
    state = failed(RANK_DIED)

    def nowhere(state: State, instance: Instance) -> Instance:
        raise PlacementError("no node fits org/big (needs 13.00 GiB)")

    answer = replacement(state, state.instances["p1"], nowhere, [], now=0.0)
    assert isinstance(answer, InstanceFailed)
    shown = apply(state, answer, state.last_seq + 1)
    reason = "rank 1: engine exited; not re-placed: no node fits org/big (needs 13.00 GiB)"
    assert (shown.instances["p1"].status, shown.instances["p1"].reason) == ("failed", reason)
    assert NOT_REPLACED in reason and failed_pipeline(shown, answer) is None  # never answered twice
    other_rank = InstanceFailed(instance_id="p1", reason="rank 0: ring broken", generation=0)
    assert apply(shown, other_rank, shown.last_seq + 1).instances == shown.instances
