"""Routing rules: load, the measured (else MLX) decode preference, base-model matching, prefill endpoints."""

from __future__ import annotations

import msgspec
import pytest

from fleet_proto import (
    EmbeddingFacts,
    EngineCalibration,
    EngineInfo,
    Instance,
    InstancePlaced,
    InstanceReady,
    ModelCard,
    ModelStaged,
    NodeJoined,
    RouteReply,
    RouteRequest,
    Shard,
)
from fleet_proto.messages import EMBED_TASK
from fleet_proto.routing import route, routed_work
from fleet_proto.testing import bare_node, state_of

pytestmark = pytest.mark.unit


def card(model_id: str, base: str) -> ModelStaged:
    return ModelStaged(
        card=ModelCard(
            model_id=model_id,
            architecture="llama",
            num_layers=2,
            hidden_size=64,
            num_kv_heads=2,
            head_dim=16,
            dtype="bfloat16",
            storage_bytes=1,
            base_model=base,
        )
    )


def ready(instance_id: str, model_id: str = "m", engine: str = "mlx", role: str = "both", node: str = ""):
    node = node or f"n-{instance_id}"
    instance = Instance(instance_id=instance_id, model_id=model_id, node_id=node, engine=engine, role=role)
    return (InstancePlaced(instance=instance), InstanceReady(instance_id=instance_id))


REQUEST = RouteRequest(request_id="r", model_id="m", prompt_tokens=10)


def test_mlx_decode_is_preferred_over_vllm_even_when_busier():
    state = state_of(*ready("a", engine="vllm"), *ready("b", engine="mlx"))
    reply = route(state, REQUEST, {"a": 0, "b": 5000})
    assert reply.instance_id == "b"
    assert "mlx" in reply.reason


def test_least_loaded_by_tokens_among_the_preferred_engine():
    state = state_of(*ready("a"), *ready("b"), *ready("c", engine="vllm"))
    assert route(state, REQUEST, {"a": 300, "b": 200, "c": 0}).instance_id == "b"


def test_same_base_model_serves_when_the_exact_model_has_no_instance():
    state = state_of(
        card("m", "Llama-3.2-1B-Instruct"),
        card("mlx-community/m-4bit", "Llama-3.2-1B-Instruct"),
        *ready("q", model_id="mlx-community/m-4bit"),
    )
    reply = route(state, REQUEST, {})
    assert reply.instance_id == "q"
    assert "same base model" in reply.reason


LONG = RouteRequest(request_id="r", model_id="m", prompt_tokens=1500)


def test_a_long_uncached_prompt_is_prefilled_by_the_prefill_instance():
    state = state_of(*ready("p", role="prefill", engine="vllm"), *ready("d", role="decode"))
    reply = route(state, LONG, {})
    assert (reply.instance_id, reply.prefill_instance_id, reply.prefill_worker_id) == ("d", "p", "n-p")
    assert "prefill on vllm p (1500 uncached tokens > 1000)" in reply.reason


def test_a_short_prompt_is_prefilled_where_it_decodes():
    state = state_of(*ready("p", role="prefill", engine="vllm"), *ready("d", role="decode"))
    reply = route(state, REQUEST, {})
    assert (reply.instance_id, reply.prefill_instance_id) == ("d", "")


def test_cached_tokens_do_not_count_towards_the_threshold():
    state = state_of(*ready("p", role="prefill", engine="vllm"), *ready("d", role="decode", node="n1"))
    assert route(state, LONG, {}, cached={"n1": 1024}).prefill_instance_id == ""
    assert route(state, LONG, {}, tier2_tokens=1024).prefill_instance_id == ""
    assert route(state, LONG, {}, disagg_min_tokens=100, tier2_tokens=1024).prefill_instance_id == "p"


def test_the_request_can_force_or_forbid_remote_prefill():
    state = state_of(*ready("p", role="prefill", engine="vllm"), *ready("d", role="decode"))
    forced = RouteRequest(request_id="r", model_id="m", prompt_tokens=10, disaggregate="always")
    assert route(state, forced, {}).prefill_instance_id == "p"
    never = RouteRequest(request_id="r", model_id="m", prompt_tokens=5000, disaggregate="never")
    assert route(state, never, {}).prefill_instance_id == ""


