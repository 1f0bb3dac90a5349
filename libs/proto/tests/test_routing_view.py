"""RoutingView: route() on a view kept across decisions answers as route() on the bare State, and the
view's index answers as the scans it replaces (ready_instances, partners, calibrations), on varied
random States: models of one base in several precisions, an embedding model, four engines, every
role, instances not ready or whose node left, pipelines, calibrated nodes."""

from __future__ import annotations

import random

import msgspec
import pytest

from fleet_proto import (
    EmbeddingFacts,
    EngineCalibration,
    EngineInfo,
    Instance,
    InstanceStatus,
    ModelCard,
    NodeKind,
    RouteRequest,
    Shard,
    State,
)
from fleet_proto.messages import EMBED_TASK
from fleet_proto.partners import StateScan, partner_table, partners, plan_prefill
from fleet_proto.routing import ROUTING_POLICIES, ready_instances, route
from fleet_proto.routing_view import KeptView, RoutingView, instance_calibration, view_of
from fleet_proto.testing import bare_node

pytestmark = pytest.mark.unit

ENGINES = ("mlx", "vllm", "llamacpp", "echo")
ROLES = ("both", "both", "decode", "prefill")
STATUSES = (InstanceStatus.READY,) * 4 + (InstanceStatus.LOADING, InstanceStatus.FAILED)


def card(model_id: str, base: str = "", dtype: str = "bfloat16", quantization: str = "", **more) -> ModelCard:
    return ModelCard(
        model_id=model_id,
        architecture="llama",
        num_layers=4,
        hidden_size=64,
        num_kv_heads=2,
        head_dim=16,
        dtype=dtype,
        storage_bytes=1,
        quantization=quantization,
        base_model=base,
        **more,
    )


MODELS = {
    c.model_id: c
    for c in (
        card("a-f32", "A", dtype="float32"),
        card("a-bf16", "A"),
        card("a-4bit", "A", quantization="mlx-4bit"),
        card("a-q", "A", quantization="gguf-odd"),  # bits unknown: prefills for no other model
        card("b", "B"),
        card("emb", "E", embedding=EmbeddingFacts(dimensions=8)),
        card("emb-4bit", "E", quantization="mlx-4bit", embedding=EmbeddingFacts(dimensions=8)),
    )
}
REQUESTED = (*MODELS, "uncarded", "unknown")


def calibrations(rng: random.Random, engines: tuple[str, ...], share: float) -> tuple[EngineCalibration, ...]:
    return tuple(
        EngineCalibration(
            engine=engine,
            engine_version="1",
            model_id=model_id,
            prefill_tokens_per_s=rng.choice((0.0, 200.0, 800.0, 3000.0)),
            decode_tokens_per_s=rng.choice((10.0, 30.0, 30.0)),
            prompt_tokens=512,
            completion_tokens=32,
            at=rng.random(),
        )
        for engine in engines
        for model_id in (*MODELS, "uncarded")
        if rng.random() < share
    )


def random_state(seed: int, nodes: int = 10, instances: int = 24, calibrated: float = 0.5) -> State:
    """`calibrated`: the share of nodes, and of their engines' models, measured."""
    rng = random.Random(seed)
    infos = {}
    for n in range(nodes):
        engines = tuple(e for e in ENGINES if rng.random() < 0.7) or ("mlx",)
        info = msgspec.structs.replace(
            bare_node(f"n{n}"),
            kind=rng.choice(tuple(NodeKind)),
            engines=tuple(EngineInfo(name=e, version="1") for e in engines),
            calibrations=calibrations(rng, engines, calibrated) if rng.random() < calibrated else (),
        )
        infos[info.node_id] = info
    placed = {}
    for i in range(instances):
        node = f"n{rng.randrange(nodes)}"
        shards = ()
        if rng.random() < 0.1:  # a pipeline: its ranks on two nodes
            other = f"n{rng.randrange(nodes)}"
            shards = (
                Shard(node_id=node, start_layer=0, end_layer=2),
                Shard(node_id=other, start_layer=2, end_layer=4),
            )
        instance = Instance(
            instance_id=f"i{rng.randrange(1000):03d}-{i}",
            model_id=rng.choice((*MODELS, "uncarded")),
            node_id=node,
            engine=rng.choice(ENGINES),
            status=rng.choice(STATUSES),
            role=rng.choice(ROLES),
            shards=shards,
        )
        placed[instance.instance_id] = instance
    left = set(rng.sample(sorted(infos), 2))  # their instances stay in State, no longer serving
    nodes_in = {k: v for k, v in infos.items() if k not in left}
    return State(last_seq=seed, nodes=nodes_in, instances=placed, models=dict(MODELS))


def random_request(rng: random.Random, state: State, k: int) -> RouteRequest:
    ids, nodes = sorted(state.instances), sorted({i.node_id for i in state.instances.values()})
    return RouteRequest(
        request_id=f"r{k}",
        model_id=rng.choice(REQUESTED),
        prompt_tokens=rng.choice((0, 10, 700, 1500, 6000)),
        disaggregate=rng.choice(("auto", "auto", "always", "never")),
        avoid_nodes=tuple(rng.sample(nodes, 1)) if rng.random() < 0.2 else (),
        avoid_instances=tuple(rng.sample(ids, 2)) if rng.random() < 0.2 else (),
        task=EMBED_TASK if rng.random() < 0.1 else "",
    )


