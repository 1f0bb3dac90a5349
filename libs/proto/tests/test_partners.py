"""Prefill partners by base model and measured benefit: who may prefill for a decoder, and when it pays."""

from __future__ import annotations

import msgspec
import pytest

from fleet_proto import (
    EngineCalibration,
    EngineInfo,
    Instance,
    InstancePlaced,
    InstanceReady,
    ModelCard,
    ModelStaged,
    NodeJoined,
    RouteRequest,
)
from fleet_proto.partners import partner_table, plan_prefill, remote_seconds, weight_bits
from fleet_proto.routing import route
from fleet_proto.testing import bare_node, state_of

pytestmark = pytest.mark.unit

FULL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FOUR_BIT = "mlx-community/SmolLM2-135M-Instruct-4bit"
OTHER = "Qwen/Qwen3-0.6B"


def card(model_id: str, base: str, quantization: str = "", dtype: str = "bfloat16") -> ModelStaged:
    return ModelStaged(
        card=ModelCard(
            model_id=model_id,
            architecture="llama",
            num_layers=30,
            hidden_size=576,
            num_kv_heads=3,
            head_dim=64,
            dtype=dtype,
            storage_bytes=1,
            quantization=quantization,
            base_model=base,
        )
    )


CARDS = (
    card(FULL, "SmolLM2-135M-Instruct", dtype="float32"),
    card(FOUR_BIT, "SmolLM2-135M-Instruct", quantization="mlx-4bit"),
    card(OTHER, "Qwen3-0.6B"),
)


def ready(instance_id: str, model_id: str, engine: str, role: str = "both"):
    instance = Instance(
        instance_id=instance_id, model_id=model_id, node_id=f"n-{instance_id}", engine=engine, role=role
    )
    return (InstancePlaced(instance=instance), InstanceReady(instance_id=instance_id))


def measured(instance_id: str, model_id: str, engine: str, prefill: float) -> NodeJoined:
    """The node of `instance_id`, whose worker measured `engine` prefilling `model_id` at `prefill` tok/s."""
    node = f"n-{instance_id}"
    calibration = EngineCalibration(
        engine=engine,
        engine_version="1",
        model_id=model_id,
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=30,
        prompt_tokens=512,
        completion_tokens=32,
        at=1.0,
    )
    engines = (EngineInfo(name=engine, version="1"),)
    info = msgspec.structs.replace(bare_node(node), engines=engines, calibrations=(calibration,))
    return NodeJoined(node=info)


def long_request(model_id: str, tokens: int = 1500) -> RouteRequest:
    return RouteRequest(request_id="r", model_id=model_id, prompt_tokens=tokens)


def test_a_vllm_instance_of_the_full_weights_prefills_for_a_role_less_4bit_mlx_decoder() -> None:
    state = state_of(*CARDS, *ready("q", FOUR_BIT, "mlx"), *ready("v", FULL, "vllm"))
    reply = route(state, long_request(FOUR_BIT), {})
    assert (reply.instance_id, reply.prefill_instance_id, reply.prefill_worker_id) == ("q", "v", "n-v")
    assert "prefill on vllm v (1500 uncached tokens > 1000)" in reply.reason


def test_less_precise_weights_never_prefill_for_a_more_precise_decoder() -> None:
    state = state_of(*CARDS, *ready("q", FOUR_BIT, "mlx"), *ready("v", FULL, "vllm"))
    reply = route(state, long_request(FULL), {})
    assert (reply.instance_id, reply.prefill_instance_id) == ("v", "")
    assert "no instance can prefill for it" in reply.reason


def test_another_base_model_a_decode_role_or_an_unknown_card_is_no_partner() -> None:
    unrelated = state_of(*CARDS, *ready("q", FOUR_BIT, "mlx"), *ready("o", OTHER, "vllm"))
    assert route(unrelated, long_request(FOUR_BIT), {}).prefill_instance_id == ""
    decode_only = state_of(*CARDS, *ready("q", FOUR_BIT, "mlx"), *ready("v", FULL, "vllm", role="decode"))
    assert route(decode_only, long_request(FOUR_BIT), {}).prefill_instance_id == ""
    no_card = state_of(CARDS[1], *ready("q", FOUR_BIT, "mlx"), *ready("v", FULL, "vllm"))
    assert route(no_card, long_request(FOUR_BIT), {}).prefill_instance_id == ""