def test_prefill_partner_prefers_role_prefill_then_vllm_then_least_load():
    state = state_of(
        *ready("d", role="decode"),
        *ready("b1", role="both", engine="vllm"),
        *ready("p1", role="prefill", engine="mlx"),
        *ready("p2", role="prefill", engine="vllm"),
        *ready("p3", role="prefill", engine="vllm"),
    )
    assert route(state, LONG, {"d": 0, "p2": 900, "p3": 10}).prefill_instance_id == "p3"
    two_both = state_of(*ready("a", role="both"), *ready("b", role="both", engine="vllm"))
    reply = route(two_both, LONG, {})
    assert (reply.instance_id, reply.prefill_instance_id) == ("a", "b")


def test_any_pair_of_engines_disaggregates():
    state = state_of(*ready("v", role="decode", engine="vllm"), *ready("p", role="prefill"))
    assert route(state, LONG, {}).prefill_instance_id == "p"  # MLX prefill -> vLLM decode


def test_an_engine_that_cannot_take_kv_in_decodes_alone():
    state = state_of(*ready("x", role="decode", engine="echo"), *ready("p", role="prefill"))
    assert route(state, LONG, {}).prefill_instance_id == ""


def pipelined(instance_id: str, engine: str = "mlx", role: str = "both"):
    shards = (
        Shard(node_id=f"{instance_id}-0", start_layer=0, end_layer=1, ring_address="h0:52400"),
        Shard(node_id=f"{instance_id}-1", start_layer=1, end_layer=2, ring_address="h1:52400"),
    )
    instance = Instance(
        instance_id=instance_id,
        model_id="m",
        node_id=shards[0].node_id,
        engine=engine,
        role=role,
        shards=shards,
    )
    return (InstancePlaced(instance=instance), InstanceReady(instance_id=instance_id))


def test_pipeline_instances_prefill_and_decode_disaggregated_like_any_other():
    # rank 0 is a pipeline's one handoff endpoint: its node is the instance's node
    decoder = state_of(*pipelined("pd", role="decode"), *ready("p", role="prefill", engine="vllm"))
    reply = route(decoder, LONG, {})
    assert (reply.instance_id, reply.prefill_instance_id) == ("pd", "p")
    prefiller = state_of(*ready("d", role="decode"), *pipelined("pp", role="prefill", engine="mlx"))
    reply = route(prefiller, LONG, {})
    assert (reply.instance_id, reply.prefill_instance_id, reply.prefill_worker_id) == ("d", "pp", "pp-0")


def test_only_a_prefill_instance_is_no_route():
    state = state_of(*ready("p", role="prefill"))
    assert route(state, REQUEST, {}).error == "no ready instance of m"


def test_a_cached_prefix_outweighs_a_little_load():
    state = state_of(*ready("a", node="n1"), *ready("b", node="n2"))
    long_prompt = RouteRequest(request_id="r", model_id="m", prompt_tokens=2000)
    # n2 holds 1,792 of the 2,000 prompt tokens: 300 tokens of load there cost less than prefilling
    reply = route(state, long_prompt, {"a": 0, "b": 300}, cached={"n2": 1792}, tier2_tokens=1792)
    assert reply.instance_id == "b"
    assert "1792 of 2000 prompt tokens cached in memory" in reply.reason
    assert "object storage holds 1792" in reply.reason


def test_a_cache_hit_does_not_beat_a_much_busier_instance():
    state = state_of(*ready("a", node="n1"), *ready("b", node="n2"))
    long_prompt = RouteRequest(request_id="r", model_id="m", prompt_tokens=2000)
    assert route(state, long_prompt, {"a": 0, "b": 5000}, cached={"n2": 1792}).instance_id == "a"


