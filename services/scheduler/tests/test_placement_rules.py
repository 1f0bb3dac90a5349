"""Placement rules (seeds: exo's vLLM-aware placement) as pure functions over plain State values.

Past ~450 lines as one file: its cases follow placement.py's one ordered pipeline (candidates,
scores, pick, layer split) and share its State builders; split apart, each part would copy them."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet_proto import (
    DownloadPhase,
    DownloadStatus,
    EngineInfo,
    Instance,
    InstanceStatus,
    ModelCard,
    NodeInfo,
    NodeKind,
    PlacementsReply,
    Shard,
    State,
)
from fleet_proto.engines import ENGINE_FACTS
from fleet_scheduler.placement import (
    RING_PORT_SPAN,
    PlacementError,
    free_bytes,
    memory_needed,
    option_label,
    place,
    placed_again,
    placement_options,
    ring_addresses,
    split_layers,
)
from fleet_store.cards import with_conventions

pytestmark = pytest.mark.unit

GiB = 2**30
# The engines' facts with pipelines allowed (vLLM's too) or not (MLX's neither); memory headroom 1.3.
PIPELINE_CAPS = {
    "mlx": msgspec.structs.replace(ENGINE_FACTS["mlx"], pipeline=True),
    "vllm": msgspec.structs.replace(ENGINE_FACTS["vllm"], pipeline=True),
}
NO_PIPELINE_CAPS = {
    "mlx": msgspec.structs.replace(ENGINE_FACTS["mlx"], pipeline=False),
    "vllm": msgspec.structs.replace(ENGINE_FACTS["vllm"], pipeline=False),
}
RING_PORT_BASE = 52400


def node(
    node_id: str,
    free: float | int,
    engines: tuple[str, ...] = ("mlx",),
    kind: NodeKind = NodeKind.CPU,
    cached: tuple[str, ...] = (),
    ring_host: str | None = None,
    ring_port_base: int = RING_PORT_BASE,
) -> NodeInfo:
    """A node with `free` GiB (a float) or bytes (an int) of available memory; its ring host is its id
    unless given."""
    return NodeInfo(
        node_id=node_id,
        hostname=node_id,
        system="Linux",
        machine="x86_64",
        cpu_count=8,
        memory_total_bytes=256 * GiB,
        memory_available_bytes=int(free * GiB) if isinstance(free, float) else free,
        disk_total_bytes=1,
        disk_free_bytes=1,
        engines=tuple(EngineInfo(name=e, version="1") for e in engines),
        kind=kind,
        cached_models=cached,
        ring_host=node_id if ring_host is None else ring_host,
        ring_port_base=ring_port_base,
    )


def card(
    model_id: str = "org/m",
    storage: float | int = 1.0,
    layers: int = 32,
    quantization: str = "",
    engines: tuple[str, ...] = ("mlx", "vllm"),
) -> ModelCard:
    plain = ModelCard(
        model_id=model_id,
        architecture="llama",
        num_layers=layers,
        hidden_size=1024,
        num_kv_heads=8,
        head_dim=64,
        dtype="bfloat16",
        storage_bytes=int(storage * GiB) if isinstance(storage, float) else storage,
        quantization=quantization,
        publisher=model_id.split("/")[0],
        supported_engines=engines,
    )
    return with_conventions(plain)  # as the downloader builds cards: with what the name implies


def cluster(
    *nodes: NodeInfo, cards: tuple[ModelCard, ...] = (), instances: tuple[Instance, ...] = ()
) -> State:
    return State(
        nodes={n.node_id: n for n in nodes},
        models={c.model_id: c for c in cards},
        instances={i.instance_id: i for i in instances},
    )


def shards_of(*ranges: tuple[str, int, int]) -> tuple[Shard, ...]:
    return tuple(Shard(node_id=n, start_layer=s, end_layer=e) for n, s, e in ranges)


def with_rings(shards: tuple[Shard, ...], *addresses: str) -> tuple[Shard, ...]:
    return tuple(msgspec.structs.replace(s, ring_address=a) for s, a in zip(shards, addresses, strict=True))


MLX_4BIT = card("mlx-community/Llama-3.2-1B-Instruct-4bit", quantization="4bit")


# --- engine installed --------------------------------------------------------------------------


def test_engine_runs_only_on_nodes_that_have_it():
    state = cluster(node("a", 4.0, engines=("mlx",)), node("b", 64.0, engines=("vllm",)), cards=(card(),))
    assert place(state, "org/m", "i1", engine="mlx").node_id == "a"
    assert place(state, "org/m", "i1", engine="vllm").node_id == "b"
    refused = {o.shards[0].node_id: o.reason for o in placement_options(state, "org/m") if not o.feasible}
    assert refused == {"b": "no mlx engine", "a": "no vllm engine"}


def test_engine_the_model_does_not_support_is_refused():
    state = cluster(node("a", 64.0, engines=("mlx", "vllm")), cards=(card(engines=("mlx",)),))
    with pytest.raises(PlacementError, match=r"org/m does not run on vllm \(supported: mlx\)"):
        place(state, "org/m", "i1", engine="vllm")


def test_the_echo_engine_runs_any_model_only_when_asked_for_by_name():
    # It loads no weights: a node offering it takes a model far larger than its memory.
    state = cluster(node("a", 0.5, engines=("mlx", "echo")), cards=(card(storage=8.0, engines=("mlx",)),))
    placed = place(state, "org/m", "i1", engine="echo")
    assert (placed.engine, placed.node_id) == ("echo", "a")
    assert {o.engine for o in placement_options(state, "org/m")} == {"mlx"}  # never chosen unasked
    with pytest.raises(PlacementError, match="needs"):
        place(state, "org/m", "i1")


def test_the_echo_engine_needs_a_node_that_offers_it():
    state = cluster(node("a", 64.0, engines=("mlx",)), cards=(card(),))
    with pytest.raises(PlacementError, match="no echo engine"):
        place(state, "org/m", "i1", engine="echo")


# --- memory ------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "mlx"])
def test_memory_needs_storage_times_headroom_exactly(engine):
    model = card(storage=10.0)  # 10 GiB x 1.3 = exactly 13 GiB
    enough = cluster(node("a", 13 * GiB, engines=(engine,)), cards=(model,))
    short = cluster(node("a", 13 * GiB - 1, engines=(engine,)), cards=(model,))
    instance = place(enough, "org/m", "i1", engine=engine)
    assert (instance.node_id, instance.shards) == ("a", (Shard(node_id="a", start_layer=0, end_layer=32),))
    [option] = [o for o in placement_options(enough, "org/m") if o.engine == engine]
    assert option.memory_needed == {"a": 13 * GiB}
    assert option.free_after == {"a": 0}
    with pytest.raises(PlacementError, match=r"needs 13\.00 GiB"):
        place(short, "org/m", "i1", engine=engine)


@pytest.mark.parametrize(
    "status",
    [InstanceStatus.PLACED, InstanceStatus.DOWNLOADING, InstanceStatus.LOADING, InstanceStatus.WARMING],
)
def test_memory_promised_to_instances_not_yet_ready_is_counted(status):
    other = card("org/other", storage=4.0)
    loading = Instance(instance_id="i0", model_id="org/other", node_id="a", engine="mlx", status=status)
    state = cluster(node("a", 10.0), node("b", 8.0), cards=(card(), other), instances=(loading,))
    assert free_bytes(state)["a"] == int(10.0 * GiB) - int(4 * 1.3 * GiB) - 1  # ceil of 5.2 GiB
    assert place(state, "org/m", "i1").node_id == "b"  # a keeps 10 - 5.2 = 4.8 GiB free


def test_ready_instances_count_against_the_memory_the_node_joined_with():
    ready = Instance(
        instance_id="i0", model_id="org/m", node_id="a", engine="mlx", status=InstanceStatus.READY
    )
    failed = Instance(
        instance_id="i1", model_id="org/m", node_id="a", engine="mlx", status=InstanceStatus.FAILED
    )
    state = cluster(node("a", 10.0), node("b", 8.0), cards=(card(),), instances=(ready, failed))
    assert (
        free_bytes(state)["a"]
        == 10 * GiB
        - memory_needed(card(), (Shard(node_id="a", start_layer=0, end_layer=card().num_layers),), 1.3)["a"]
    )


def test_promised_memory_of_a_pipeline_instance_is_split_by_its_shards():
    shards = (
        Shard(node_id="a", start_layer=0, end_layer=24),
        Shard(node_id="b", start_layer=24, end_layer=32),
    )
    pipelined = Instance(instance_id="i0", model_id="org/big", node_id="a", engine="mlx", shards=shards)
    state = cluster(
        node("a", 100.0), node("b", 100.0), cards=(card("org/big", storage=40.0),), instances=(pipelined,)
    )
    free = free_bytes(state)
    assert (100 * GiB - free["a"], 100 * GiB - free["b"]) == (39 * GiB, 13 * GiB)


def test_download_size_stands_in_for_a_card_not_yet_staged():
    downloading = DownloadStatus(model_id="org/new", phase=DownloadPhase.DOWNLOADING, total_bytes=10 * GiB)
    state = State(nodes={"a": node("a", 12.0), "b": node("b", 14.0)}, downloads={"org/new": downloading})
    instance = place(state, "org/new", "i1")
    assert (instance.node_id, instance.engine, instance.shards) == ("b", "mlx", ())  # layer count unknown
    placed = Instance(instance_id="i0", model_id="org/new", node_id="b", engine="mlx")
    with_placed = msgspec.structs.replace(state, instances={"i0": placed})
    assert free_bytes(with_placed)["b"] == 1 * GiB


@pytest.mark.parametrize(
    "downloads",
    [{}, {"org/m": DownloadStatus(model_id="org/m", phase=DownloadPhase.DOWNLOADING, total_bytes=0)}],
)
def test_model_with_nothing_known_is_refused(downloads):
    state = State(nodes={"a": node("a", 64.0)}, downloads=downloads)
    with pytest.raises(PlacementError, match="model org/m is not staged"):
        place(state, "org/m", "i1")
    with pytest.raises(PlacementError, match="not staged"):
        placement_options(state, "org/m")


def test_empty_cluster_is_refused():
    with pytest.raises(PlacementError, match="no engine-worker has joined the cluster"):
        place(State(models={"org/m": card()}), "org/m", "i1")


# --- MLX-quantized models ----------------------------------------------------------------------


@pytest.mark.parametrize("quantization", ["4bit", "8bit", "mlx-4bit", "mlx-8bit"])
def test_mlx_community_quantized_models_never_go_to_vllm(quantization):
    model = card("mlx-community/Qwen3-4B", quantization=quantization)
    state = cluster(
        node("gpu", 80.0, engines=("vllm",), kind=NodeKind.CUDA), node("cpu", 1.0), cards=(model,)
    )
    [vllm] = [o for o in placement_options(state, model.model_id) if o.engine == "vllm"]
    assert not vllm.feasible
    assert vllm.reason == f"vllm cannot load MLX-quantized weights ({quantization})"
    with pytest.raises(PlacementError, match="vllm cannot load MLX-quantized weights"):
        place(state, model.model_id, "i1")
    with pytest.raises(PlacementError, match="vllm cannot load MLX-quantized weights"):
        place(state, model.model_id, "i1", engine="vllm")


def test_mlx_quantization_from_any_publisher_never_goes_to_vllm():
    model = card("someone/Llama-mlx", quantization="mlx-4bit")
    state = cluster(node("gpu", 80.0, engines=("vllm",), kind=NodeKind.CUDA), cards=(model,))
    with pytest.raises(PlacementError, match="vllm cannot load MLX-quantized"):
        place(state, model.model_id, "i1")


@pytest.mark.parametrize("quantization", ["", "bf16", "fp16"])
def test_unquantized_mlx_community_models_may_use_vllm(quantization):
    model = card("mlx-community/Llama-3.2-1B-Instruct-bf16", quantization=quantization)
    state = cluster(node("gpu", 80.0, engines=("vllm",), kind=NodeKind.CUDA), cards=(model,))
    assert place(state, model.model_id, "i1").engine == "vllm"


def test_mlx_quantized_models_avoid_cuda_nodes():
    state = cluster(
        node("gpu", 80.0, engines=("mlx", "vllm"), kind=NodeKind.CUDA), node("cpu", 4.0), cards=(MLX_4BIT,)
    )
    assert place(state, MLX_4BIT.model_id, "i1").node_id == "cpu"
    [on_gpu] = [
        o for o in placement_options(state, MLX_4BIT.model_id) if o.shards and option_label(o) == "gpu"
    ]
    assert not on_gpu.feasible
    assert on_gpu.reason == "MLX-quantized weights do not run on CUDA nodes"


def test_mlx_quantized_model_on_cuda_only_cluster_is_refused_with_reasons():
    state = cluster(node("gpu", 80.0, engines=("mlx", "vllm"), kind=NodeKind.CUDA), cards=(MLX_4BIT,))
    with pytest.raises(PlacementError) as refused:
        place(state, MLX_4BIT.model_id, "i1")
    message = str(refused.value)
    assert "gpu (mlx): MLX-quantized weights do not run on CUDA nodes" in message
    assert "vllm cannot load MLX-quantized weights (4bit)" in message


# --- preferences -------------------------------------------------------------------------------


def test_mlx_community_models_prefer_apple_then_cpu_then_cuda():
    apple = node("apple", 8.0, kind=NodeKind.APPLE)
    cpu = node("cpu", 64.0, kind=NodeKind.CPU)
    cuda = node("cuda", 128.0, engines=("mlx",), kind=NodeKind.CUDA)
    model = card("mlx-community/Llama-3.2-1B-Instruct", engines=("mlx",))  # unquantized: CUDA is allowed
    ranked = [
        option_label(o) for o in placement_options(cluster(apple, cpu, cuda, cards=(model,)), model.model_id)
    ]
    assert ranked[:3] == ["apple", "cpu", "cuda"]  # then the pipelines: more nodes come after
    assert place(cluster(cpu, cuda, cards=(model,)), model.model_id, "i1").node_id == "cpu"


def test_other_models_have_no_kind_preference():
    apple = node("apple", 8.0, kind=NodeKind.APPLE)
    cpu = node("cpu", 64.0, kind=NodeKind.CPU)
    assert place(cluster(apple, cpu, cards=(card(),)), "org/m", "i1").node_id == "cpu"


def test_node_that_already_holds_the_files_is_preferred():
    state = cluster(node("a", 8.0, cached=("org/m",)), node("b", 64.0), cards=(card(),))
    best = placement_options(state, "org/m")[0]
    assert option_label(best) == "a"
    assert best.reason == "fits with 6.70 GiB left; files cached"
    assert place(state, "org/m", "i1").node_id == "a"


def test_otherwise_the_most_memory_left_wins():
    state = cluster(node("a", 8.0), node("b", 64.0), node("c", 16.0), cards=(card(engines=("mlx",)),))
    assert [option_label(o) for o in placement_options(state, "org/m")][:3] == ["b", "c", "a"]


def test_engine_preference_is_by_memory_left_across_engines():
    state = cluster(node("a", 8.0, engines=("mlx",)), node("b", 16.0, engines=("vllm",)), cards=(card(),))
    assert place(state, "org/m", "i1").engine == "vllm"


# --- pipeline ----------------------------------------------------------------------------------


def test_default_caps_split_mlx_models_across_nodes_but_not_vllm_ones():
    assert ENGINE_FACTS["mlx"].pipeline and not ENGINE_FACTS["vllm"].pipeline
    assert ENGINE_FACTS["mlx"].memory_headroom == ENGINE_FACTS["vllm"].memory_headroom == 1.3
    nodes = [node(n, 1.0, engines=("mlx", "vllm")) for n in "abc"]
    options = placement_options(cluster(*nodes, cards=(card(storage=2.0),)), "org/m")
    assert [(o.engine, option_label(o)) for o in options if o.feasible] == [("mlx", "a+b+c")]
    splits = [o for o in options if not o.shards]
    assert [(o.engine, o.reason) for o in splits] == [
        ("vllm", "engine vllm cannot split a model across nodes")
    ]


def test_no_split_notice_when_a_single_node_fits():
    state = cluster(node("a", 1.0), node("b", 8.0), cards=(card(storage=2.0),))
    assert all(o.shards for o in placement_options(state, "org/m"))


def test_pipeline_splits_layers_in_proportion_to_free_memory():
    state = cluster(node("b", 30.0), node("a", 10.0), cards=(card(storage=24.0, layers=8, engines=("mlx",)),))
    options = placement_options(state, "org/m", caps=PIPELINE_CAPS)
    best = options[0]
    assert best.feasible
    assert best.shards == (  # ordered by node_id; 10:30 free -> 2:6 layers
        Shard(node_id="a", start_layer=0, end_layer=2),
        Shard(node_id="b", start_layer=2, end_layer=8),
    )
    assert best.memory_needed == {"a": int(7.8 * GiB) + 1, "b": int(23.4 * GiB) + 1}
    instance = place(state, "org/m", "i1", caps=PIPELINE_CAPS)
    assert (instance.node_id, instance.shards) == ("a", with_rings(best.shards, "a:52400", "b:52400"))


def test_pipeline_prefers_a_single_node_when_one_fits():
    state = cluster(node("a", 64.0), node("b", 64.0), cards=(card(engines=("mlx",)),))
    options = placement_options(state, "org/m", caps=PIPELINE_CAPS)
    assert [len(o.shards) for o in options] == [1, 1, 2]
    assert all(o.feasible for o in options)


@pytest.mark.parametrize(
    ("layers", "weights", "counts"),
    [
        (8, [10, 30], [2, 6]),
        (12, [20, 10, 10], [6, 3, 3]),
        (3, [1, 1000, 1], [1, 1, 1]),  # every shard keeps at least one layer
        (5, [1, 1], [3, 2]),  # ties go to the first node
        (80, [7, 3], [56, 24]),
    ],
)
def test_split_layers(layers, weights, counts):
    assert split_layers(layers, weights) == counts


def test_pipeline_never_uses_more_nodes_than_layers():
    state = cluster(*(node(n, 1.0) for n in "abcd"), cards=(card(storage=4.0, layers=2, engines=("mlx",)),))
    assert max(len(o.shards) for o in placement_options(state, "org/m", caps=PIPELINE_CAPS)) == 2


def test_pipeline_skips_nodes_the_rules_exclude():
    state = cluster(
        node("a", 4.0, kind=NodeKind.APPLE),
        node("b", 4.0, kind=NodeKind.APPLE),
        node("gpu", 80.0, engines=("mlx",), kind=NodeKind.CUDA),
        cards=(card("mlx-community/Big-4bit", storage=6.0, layers=4, quantization="4bit", engines=("mlx",)),),
    )
    best = place(state, "mlx-community/Big-4bit", "i1", caps=PIPELINE_CAPS)
    assert [s.node_id for s in best.shards] == ["a", "b"]


# --- pipeline rings ----------------------------------------------------------------------------

BIG = card("org/big", storage=10.0, layers=30, engines=("mlx",))  # needs 13 GiB: 6.5 GiB per half


def test_a_model_no_node_fits_is_split_evenly_over_two_equal_nodes_with_a_ring_address_each():
    state = cluster(node("a", 8.0), node("b", 8.0), cards=(BIG,))
    instance = place(state, "org/big", "i1")
    assert instance.shards == with_rings(
        shards_of(("a", 0, 15), ("b", 15, 30)), f"a:{RING_PORT_BASE}", f"b:{RING_PORT_BASE}"
    )
    assert (instance.node_id, instance.generation) == ("a", 0)


def test_a_single_node_that_fits_is_still_preferred_and_needs_no_ring():
    state = cluster(node("a", 8.0), node("b", 8.0), node("c", 14.0), cards=(BIG,))
    instance = place(state, "org/big", "i1")
    assert instance.shards == (Shard(node_id="c", start_layer=0, end_layer=30),)
    assert instance.shards[0].ring_address == ""


def test_nodes_on_one_ring_host_get_different_ports():
    state = cluster(node("a", 8.0, ring_host="10.0.0.5"), node("b", 8.0, ring_host="10.0.0.5"), cards=(BIG,))
    shards = place(state, "org/big", "i1").shards
    assert [s.ring_address for s in shards] == ["10.0.0.5:52400", "10.0.0.5:52401"]


def test_a_node_without_a_ring_host_listens_on_loopback():
    state = cluster(node("a", 8.0, ring_host=""), node("b", 8.0, ring_host=""), cards=(BIG,))
    assert [s.ring_address for s in place(state, "org/big", "i1").shards] == [
        "127.0.0.1:52400",
        "127.0.0.1:52401",
    ]


def test_ports_that_other_instances_ranks_hold_on_the_host_are_skipped():
    held = Instance(
        instance_id="i0",
        model_id="org/other",
        node_id="a",
        engine="mlx",
        status=InstanceStatus.FAILED,  # its processes may still be closing: its ports stay taken
        shards=with_rings(shards_of(("a", 0, 1), ("b", 1, 2)), "h:52400", "h:52401"),
    )
    nodes = (node("a", 8.0, ring_host="h"), node("b", 8.0, ring_host="h"))
    state = cluster(*nodes, cards=(BIG,), instances=(held,))
    shards = ring_addresses(state, shards_of(("a", 0, 15), ("b", 15, 30)), avoid={"h:52402"})
    assert [s.ring_address for s in shards] == ["h:52403", "h:52404"]


def test_a_host_whose_ring_ports_are_all_taken_is_refused():
    state = cluster(node("a", 8.0, ring_host="h"), node("b", 8.0), cards=(BIG,))
    taken = {f"h:{RING_PORT_BASE + i}" for i in range(RING_PORT_SPAN)}
    with pytest.raises(PlacementError, match=r"a: every ring port on h \(52400-52463\) is in use"):
        place(state, "org/big", "i1", avoid_ring=taken)


def test_placing_again_moves_to_new_ports_as_the_next_generation_keeping_the_role():
    state = cluster(node("a", 8.0, ring_host="h"), node("b", 8.0, ring_host="h"), cards=(BIG,))
    first = msgspec.structs.replace(place(state, "org/big", "i1"), role="decode", status=InstanceStatus.READY)
    state = msgspec.structs.replace(state, instances={"i1": first})
    again = placed_again(state, first)  # its own memory is free again: it fits the same nodes
    assert (again.instance_id, again.role, again.generation, again.status) == ("i1", "decode", 1, "placed")
    assert [s.node_id for s in again.shards] == ["a", "b"]
    assert [s.ring_address for s in again.shards] == ["h:52402", "h:52403"]
    assert placed_again(msgspec.structs.replace(state, instances={"i1": again}), again).generation == 2


def test_nodes_without_ring_ports_take_no_part_in_pipelines():
    state = cluster(node("a", 8.0), node("b", 8.0, ring_port_base=0), cards=(BIG, card()))
    with pytest.raises(PlacementError) as refused:
        place(state, "org/big", "i1")
    assert "b: takes no part in pipelines (FLEET_RING_PORT_BASE=0)" in str(refused.value)
    with pytest.raises(
        PlacementError, match=r"as asked: b: takes no part in pipelines \(FLEET_RING_PORT_BASE=0\)"
    ):
        place(state, "org/big", "i1", shards=shards_of(("a", 0, 15), ("b", 15, 30)))
    assert place(state, "org/m", "i2", shards=shards_of(("b", 0, 32))).node_id == "b"  # alone it may


def test_an_explicit_pipeline_gets_ring_addresses_too():
    state = cluster(node("a", 8.0), node("b", 8.0), cards=(BIG,))
    asked = shards_of(("b", 0, 15), ("a", 15, 30))
    instance = place(state, "org/big", "i1", shards=asked)
    assert instance.shards == with_rings(asked, "b:52400", "a:52400")
    assert place(state, "org/big", "i2", shards=with_rings(asked, "x:1", "y:2")).shards == instance.shards


# --- explicit placements -----------------------------------------------------------------------


def test_explicit_placement_that_fits_is_taken_as_is():
    state = cluster(node("a", 64.0), node("b", 64.0), cards=(card(engines=("mlx",)),))
    asked = shards_of(("b", 0, 10), ("a", 10, 32))
    instance = place(state, "org/m", "i1", engine="mlx", caps=PIPELINE_CAPS, shards=asked)
    assert (instance.node_id, instance.engine) == ("b", "mlx")
    assert instance.shards == with_rings(asked, "b:52400", "a:52400")
    single = place(state, "org/m", "i1", shards=shards_of(("a", 0, 32)))
    assert single.node_id == "a"


@pytest.mark.parametrize(
    ("shards", "caps", "problem"),
    [
        ((), PIPELINE_CAPS, "no shards given"),
        (shards_of(("z", 0, 32)), PIPELINE_CAPS, "node z is not in the cluster"),
        (
            shards_of(("a", 0, 16), ("b", 16, 32)),
            NO_PIPELINE_CAPS,
            "engine mlx cannot split a model across nodes",
        ),
        (shards_of(("a", 1, 16), ("b", 16, 32)), PIPELINE_CAPS, "shard on a starts at layer 1, expected 0"),
        (shards_of(("a", 0, 16), ("b", 15, 32)), PIPELINE_CAPS, "shard on b starts at layer 15, expected 16"),
        (shards_of(("a", 0, 16), ("b", 17, 32)), PIPELINE_CAPS, "shard on b starts at layer 17, expected 16"),
        (shards_of(("a", 0, 0), ("b", 0, 32)), PIPELINE_CAPS, "shard on a has no layers"),
        (shards_of(("a", 0, 16), ("b", 16, 30)), PIPELINE_CAPS, "shards end at layer 30, the model has 32"),
        (shards_of(("a", 0, 16), ("a", 16, 32)), PIPELINE_CAPS, "a node appears in more than one shard"),
        (shards_of(("vonly", 0, 32)), PIPELINE_CAPS, "vonly: no mlx engine"),
        (shards_of(("small", 0, 32)), PIPELINE_CAPS, r"needs 1\.30 GiB, 0\.50 GiB free"),
        (shards_of(("a", 0, 31), ("small", 31, 32)), PIPELINE_CAPS, r"a: needs 1\.26 GiB, 1\.00 GiB free"),
    ],
)
def test_explicit_placement_errors_name_the_problem(shards, caps, problem):
    state = cluster(
        node("a", 1.0),
        node("b", 8.0),
        node("small", 0.5),
        node("vonly", 8.0, engines=("vllm",)),
        cards=(card(),),
    )
    with pytest.raises(PlacementError, match=f"cannot place org/m as asked: {problem}"):
        place(state, "org/m", "i1", engine="mlx", caps=caps, shards=shards)


def test_explicit_placement_tries_each_supported_engine():
    state = cluster(node("a", 8.0, engines=("vllm",)), cards=(card(),))
    assert place(state, "org/m", "i1", shards=shards_of(("a", 0, 32))).engine == "vllm"


# --- refusals, order, determinism --------------------------------------------------------------


def test_refusal_lists_why_each_node_was_refused():
    state = cluster(node("a", 0.5), node("b", 64.0, engines=("vllm",)), cards=(card("HuggingFaceTB/X"),))
    with pytest.raises(PlacementError) as refused:
        place(state, "HuggingFaceTB/X", "i1", engine="mlx")
    assert str(refused.value) == (
        "no node fits HuggingFaceTB/X (needs 1.30 GiB): a: needs 1.30 GiB, 0.50 GiB free; b: no mlx engine"
    )


def test_refusal_names_the_engine_and_groups_nodes_refused_alike():
    state = cluster(node("a", 0.5), node("b", 0.25), node("c", 0.5, engines=("vllm",)), cards=(card(),))
    with pytest.raises(PlacementError) as refused:
        place(state, "org/m", "i1")
    assert str(refused.value) == (
        "no node fits org/m (needs 1.30 GiB): "
        "a (mlx): needs 1.30 GiB, 0.50 GiB free; b (mlx): needs 1.30 GiB, 0.25 GiB free; "
        "c (mlx): no mlx engine; "
        "a+b (mlx): a: needs 0.85 GiB, 0.50 GiB free, b: needs 0.45 GiB, 0.25 GiB free; "
        "a, b (vllm): no vllm engine; c (vllm): needs 1.30 GiB, 0.50 GiB free"
    )


def test_options_are_sorted_feasible_first_then_by_score():
    state = cluster(
        node("a", 0.5), node("b", 4.0), node("c", 64.0, engines=("vllm",)), node("d", 2.0), cards=(card(),)
    )
    options = placement_options(state, "org/m")
    feasible = [o.feasible for o in options]
    assert feasible == sorted(feasible, reverse=True)
    assert [o.score for o in options if o.feasible] == sorted(
        (o.score for o in options if o.feasible), reverse=True
    )
    assert [(o.engine, option_label(o)) for o in options if o.feasible] == [
        ("vllm", "c"),
        ("mlx", "b"),
        ("mlx", "d"),
        ("mlx", "b+d"),  # single nodes first, then the fewest nodes
        ("mlx", "a+b+d"),
    ]


def test_same_input_gives_same_output():
    nodes = [node(n, 4.0) for n in "dcba"]
    forward = cluster(*nodes, cards=(card(storage=8.0),))
    backward = cluster(*reversed(nodes), cards=(card(storage=8.0),))
    for caps in (ENGINE_FACTS, PIPELINE_CAPS):
        assert placement_options(forward, "org/m", caps) == placement_options(backward, "org/m", caps)
    assert place(forward, "org/m", "i1", caps=PIPELINE_CAPS) == place(
        backward, "org/m", "i1", caps=PIPELINE_CAPS
    )
    small = cluster(*nodes, cards=(card(),))
    assert place(small, "org/m", "i1").node_id == "a"  # tie: lowest node_id
    with pytest.raises(PlacementError) as forward_refusal:
        place(forward, "org/m", "i1", caps=NO_PIPELINE_CAPS)
    with pytest.raises(PlacementError) as backward_refusal:
        place(backward, "org/m", "i1", caps=NO_PIPELINE_CAPS)
    assert str(forward_refusal.value) == str(backward_refusal.value)


# --- properties --------------------------------------------------------------------------------

nodes_strategy = st.lists(
    st.builds(
        lambda free, engines, kind, cached: (free, engines, kind, cached),
        st.integers(0, 64 * GiB),
        st.sets(st.sampled_from(["mlx", "vllm"])).map(lambda s: tuple(sorted(s))),
        st.sampled_from(list(NodeKind)),
        st.booleans(),
    ),
    min_size=1,
    max_size=6,
)
cards_strategy = st.builds(
    lambda model_id, storage, layers, quantization, engines: card(
        model_id, storage, layers, quantization, engines
    ),
    st.sampled_from(["org/m", "mlx-community/m"]),
    st.integers(1, 80 * GiB),
    st.integers(1, 96),
    st.sampled_from(["", "4bit", "mlx-8bit", "bf16", "fp8"]),
    st.sets(st.sampled_from(["mlx", "vllm"]), min_size=1).map(lambda s: tuple(sorted(s))),
)


@settings(max_examples=200, deadline=None)
@given(nodes_strategy, cards_strategy, st.booleans())
def test_feasible_options_fit_and_cover_every_layer_once(node_specs, model, pipeline):
    nodes = [
        node(f"n{i}", free, engines, kind, (model.model_id,) if cached else ())
        for i, (free, engines, kind, cached) in enumerate(node_specs)
    ]
    state = cluster(*nodes, cards=(model,))
    caps = PIPELINE_CAPS if pipeline else NO_PIPELINE_CAPS
    options = placement_options(state, model.model_id, caps)
    assert options == placement_options(state, model.model_id, caps)
    assert [o.feasible for o in options] == sorted((o.feasible for o in options), reverse=True)
    for option in (o for o in options if o.feasible):
        for node_id, needed in option.memory_needed.items():
            assert needed <= state.nodes[node_id].memory_available_bytes
            assert option.free_after[node_id] == state.nodes[node_id].memory_available_bytes - needed >= 0
        assert option.shards[0].start_layer == 0
        assert option.shards[-1].end_layer == model.num_layers
        for prev, nxt in zip(option.shards, option.shards[1:], strict=False):
            assert prev.end_layer == nxt.start_layer
        assert all(s.end_layer > s.start_layer for s in option.shards)
        assert len({s.node_id for s in option.shards}) == len(option.shards)
        assert pipeline or len(option.shards) == 1
    if any(o.feasible for o in options):
        instance = place(state, model.model_id, "i1", caps=caps)
        assert [msgspec.structs.replace(s, ring_address="") for s in instance.shards] == list(
            options[0].shards
        )
        assert all(s.ring_address for s in instance.shards) == (len(instance.shards) > 1)
    else:
        with pytest.raises(PlacementError):
            place(state, model.model_id, "i1", caps=caps)


def test_options_travel_in_a_placements_reply():
    state = cluster(node("a", 8.0, cached=("org/m",)), node("b", 0.5), cards=(card(),))
    reply = PlacementsReply(options=tuple(placement_options(state, "org/m", PIPELINE_CAPS)))
    assert msgspec.json.decode(msgspec.json.encode(reply), type=PlacementsReply) == reply


def test_an_explicit_placement_on_a_node_without_the_engine_is_refused():
    state = cluster(node("a", 10.0), node("b", 10.0, engines=()), cards=(card(),))
    whole = (Shard(node_id="b", start_layer=0, end_layer=card().num_layers),)
    with pytest.raises(PlacementError, match="b: no mlx engine"):
        place(state, "org/m", "i1", shards=whole)


def test_a_card_staged_before_cards_had_their_name_facts_is_placed_as_a_new_one() -> None:
    from fleet_scheduler.placement import staged_card

    old = msgspec.structs.replace(card("mlx-community/Old-4bit", quantization="4bit"), quantization_format="")
    state = State(models={old.model_id: old})
    assert staged_card(state, old.model_id).quantization_format == "mlx"
