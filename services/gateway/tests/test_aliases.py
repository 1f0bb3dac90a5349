"""Model resolution (fleet_gateway.aliases.serving_model) from the view's index answers as the scan
of every instance it replaced, on random States of models in several variants and base models."""

from __future__ import annotations

import random

import pytest

from fleet_gateway.aliases import base_name, serving_model
from fleet_proto import Instance, InstanceStatus, ModelCard, State
from fleet_proto.routing_view import RoutingView
from fleet_proto.testing import bare_node

pytestmark = pytest.mark.unit


def card(model_id: str, base: str = "") -> ModelCard:
    return ModelCard(
        model_id=model_id, architecture="llama", num_layers=4, hidden_size=64, num_kv_heads=2, head_dim=16,
        dtype="bfloat16", storage_bytes=1, base_model=base,
    )  # fmt: skip


LLAMA = "meta-llama/Llama-3.2-1B-Instruct"
CARDS = {
    c.model_id: c
    for c in (
        card(LLAMA),
        card("mlx-community/Llama-3.2-1B-Instruct-4bit", LLAMA),
        card("bartowski/Llama-3.2-1B-Instruct-GGUF", LLAMA),
        card("Qwen/Qwen3-0.6B"),
        card("mlx-community/Qwen3-0.6B-8bit"),  # no base model on its card: matched by its name
        card("org/other-base-of-qwen", "Qwen/Qwen3-0.6B"),
    )
}
UNCARDED = ("someone/Llama-3.2-1B-Instruct-bf16", "tiny/echo", "Qwen3-0.6B")
REQUESTED = (*CARDS, *UNCARDED, "x/Llama-3.2-1B-Instruct-Q4_K_M", "unknown/model", "Llama-3.2-1B-Instruct")
STATUSES = (InstanceStatus.READY, InstanceStatus.READY, InstanceStatus.LOADING, InstanceStatus.FAILED)


def scanned(state: State, requested: str) -> str | None:
    """serving_model as it was: a scan of every instance, per request."""
    ready = sorted({i.model_id for i in state.instances.values() if i.status == InstanceStatus.READY})
    if requested in ready:
        return requested
    wanted = base_name(state, requested)
    return next((model_id for model_id in ready if base_name(state, model_id) == wanted), None)


def random_state(seed: int) -> State:
    rng = random.Random(seed)
    instances = {}
    for k in range(rng.randrange(12)):
        instance = Instance(
            instance_id=f"i{k}",
            model_id=rng.choice((*CARDS, *UNCARDED)),
            node_id=f"n{rng.randrange(3)}",  # n2 is not in the cluster: its READY instances still count
            engine="mlx",
            status=rng.choice(STATUSES),
            role=rng.choice(("both", "decode", "prefill")),
        )
        instances[instance.instance_id] = instance
    nodes = {n: bare_node(n) for n in ("n0", "n1")}
    return State(last_seq=seed, nodes=nodes, instances=instances, models=dict(CARDS))


@pytest.mark.parametrize("seed", range(60))
def test_resolution_from_the_views_index_answers_as_the_scan_of_every_instance(seed: int) -> None:
    state = random_state(seed)
    view = RoutingView(state)
    for requested in REQUESTED:
        assert serving_model(view, requested) == scanned(state, requested), requested


def test_a_variant_is_served_by_the_first_ready_model_of_its_base_by_name() -> None:
    ready = {
        m: Instance(instance_id=m, model_id=m, node_id="n0", engine="mlx", status=InstanceStatus.READY)
        for m in ("mlx-community/Llama-3.2-1B-Instruct-4bit", "bartowski/Llama-3.2-1B-Instruct-GGUF")
    }
    view = RoutingView(State(nodes={"n0": bare_node("n0")}, instances=ready, models=dict(CARDS)))
    assert serving_model(view, LLAMA) == "bartowski/Llama-3.2-1B-Instruct-GGUF"
    quantized = "mlx-community/Llama-3.2-1B-Instruct-4bit"
    assert serving_model(view, quantized) == quantized  # itself first: it has a ready instance
    assert serving_model(view, "Qwen/Qwen3-0.6B") is None