def test_a_kept_view_answers_every_request_as_the_bare_state_does() -> None:
    decisions = 0
    for seed in range(40):
        state, rng = random_state(seed, calibrated=(0.5, 1.0)[seed % 2]), random.Random(1000 + seed)
        view = RoutingView(state)
        nodes, ids = sorted(state.nodes), sorted(state.instances)
        for k in range(60):
            request = random_request(rng, state, k)
            load = {i: rng.randrange(4000) for i in ids if rng.random() < 0.8}
            cached = {n: rng.choice((256, 512, 1024, 4096)) for n in rng.sample(nodes, rng.randrange(3))}
            remembered = {i: rng.choice((32, 600, 2000)) for i in rng.sample(ids, rng.randrange(3))}
            args = (state, request, load, cached, rng.choice((0, 256, 1024)), rng.choice((100, 1000)))
            extra = {"remembered": remembered, "policy": rng.choice(ROUTING_POLICIES), "turn": k}
            kept = route(*args, **extra, view=view)
            assert kept == route(*args, **extra), (seed, k)
            decisions += bool(kept.instance_id)
    assert decisions > 1000  # most requests found an instance: the comparison covers choices


@pytest.mark.parametrize("seed", range(40))
def test_the_views_index_answers_as_the_scans_do(seed: int) -> None:
    state = random_state(seed, calibrated=(0.5, 1.0)[seed % 2])
    view = RoutingView(state)
    for model_id in REQUESTED:
        assert list(view.ready(model_id)) == ready_instances(state, model_id)
    scan = StateScan(state)
    for instance in state.instances.values():
        assert view.calibration(instance) == instance_calibration(state, instance)
        assert view.prefill_speed(instance) == scan.prefill_speed(instance)
        for avoid in ((), (instance.node_id,), ("n1", "n2")):
            assert view.partners(instance, avoid) == partners(state, instance, avoid)
            for uncached, how in ((0, "auto"), (600, "auto"), (5000, "auto"), (10, "always")):
                plain = plan_prefill(state, instance, uncached, {}, how, avoid)
                assert plan_prefill(state, instance, uncached, {}, how, avoid, lookup=view) == plain
    assert partner_table(state, view) == partner_table(state)


def test_a_view_holds_for_its_state_object_only() -> None:
    state = random_state(1)
    view = view_of(state, None)
    assert view.state is state and view_of(state, view) is view
    changed = msgspec.structs.replace(state, last_seq=state.last_seq + 1)  # what apply() returns
    assert view_of(changed, view) is not view and view_of(changed, view).state is changed
    request = RouteRequest(request_id="r", model_id="a-bf16", prompt_tokens=10)
    with pytest.raises(ValueError, match="another State"):
        route(changed, request, {}, view=view)


def test_a_new_state_gets_a_new_answer() -> None:
    one = Instance(instance_id="a", model_id="b", node_id="n0", engine="mlx", status=InstanceStatus.READY)
    state = State(nodes={"n0": bare_node("n0")}, instances={"a": one}, models=dict(MODELS))
    request = RouteRequest(request_id="r", model_id="b", prompt_tokens=10)
    view = view_of(state, None)
    assert route(state, request, {}, view=view).instance_id == "a"
    two = msgspec.structs.replace(one, instance_id="b0")
    grown = msgspec.structs.replace(state, instances={"a": one, "b0": two})
    view = view_of(grown, view)
    assert route(grown, request, {"a": 5}, view=view).instance_id == "b0"


def test_the_partner_table_lists_a_bounded_number_per_decoder() -> None:
    ready = {
        f"i{k:02d}": Instance(
            instance_id=f"i{k:02d}", model_id="b", node_id="n0", engine="vllm", status=InstanceStatus.READY
        )
        for k in range(30)
    }
    state = State(nodes={"n0": bare_node("n0")}, instances=ready, models=dict(MODELS))
    table = partner_table(state, RoutingView(state), limit=4)
    assert len(table) == 30 and all(len(listed) == 4 for listed in table.values())
    assert [p["instance_id"] for p in table["i00"]] == ["i01", "i02", "i03", "i04"]
    assert [p["instance_id"] for p in table["i02"]] == ["i00", "i01", "i03", "i04"]


def test_an_index_derived_from_a_view_is_built_once_per_view() -> None:
    built = []

    def names(view: RoutingView) -> tuple[str, ...]:
        built.append(view)
        return tuple(sorted(view.state.instances))

    state = random_state(3)
    view = RoutingView(state)
    assert view.derived(names) is view.derived(names) and built == [view]
    other = RoutingView(msgspec.structs.replace(state, last_seq=state.last_seq + 1))
    assert other.derived(names) == view.derived(names) and built == [view, other]


def test_a_kept_view_is_the_current_states_and_kept_while_it_is_the_same_object() -> None:
    states = [random_state(4)]
    kept = KeptView(lambda: states[-1])
    first = kept()
    assert first.state is states[0] and kept() is first
    states.append(msgspec.structs.replace(states[0], last_seq=states[0].last_seq + 1))
    assert kept() is not first and kept().state is states[1] and kept() is kept()