def test_avoided_nodes_are_not_routed_to_nor_asked_to_prefill():
    state = state_of(*ready("a"), *ready("b"), *ready("p", engine="vllm", role="prefill"))
    request = msgspec.structs.replace(REQUEST, prompt_tokens=5000, avoid_nodes=("n-a",))
    reply = route(state, request, {"a": 0, "b": 900})
    assert reply.instance_id == "b" and reply.prefill_instance_id == "p"
    avoiding_all = msgspec.structs.replace(request, avoid_nodes=("n-a", "n-b", "n-p"))
    refused = route(state, avoiding_all, {})
    assert not refused.instance_id and refused.error == "no ready instance of m off nodes n-a, n-b, n-p"
    no_prefill = msgspec.structs.replace(request, avoid_nodes=("n-p",))
    assert route(state, no_prefill, {}).prefill_instance_id == "b"  # the next best, not the avoided p


def test_llama_cpp_and_the_safetensors_engines_hand_kv_to_each_other():
    # one wire layout: llama.cpp's permuted K is converted at its edge (engines/llamacpp/kv.py)
    for decoder, prefiller in (("llamacpp", "vllm"), ("llamacpp", "llamacpp"), ("mlx", "llamacpp")):
        state = state_of(
            *ready("d", role="decode", engine=decoder), *ready("p", role="prefill", engine=prefiller)
        )
        assert route(state, LONG, {}).prefill_instance_id == "p", (decoder, prefiller)


def joined(node_id: str, *speeds: tuple[str, float, float]) -> NodeJoined:
    """A node whose worker measured (engine, prefill tok/s, decode tok/s) on model m."""
    calibrations = tuple(
        EngineCalibration(
            engine=engine,
            engine_version="1",
            model_id="m",
            prefill_tokens_per_s=prefill,
            decode_tokens_per_s=decode,
            prompt_tokens=128,
            completion_tokens=32,
            at=1.0,
        )
        for engine, prefill, decode in speeds
    )
    engines = tuple(EngineInfo(name=e, version="1") for e, _, _ in speeds)
    info = msgspec.structs.replace(bare_node(node_id), engines=engines, calibrations=calibrations)
    return NodeJoined(node=info)


def test_the_engine_measured_to_decode_fastest_is_preferred_over_mlx():
    state = state_of(
        joined("n-a", ("llamacpp", 150, 44)),
        joined("n-b", ("mlx", 260, 15)),
        *ready("a", engine="llamacpp"),
        *ready("b", engine="mlx"),
    )
    reply = route(state, REQUEST, {"a": 5000, "b": 0})
    assert reply.instance_id == "a" and "llamacpp" in reply.reason


def test_the_mlx_preference_holds_while_any_candidate_is_unmeasured():
    state = state_of(joined("n-a", ("llamacpp", 150, 44)), *ready("a", engine="llamacpp"), *ready("b"))
    assert route(state, REQUEST, {"a": 5000, "b": 0}).instance_id == "b"


def test_the_prefill_partner_measured_fastest_at_prefill_is_preferred_over_vllm():
    state = state_of(
        joined("n-v", ("vllm", 400, 12)),
        joined("n-m2", ("mlx", 900, 15)),
        *ready("v", engine="vllm"),
        *ready("m2", engine="mlx"),
        *ready("d", role="decode", engine="mlx"),
    )
    assert route(state, LONG, {}).prefill_instance_id == "m2"


def embedding_card(model_id: str, base: str = "") -> ModelStaged:
    staged = card(model_id, base or model_id)
    facts = EmbeddingFacts(dimensions=384, pooling="mean", normalize=True, max_tokens=256)
    return ModelStaged(card=msgspec.structs.replace(staged.card, embedding=facts))


def test_an_embedding_request_goes_to_the_least_loaded_instance_of_the_embedding_model():
    state = state_of(embedding_card("e"), *ready("a", "e"), *ready("b", "e"), card("m", "m"), *ready("c"))
    embed = RouteRequest(request_id="r", model_id="e", prompt_tokens=40, task=EMBED_TASK)
    reply = route(state, embed, {"a": 300, "b": 20, "c": 0})
    assert (reply.instance_id, reply.prefill_instance_id) == ("b", "")
    assert "least loaded of 2 ready" in reply.reason