def test_measured_speeds_decide_even_below_the_token_threshold() -> None:
    state = state_of(
        *CARDS,
        measured("q", FOUR_BIT, "mlx", 150),
        measured("v", FULL, "vllm", 3000),
        *ready("q", FOUR_BIT, "mlx"),
        *ready("v", FULL, "vllm"),
    )
    reply = route(state, long_request(FOUR_BIT, 600), {})
    assert reply.prefill_instance_id == "v"
    assert "measured 0.25 s there vs 4.00 s here for 600 uncached tokens" in reply.reason


def test_a_partner_measured_slower_than_the_decoder_is_not_used_however_long_the_prompt() -> None:
    state = state_of(
        *CARDS,
        measured("q", FOUR_BIT, "mlx", 900),
        measured("v", FULL, "vllm", 400),
        *ready("q", FOUR_BIT, "mlx"),
        *ready("v", FULL, "vllm"),
    )
    reply = route(state, long_request(FOUR_BIT, 4000), {})
    assert reply.prefill_instance_id == ""
    assert "prefilled here: vllm v measured 10.05 s there vs 4.44 s here" in reply.reason


def test_a_slow_link_or_a_busy_partner_makes_local_prefill_win() -> None:
    state = state_of(
        *CARDS,
        measured("q", FOUR_BIT, "mlx", 300),
        measured("v", FULL, "vllm", 3000),
        *ready("q", FOUR_BIT, "mlx"),
        *ready("v", FULL, "vllm"),
    )
    request = long_request(FOUR_BIT, 2000)
    assert route(state, request, {}).prefill_instance_id == "v"
    # 2,000 tokens x 23,040 bytes (30 layers, 3 heads of 64, K and V in bf16) over 5 MB/s: 9.2 s,
    # more than the 6.7 s the decoder takes itself
    assert route(state, request, {}, link_bytes_per_s=5e6).prefill_instance_id == ""
    assert route(state, request, {"v": 30_000}).prefill_instance_id == ""  # 10 s of queue there


def test_the_decoders_cost_of_taking_kv_in_counts() -> None:
    state = state_of(
        *CARDS,
        measured("l", FULL, "llamacpp", 400),
        measured("v", FULL, "vllm", 4000),
        *ready("l", FULL, "llamacpp"),
        *ready("v", FULL, "vllm"),
    )
    decoder = state.instances["l"]
    seconds = remote_seconds(state, decoder, state.instances["v"], 1000, {})
    # 0.05 s overhead + 0.25 s prefill + 0.7 s of llama.cpp's import, and the transfer's last layer
    assert seconds == pytest.approx(1.0, abs=0.01)


def test_asked_for_uses_the_fastest_measured_partner_and_never_forbids_nothing() -> None:
    state = state_of(*CARDS, *ready("q", FOUR_BIT, "mlx"), *ready("v", FULL, "vllm"))
    decoder = state.instances["q"]
    assert plan_prefill(state, decoder, 10, {}, "always").partner == state.instances["v"]
    assert plan_prefill(state, decoder, 5000, {}, "never").partner is None
    assert plan_prefill(state, decoder, 0, {}).why == "the whole prompt is cached"


def test_weight_bits_from_dtype_or_quantization() -> None:
    cards = {c.card.model_id: c.card for c in CARDS}
    assert (weight_bits(cards[FULL]), weight_bits(cards[FOUR_BIT]), weight_bits(cards[OTHER])) == (32, 4, 16)


def test_the_partner_table_lists_each_decoders_partners() -> None:
    state = state_of(
        *CARDS, *ready("q", FOUR_BIT, "mlx"), *ready("v", FULL, "vllm"), *ready("o", OTHER, "vllm")
    )
    assert partner_table(state) == {
        "q": [
            {
                "instance_id": "v",
                "engine": "vllm",
                "model_id": FULL,
                "why": "same base model, weights as precise",
            }
        ]
    }


def test_a_pinned_prefill_instance_splits_by_the_token_threshold_whatever_was_measured() -> None:
    state = state_of(
        *CARDS,
        measured("q", FOUR_BIT, "mlx", 900),
        measured("v", FULL, "vllm", 400),
        *ready("q", FOUR_BIT, "mlx"),
        *ready("v", FULL, "vllm", role="prefill"),
    )
    reply = route(state, long_request(FOUR_BIT, 1500), {})
    assert reply.prefill_instance_id == "v" and "(1500 uncached tokens > 1000)" in reply.reason
