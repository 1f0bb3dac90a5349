"""Which instance serves a request: a pure function of State, load and cached prefixes.

The scheduler decides with it; the gateway uses it too when the scheduler does not answer.

Candidates are the ready decode-capable instances of the requested model, else of another model with
the same base model (e.g. an MLX 4-bit conversion of the same weights). The engine that decodes
fastest is preferred: by the workers' calibrations (fleet_proto.speed) when every candidate is
measured, else the engine whose facts prefer it for decode (MLX; seed rule: MLX nodes are the
bandwidth-strong decoders); among those the lowest
cost wins, in tokens (Dynamo's router formula, prefill weight 1):

    cost = load + (prompt tokens - prompt tokens whose KV the instance's node holds in memory)

load = prompt tokens still to prefill on the instance plus one per request in flight, as its worker
last reported (not the context of requests decoding), plus the prompt tokens new to it routed there
since (routed_work); the cached part comes from the KV block index (leading
blocks per node), or for an engine that indexes nothing (llama.cpp) from what this router sent it
(`remembered`). Ties go to the lowest instance id, so the choice is deterministic. The reason
records the expected hit, and how much of the prompt object storage (tier 2) holds: any worker can
fetch that, so it moves no choice. FLEET_ROUTING_POLICY may swap the cost for the load alone
("least-loaded") or a rotation ("round-robin"): the baselines `fleet bench replay` compares with.

Disaggregation (fleet_proto.partners): the prompt part the chosen decoder would have to compute
(neither in its node's memory nor in object storage) is prefilled on another instance of the same
base model with weights at least as precise (e.g. vLLM on the bf16 weights for an MLX 4-bit
decoder) when the calibrations of both say that beats prefilling it locally, transfer included;
while either is unmeasured, when that part is longer than `disagg_min_tokens` (the seed's 1,000);
or when the request asks for it. Only engines whose facts say kv_import decode that way
(fleet_proto.engines); any kv_export engine can be the partner: KV travels in one layout (Hugging
Face's order of a head's dimensions, llama.cpp's permuted K converted at its edge), and llama.cpp's
GGUF and the safetensors MLX and vLLM run are one model's weights (converted from it, or it
quantized).
A pipeline instance (layers split across nodes) takes part like any other: its rank 0, on the
instance's node, is its one handoff endpoint and moves every rank's layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fleet_proto.common import Instance
from fleet_proto.engines import engine_facts
from fleet_proto.messages import EMBED_TASK, RouteReply, RouteRequest
from fleet_proto.partners import (
    DECODE_ROLES,
    DEFAULT_DISAGG_MIN_TOKENS,
    DEFAULT_LINK_BYTES_PER_S,
    base_model,
    plan_prefill,
)
from fleet_proto.routing_view import RoutingView, embeds, fastest_decoders, serving, view_of
from fleet_proto.state import State

__all__ = [
    "DEFAULT_DISAGG_MIN_TOKENS",
    "EMBED_TASK",
    "ROUTING_POLICIES",
    "RoutingView",
    "base_model",
    "ready_instances",
    "route",
    "view_of",
]

KV_AWARE, LEAST_LOADED, ROUND_ROBIN = "kv", "least-loaded", "round-robin"
ROUTING_POLICIES = (KV_AWARE, LEAST_LOADED, ROUND_ROBIN)
POLICY_CHOICE = {KV_AWARE: "least cost", LEAST_LOADED: "least loaded", ROUND_ROBIN: "round-robin"}


def avoided(instance: Instance, request: RouteRequest) -> bool:
    return instance.node_id in request.avoid_nodes or instance.instance_id in request.avoid_instances


def ready_instances(state: State, model_id: str, roles: tuple[str, ...] = DECODE_ROLES) -> list[Instance]:
    """Ready instances of the model, or failing that of another model with the same base model and
    the same kind (an embedding model's instances never generate, nor a chat model's embed). A scan
    of every instance: route() reads the same from its RoutingView's index."""
    ready = [i for i in state.instances.values() if serving(state, i) and i.role in roles]
    exact = [i for i in ready if i.model_id == model_id]
    if exact:
        return exact
    base, kind = base_model(state, model_id), embeds(state, model_id)
    return [i for i in ready if base_model(state, i.model_id) == base and embeds(state, i.model_id) == kind]


def route_embedding(view: RoutingView, request: RouteRequest, load: Mapping[str, int]) -> RouteReply:
    """An embedding request goes to the least loaded ready instance of the embedding model (no
    prefix cache, no split: its inputs are short and embedded whole)."""
    if not embeds(view.state, request.model_id):
        return RouteReply(error=f"{request.model_id} is no embedding model")
    ready = [i for i in view.ready(request.model_id) if not avoided(i, request)]
    if not ready:
        return RouteReply(error=f"no ready instance of {request.model_id}")
    chosen = min(ready, key=lambda i: (load.get(i.instance_id, 0), i.instance_id))
    reason = f"least loaded of {len(ready)} ready (load {load.get(chosen.instance_id, 0)} tokens)"
    return RouteReply(instance_id=chosen.instance_id, worker_id=chosen.node_id, reason=reason)


def avoiding(request: RouteRequest) -> str:
    said = [f"nodes {', '.join(request.avoid_nodes)}" if request.avoid_nodes else ""]
    said.append(f"instances {', '.join(request.avoid_instances)}" if request.avoid_instances else "")
    return f" off {' and '.join(s for s in said if s)}" if any(said) else ""


def cached_tokens(instance: Instance, cached: Mapping[str, int], remembered: Mapping[str, int]) -> int:
    """The request's leading prompt tokens the instance's engine holds: its node's, by the KV index;
    for an engine whose KV stays its own (nothing indexed), what this router sent it recently."""
    held = cached.get(instance.node_id, 0)
    if engine_facts(instance.engine).kv_local:
        held = max(held, remembered.get(instance.instance_id, 0))
    return held