def test_embeddings_and_generation_never_cross():
    # a chat model of the same base as the embedding model does not serve its embeddings, nor the reverse
    state = state_of(embedding_card("e", base="x"), card("m", "x"), *ready("c"))
    embed = RouteRequest(request_id="r", model_id="e", prompt_tokens=4, task=EMBED_TASK)
    assert route(state, embed, {}).error == "no ready instance of e"
    assert route(state, msgspec.structs.replace(embed, model_id="m"), {}).error == "m is no embedding model"
    state = state_of(embedding_card("e", base="x"), *ready("a", "e"), card("m", "x"))
    generate = RouteRequest(request_id="r", model_id="m", prompt_tokens=4)
    assert route(state, generate, {}).error == "no ready instance of m"
    refused = route(state, msgspec.structs.replace(generate, model_id="e"), {})
    assert refused.error == "e is an embedding model: it serves embeddings only"


# ---- policies (FLEET_ROUTING_POLICY), and what a router remembers for engines that index nothing ----

CHAT = RouteRequest(request_id="r", model_id="m", prompt_tokens=1000)


def test_round_robin_takes_the_instances_in_turn_whatever_their_load_and_cache():
    state = state_of(*ready("a"), *ready("b"), *ready("c"))
    picks = [
        route(state, CHAT, {"a": 0, "b": 9000}, {"n-c": 1000}, policy="round-robin", turn=t).instance_id
        for t in range(4)
    ]
    assert picks == ["a", "b", "c", "a"]


def test_least_loaded_ignores_the_cache():
    state = state_of(*ready("a"), *ready("b"))
    reply = route(state, CHAT, {"a": 10, "b": 0}, {"n-a": 1000}, policy="least-loaded")
    assert reply.instance_id == "b" and reply.reason.startswith("least loaded")


def test_kv_aware_weighs_the_cached_prefix_against_the_load():
    state = state_of(*ready("a"), *ready("b"))
    assert route(state, CHAT, {"a": 500, "b": 0}, {"n-a": 1000}).instance_id == "a"  # 500 < 1000
    assert route(state, CHAT, {"a": 1500, "b": 0}, {"n-a": 1000}).instance_id == "b"  # 1500 > 1000


def test_what_the_router_sent_counts_only_for_an_engine_whose_kv_is_not_indexed():
    llama = state_of(*ready("a", engine="llamacpp"), *ready("b", engine="llamacpp"))
    reply = route(llama, CHAT, {"a": 200, "b": 0}, remembered={"a": 768})
    assert reply.instance_id == "a" and "768 of 1000 prompt tokens cached" in reply.reason
    # an MLX instance's KV is in the index: the index, not the router's memory, says what it holds
    mlx = state_of(*ready("a"), *ready("b"))
    assert route(mlx, CHAT, {"a": 200, "b": 0}, remembered={"a": 768}).instance_id == "b"


def test_a_routed_request_weighs_on_its_instance_with_the_tokens_new_to_it():
    llama = state_of(*ready("a", engine="llamacpp"), *ready("c", engine="llamacpp"))
    to_a = route(llama, CHAT, {"a": 0, "c": 0}, remembered={"a": 768})
    assert (to_a.instance_id, to_a.cached_tokens) == ("a", 768)  # what the reply expects there
    assert routed_work(to_a, CHAT) == {"a": 232}
    state = state_of(*ready("b"), *ready("p", role="prefill", engine="vllm"))
    to_b = route(state, CHAT, {"b": 0}, {"n-b": 256}, tier2_tokens=512)
    assert (to_b.instance_id, to_b.cached_tokens) == ("b", 512)  # object storage holds more
    assert routed_work(to_b, CHAT) == {"b": 488}
    split = msgspec.structs.replace(to_b, prefill_instance_id="p", prefill_worker_id="n-p", cached_tokens=0)
    assert routed_work(split, CHAT) == {"b": 1000, "p": 1000}
    assert routed_work(RouteReply(error="no ready instance"), CHAT) == {}
