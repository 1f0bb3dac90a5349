"""Engines chosen by the node's measurements (fleet_proto.speed, placement, engine_choice): pure."""

from __future__ import annotations

import msgspec
import pytest

from fleet_proto import EngineCalibration, Instance, InstanceStatus, NodeInfo, NodeKind
from fleet_proto.speed import MEASURED, PRIOR, engine_order, reference_seconds
from fleet_scheduler.engine_choice import UPGRADE_MARGIN, faster_engine, moved_to_engine
from fleet_scheduler.placement import place, placement_options

from .test_placement_rules import card, cluster, node

pytestmark = pytest.mark.unit

GGUF_CARD = card("org/m", engines=("mlx", "vllm", "llamacpp"))


def measured(engine: str, prefill: float, decode: float, model_id: str = "org/m", version: str = "1"):
    return EngineCalibration(
        engine=engine,
        engine_version=version,
        model_id=model_id,
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=decode,
        prompt_tokens=128,
        completion_tokens=32,
        at=1.0,
    )


def calibrated(info: NodeInfo, *entries: EngineCalibration) -> NodeInfo:
    return msgspec.structs.replace(info, calibrations=entries)


ENGINES = ("mlx", "vllm", "llamacpp")
# As measured on this project's x86 CPU (SmolLM2-135M): llama.cpp decodes fastest.
CPU_MEASURED = (measured("mlx", 260, 15), measured("vllm", 430, 12), measured("llamacpp", 150, 44))


def test_reference_seconds_adds_prefill_and_decode_time() -> None:
    assert reference_seconds(measured("x", 512, 128)) == 2.0


def test_engines_rank_by_measurement_only_when_every_one_is_measured() -> None:
    full = calibrated(node("n", 8.0, ENGINES), *CPU_MEASURED)
    assert engine_order(full, "org/m", ENGINES) == (["llamacpp", "mlx", "vllm"], MEASURED)
    partial = calibrated(node("n", 8.0, ENGINES), measured("vllm", 5000, 500))
    assert engine_order(partial, "org/m", ENGINES) == (["llamacpp", "mlx", "vllm"], PRIOR)
    apple = node("n", 8.0, ENGINES, kind=NodeKind.APPLE)
    assert engine_order(apple, "org/m", ENGINES)[0][0] == "mlx"


def test_an_embedding_model_goes_by_the_embedding_prior() -> None:
    # calibrations measure generation: an embedding model is ranked by what fleet bench embed measured
    cpu = calibrated(node("n", 8.0, ENGINES), *CPU_MEASURED)
    assert engine_order(cpu, "org/m", ("mlx", "vllm"), embedding=True) == (["vllm", "mlx"], PRIOR)
    apple = node("n", 8.0, ENGINES, kind=NodeKind.APPLE)
    assert engine_order(apple, "org/m", ("vllm", "mlx"), embedding=True)[0] == ["mlx", "vllm"]


def test_a_measurement_of_another_engine_version_or_model_does_not_count() -> None:
    stale = calibrated(
        node("n", 8.0, ("mlx", "vllm")), measured("mlx", 1, 1), measured("vllm", 9, 9, version="0.old")
    )
    assert engine_order(stale, "org/m", ("mlx", "vllm"))[1] == PRIOR
    other = calibrated(node("n", 8.0, ("mlx", "vllm")), measured("mlx", 1, 1), measured("vllm", 9, 9, "o/x"))
    assert engine_order(other, "org/m", ("mlx", "vllm"))[1] == PRIOR


def test_placement_prefers_the_engine_the_node_measured_fastest() -> None:
    # vLLM measured fastest here: it beats the CPU prior (llama.cpp first) and the card's order.
    fast_vllm = (measured("mlx", 100, 5), measured("vllm", 2000, 80), measured("llamacpp", 150, 44))
    state = cluster(calibrated(node("n", 8.0, ENGINES), *fast_vllm), cards=(GGUF_CARD,))
    best = placement_options(state, "org/m")[0]
    assert best.engine == "vllm" and "vllm measured 2000 prefill / 80.0 decode tok/s here" in best.reason
    assert place(state, "org/m", "i1").engine == "vllm"


def test_unmeasured_nodes_place_by_their_kind_prior() -> None:
    state = cluster(node("n", 8.0, ENGINES), cards=(GGUF_CARD,))
    best = placement_options(state, "org/m")[0]
    assert best.engine == "llamacpp" and "by the cpu prior" in best.reason
    apple = cluster(node("a", 8.0, ENGINES, kind=NodeKind.APPLE), cards=(GGUF_CARD,))
    assert place(apple, "org/m", "i1").engine == "mlx"


def test_an_asked_for_engine_is_placed_whatever_was_measured() -> None:
    state = cluster(calibrated(node("n", 8.0, ENGINES), *CPU_MEASURED), cards=(GGUF_CARD,))
    assert place(state, "org/m", "i1", engine="vllm").engine == "vllm"


def test_speed_does_not_outrank_memory_feasibility() -> None:
    # the fastest engine's node has no room: the next node, by its own ranking, wins
    small = calibrated(node("a", 0.5, ENGINES), *CPU_MEASURED)
    roomy = node("b", 8.0, ENGINES)
    instance = place(cluster(small, roomy, cards=(GGUF_CARD,)), "org/m", "i1")
    assert (instance.node_id, instance.engine) == ("b", "llamacpp")


def ready(engine: str, **fields) -> Instance:
    return Instance(
        instance_id="i1", model_id="org/m", node_id="n", engine=engine, status=InstanceStatus.READY, **fields
    )


def test_an_instance_moves_to_the_engine_its_node_measured_faster() -> None:
    apple_first = calibrated(node("n", 8.0, ENGINES, kind=NodeKind.APPLE), *CPU_MEASURED)
    mlx = ready("mlx")
    state = cluster(apple_first, cards=(GGUF_CARD,), instances=(mlx,))
    assert faster_engine(state, mlx) == "llamacpp"
    moved = moved_to_engine(state, mlx, "llamacpp")
    assert (moved.instance_id, moved.engine, moved.generation, moved.node_id) == ("i1", "llamacpp", 1, "n")
    assert not moved.engine_pinned and moved.status == InstanceStatus.PLACED


def test_instances_stay_when_pinned_disaggregated_unready_unmeasured_or_barely_slower() -> None:
    info = calibrated(node("n", 8.0, ENGINES), *CPU_MEASURED)
    for instance in (
        ready("mlx", engine_pinned=True),
        ready("mlx", role="decode"),
        msgspec.structs.replace(ready("mlx"), status=InstanceStatus.LOADING),
        ready("llamacpp"),
    ):
        assert faster_engine(cluster(info, cards=(GGUF_CARD,), instances=(instance,)), instance) == ""
    unmeasured = cluster(node("n", 8.0, ENGINES), cards=(GGUF_CARD,), instances=(ready("mlx"),))
    assert faster_engine(unmeasured, ready("mlx")) == ""
    # llama.cpp only slightly faster than MLX: not worth a reload
    close = calibrated(
        node("n", 8.0, ("mlx", "llamacpp")), measured("mlx", 100, 10), measured("llamacpp", 100, 10 / 0.9)
    )
    assert reference_seconds(close.calibrations[1]) > UPGRADE_MARGIN * reference_seconds(
        close.calibrations[0]
    )
    assert faster_engine(cluster(close, cards=(GGUF_CARD,), instances=(ready("mlx"),)), ready("mlx")) == ""