def routed_work(reply: RouteReply, request: RouteRequest) -> dict[str, int]:
    """What a routed request adds to each chosen instance's load until its worker reports again: the
    prompt tokens new to it (the prompt less the hit the reply expects there: held in memory or in
    object storage), which the decoder computes or a prefill partner computes for it. Not the whole
    prompt: a conversation's next turn, sent back to the instance holding its history, would
    otherwise weigh there as if recomputed, and the load term would push the turn after it away from
    that history. Its worker reports the same (GenerateTask.expected_cached_tokens)."""
    if not reply.instance_id:
        return {}
    new = max(request.prompt_tokens - reply.cached_tokens, 0)
    work = {reply.instance_id: new}
    if reply.prefill_instance_id:
        work[reply.prefill_instance_id] = new
    return work


def route_cost(instance: Instance, prompt_tokens: int, load: Mapping[str, int], held: int) -> int:
    return load.get(instance.instance_id, 0) + max(prompt_tokens - held, 0)


def choose(
    preferred: Sequence[Instance],
    request: RouteRequest,
    load: Mapping[str, int],
    cached: Mapping[str, int],
    remembered: Mapping[str, int],
    policy: str,
    turn: int,
) -> Instance:
    """The instance a policy picks: "kv" the least cost (load + uncached prompt), "least-loaded" the
    least load, "round-robin" the turn'th in instance id order (the baselines KV-aware routing is
    measured against)."""
    if policy == ROUND_ROBIN:
        ordered = sorted(preferred, key=lambda i: i.instance_id)
        return ordered[turn % len(ordered)]
    least_loaded = min(preferred, key=lambda i: (load.get(i.instance_id, 0), i.instance_id))
    if policy == LEAST_LOADED:
        return least_loaded
    # Every instance holding none of the prompt costs its load + the whole prompt, so of those the
    # least loaded costs least: only the few that may hold a prefix need the whole formula.
    holding = [i for i in preferred if i.node_id in cached or i.instance_id in remembered]
    prompt = request.prompt_tokens
    return min(
        [least_loaded, *holding],
        key=lambda i: (route_cost(i, prompt, load, cached_tokens(i, cached, remembered)), i.instance_id),
    )


def decoders(view: RoutingView, request: RouteRequest) -> tuple[Sequence[Instance], Sequence[Instance]]:
    """The request's candidates (ready, not avoided) and those of them whose engine decodes fastest."""
    if not request.avoid_nodes and not request.avoid_instances:
        return view.decoders(request.model_id)
    candidates = [i for i in view.ready(request.model_id) if not avoided(i, request)]
    return candidates, fastest_decoders(view.calibration, candidates)


def route(
    state: State,
    request: RouteRequest,
    load: Mapping[str, int],
    cached: Mapping[str, int] | None = None,
    tier2_tokens: int = 0,
    disagg_min_tokens: int = DEFAULT_DISAGG_MIN_TOKENS,
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S,
    remembered: Mapping[str, int] | None = None,
    policy: str = KV_AWARE,
    turn: int = 0,
    view: RoutingView | None = None,
) -> RouteReply:
    """cached: node id -> leading prompt tokens whose KV that node holds in memory (the KV index);
    remembered: instance id -> leading prompt tokens this router sent there recently (used for
    engines that index nothing); policy: one of ROUTING_POLICIES (round-robin takes the `turn`th);
    view: `state`'s RoutingView, kept by the caller across decisions on that State (view_of); without
    one, this call indexes the State for itself (O(instances))."""
    if view is None:
        view = RoutingView(state)
    elif view.state is not state:
        raise ValueError("route() was given the RoutingView of another State")
    if request.task == EMBED_TASK:
        return route_embedding(view, request, load)
    if embeds(state, request.model_id):
        return RouteReply(error=f"{request.model_id} is an embedding model: it serves embeddings only")
    cached, remembered = cached or {}, remembered or {}
    candidates, preferred = decoders(view, request)
    if not candidates:
        return RouteReply(error=f"no ready instance of {request.model_id}{avoiding(request)}")
    chosen = choose(preferred, request, load, cached, remembered, policy, turn)
    tokens, hit = load.get(chosen.instance_id, 0), cached_tokens(chosen, cached, remembered)
    reason = f"{POLICY_CHOICE[policy]} of {len(preferred)} ready {chosen.engine} (load {tokens} tokens"
    reason += f", {hit} of {request.prompt_tokens} prompt tokens cached in memory)"
    if tier2_tokens:
        reason += f"; object storage holds {tier2_tokens}"
    if chosen.model_id != request.model_id:
        reason += f", same base model as {request.model_id}"
    plan = plan_prefill(
        state,
        chosen,
        request.prompt_tokens - max(hit, tier2_tokens),
        load,
        request.disaggregate,
        request.avoid_nodes,
        disagg_min_tokens,
        link_bytes_per_s,
        view,
    )
    expected = min(max(hit, tier2_tokens), request.prompt_tokens)
    if plan.partner is None:
        return RouteReply(
            instance_id=chosen.instance_id,
            worker_id=chosen.node_id,
            reason=f"{reason}; {plan.why}",
            cached_tokens=expected,
        )
    partner = plan.partner
    return RouteReply(
        instance_id=chosen.instance_id,
        worker_id=chosen.node_id,
        reason=reason + f"; prefill on {partner.engine} {partner.instance_id} ({plan.why})",
        prefill_instance_id=partner.instance_id,
        prefill_worker_id=partner.node_id,
        cached_tokens=expected,
    )
