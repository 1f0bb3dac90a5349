"""Where a new instance runs: pure functions of State that list, score and pick placements.

The rules come from the seeds (exo's vLLM-aware placement): an engine runs only where it is installed;
a model needs its weights times the engine's headroom, in the memory pool the engine loads into on
each node (fleet_proto.memory: a discrete GPU's memory for vLLM on CUDA, else host memory, which a
unified-memory node's engines all share); packed quantized weights (MLX's) load only in
engines that read their format, and only on node kinds where those engines run them (MLX: not
CUDA); a model's card may name the node kinds it runs best on (mlx-community's: Apple, then CPU);
unless the engine is asked for, the engine that runs the model fastest on a node comes first there
(measured by its worker, else the node kind's prior: fleet_proto.speed); nodes that hold the files
already come next; otherwise the most memory left after loading wins. A model that no single node
fits is split by layers across nodes (engines whose facts say pipeline), each rank listening for its
ring on a port of its node's range.

Every rule reads facts: the engine's (fleet_proto.engines, the `engines` table) and the model's
card (fleet_store.cards computes what its name implies); none compares an engine's or a model's name.

Whole at ~510 lines: the rules above are one ordered pipeline (candidates, then their scores, then
a pick, with the layer split as its fallback), read top to bottom like the seeds' placement.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator, Mapping, Sequence

import msgspec

from fleet_proto import Instance, InstanceStatus, ModelCard, NodeInfo, PlacementOption, Shard, State
from fleet_proto.engines import ENGINE_FACTS, UNKNOWN_ENGINE, EngineFacts, engine_facts
from fleet_proto.memory import MemoryPool, grant, memory_pool, pool_bytes, share_bytes
from fleet_proto.speed import describe, engine_order
from fleet_store.cards import stand_in_card, with_conventions

GiB = 2**30
# A node's ring ports: [ring_port_base, ring_port_base + RING_PORT_SPAN), one per pipeline rank on its host.
RING_PORT_SPAN = 64
LOOPBACK = "127.0.0.1"
NO_RINGS = "takes no part in pipelines (FLEET_RING_PORT_BASE=0)"
# Instances that hold (or will hold) memory on their nodes. A node's available memory in State is what
# it reported when it joined, before these instances loaded, so every live instance is subtracted.
_PROMISING = frozenset(
    {
        InstanceStatus.PLACED,
        InstanceStatus.DOWNLOADING,
        InstanceStatus.LOADING,
        InstanceStatus.WARMING,
        InstanceStatus.READY,
        InstanceStatus.DRAINING,
    }
)


class PlacementError(ValueError):
    """Nothing fits; the message says why, for the user."""


def option_label(option: PlacementOption) -> str:
    return "+".join(s.node_id for s in option.shards)


MAX_SPEED_RANK = 4  # engines ranked per node (those that load weights)


def option_score(kind: int, nodes: int, uncached: int, free_after: int, speed: int = 0) -> float:
    """One sortable number, tier by tier: preferred node kind, then the engine's speed rank on its
    node (0..MAX_SPEED_RANK, higher is faster), then fewer pipeline hops, then files already on disk,
    then GiB left (tiers of 1e6 GiB; float keeps ~2 MiB resolution)."""
    free_gib = max(min(free_after / GiB, 4e5), -4e5)
    return (((kind * (MAX_SPEED_RANK + 1) + speed) * 1000 - nodes) * 1000 - uncached) * 1e6 + free_gib


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


# --- the model ---------------------------------------------------------------------------------


def staged_card(state: State, model_id: str) -> ModelCard | None:
    """The staged card with the facts its name implies (a card staged before those facts were on
    cards gets them here: they are computed from what the card has)."""
    card = state.models.get(model_id)
    return with_conventions(card) if card is not None else None


def _known_card(state: State, model_id: str) -> ModelCard | None:
    """The staged card, or a stand-in sized by the download (layer count unknown: one layer)."""
    card = staged_card(state, model_id)
    status = state.downloads.get(model_id)
    if card is not None or status is None or status.total_bytes <= 0:
        return card
    return stand_in_card(model_id, status.total_bytes)


def model_card(state: State, model_id: str) -> ModelCard:
    card = _known_card(state, model_id)
    if card is None:
        raise PlacementError(f"model {model_id} is not staged")
    return card


def _engines(card: ModelCard, caps: Mapping[str, EngineFacts], engine: str = "") -> list[str]:
    known = [e for e in card.supported_engines if e in caps]
    if engine in caps and not caps[engine].loads_weights:  # it runs any model: asked for by name
        return [engine]
    if engine and engine not in known:
        supported = ", ".join(card.supported_engines) or "none"
        raise PlacementError(f"{card.model_id} does not run on {engine} (supported: {supported})")
    if not known:
        raise PlacementError(f"{card.model_id} supports no known engine ({card.supported_engines})")
    return [engine] if engine else known


# --- one rule per function ---------------------------------------------------------------------


def has_engine(node: NodeInfo, engine: str) -> bool:
    return any(e.name == engine for e in node.engines)


def _quantized(card: ModelCard) -> str:
    """How the refusals name the card's packed quantized format ("MLX")."""
    return card.quantization_format.upper()


def engine_refusal(card: ModelCard, engine: str, facts: EngineFacts) -> str:
    # Only engines that read a packed format load it: vLLM never loads mlx-community 4/8-bit weights.
    if card.quantization_format and card.quantization_format not in facts.quantizations:
        return f"{engine} cannot load {_quantized(card)}-quantized weights ({card.quantization})"
    return ""


def node_refusal(
    card: ModelCard, engine: str, node: NodeInfo, facts: EngineFacts, pipeline: bool = False
) -> str:
    """Why `node` cannot run (a shard of, when `pipeline`) `card` on `engine`; "" when it can."""
    if not has_engine(node, engine):
        return f"no {engine} engine"
    if node.kind not in facts.devices:
        return f"{engine} does not run on {node.kind.upper()} nodes"
    if card.quantization_format and node.kind not in facts.quantized_devices:  # MLX: not on CUDA
        return f"{_quantized(card)}-quantized weights do not run on {node.kind.upper()} nodes"
    if pipeline and node.ring_port_base <= 0:
        return NO_RINGS
    return ""


def kind_rank(card: ModelCard, node: NodeInfo) -> int:
    """How well `node`'s kind suits `card` (higher is better): its card's preferred kinds, best
    first (mlx-community's: Apple silicon, then CPUs); 0 for other kinds and models without one."""
    kinds = card.preferred_node_kinds
    return len(kinds) - kinds.index(node.kind) if node.kind in kinds else 0


def node_engines(card: ModelCard, node: NodeInfo, caps: Mapping[str, EngineFacts]) -> list[str]:
    """The engines of `node` that can run `card` and compete on speed (those that load its weights)."""
    return [e for e in card.supported_engines if e in caps and caps[e].loads_weights and has_engine(node, e)]


def speed_rank(
    card: ModelCard, node: NodeInfo, engine: str, caps: Mapping[str, EngineFacts]
) -> tuple[int, str]:
    """How `engine` ranks for `card` among the node's engines (higher is faster, 0 when it is not one
    of them), and the reason part that says why."""
    embedding = card.embedding is not None
    order, how = engine_order(node, card.model_id, node_engines(card, node, caps), embedding)
    if engine not in order or len(order) < 2:
        return 0, ""
    rank = min(len(order) - order.index(engine), MAX_SPEED_RANK)
    return rank, describe(node, card.model_id, engine, how)


def memory_needed(card: ModelCard, shards: Sequence[Shard], headroom: float) -> dict[str, int]:
    """Bytes each node needs: its share of the layers' storage, times the engine's headroom."""
    need: dict[str, int] = {}
    for s in shards:
        need[s.node_id] = need.get(s.node_id, 0) + share_bytes(card, s.end_layer - s.start_layer, headroom)
    return need


def _pool(state: State, node_id: str, facts: EngineFacts) -> MemoryPool:
    node = state.nodes.get(node_id)
    return memory_pool(node, facts) if node is not None else MemoryPool.HOST


def promised_bytes(
    state: State, caps: Mapping[str, EngineFacts] = ENGINE_FACTS
) -> dict[tuple[str, MemoryPool], int]:
    """What the live instances take from each (node, pool): each rank counted in the pool its engine
    loads into on its node."""
    promised: dict[tuple[str, MemoryPool], int] = {}
    for instance in state.instances.values():
        card = _known_card(state, instance.model_id)
        if instance.status not in _PROMISING or card is None:
            continue
        whole = (Shard(node_id=instance.node_id, start_layer=0, end_layer=card.num_layers),)
        facts = engine_facts(instance.engine, caps)
        needed = memory_needed(card, instance.shards or whole, facts.memory_headroom)
        if instance.granted_bytes and not instance.is_pipeline:
            needed = {instance.node_id: instance.granted_bytes}
        for node_id, n in needed.items():
            key = (node_id, _pool(state, node_id, facts))
            promised[key] = promised.get(key, 0) + n
    return promised


def free_bytes(
    state: State,
    caps: Mapping[str, EngineFacts] = ENGINE_FACTS,
    facts: EngineFacts = UNKNOWN_ENGINE,
    promised: Mapping[tuple[str, MemoryPool], int] | None = None,
) -> dict[str, int]:
    """Each node's free memory in the pool an engine with `facts` loads into there (host memory by
    default): what the pool held as the node joined less what its live instances take from it."""
    promised = promised_bytes(state, caps) if promised is None else promised
    free = {}
    for node_id, node in state.nodes.items():
        pool = memory_pool(node, facts)
        free[node_id] = pool_bytes(node, pool) - promised.get((node_id, pool), 0)
    return free


def _of(node: NodeInfo, facts: EngineFacts) -> str:
    """How a reason names the pool its GiB are of: a GPU's own memory, a unified-memory node's one
    pool (which its other engines share), and plain host memory unnamed."""
    if memory_pool(node, facts) is MemoryPool.GPU:
        return f" of {MemoryPool.GPU}"
    return " of unified memory" if node.unified_memory else ""


def split_layers(num_layers: int, weights: Sequence[int]) -> list[int]:
    """Layer counts in proportion to weights, at least one each: each boundary is rounded, then clamped."""
    total, cumulative, ends = sum(weights), 0, [0]
    for i, weight in enumerate(weights):
        cumulative += weight
        end = (2 * num_layers * cumulative + total) // (2 * total)  # round half up
        ends.append(min(max(end, ends[-1] + 1), num_layers - (len(weights) - 1 - i)))
    return [b - a for a, b in itertools.pairwise(ends)]


# --- options -----------------------------------------------------------------------------------


def _evaluate(
    state: State,
    card: ModelCard,
    engine: str,
    shards: tuple[Shard, ...],
    free: Mapping[str, int],
    facts: EngineFacts,
    speed: tuple[int, str] = (0, ""),
) -> PlacementOption:
    """One placement's feasibility and score; `speed`: the engine's rank on the node and why."""
    need = memory_needed(card, shards, facts.memory_headroom)
    after = {node_id: free[node_id] - n for node_id, n in need.items()}
    nodes = [state.nodes[node_id] for node_id in need]
    of = {n.node_id: _of(n, facts) for n in nodes}
    problems = [(n.node_id, node_refusal(card, engine, n, facts, len(nodes) > 1)) for n in nodes]
    problems += [(i, f"needs {gib(need[i])}{of[i]}, {gib(free[i])} free") for i in need if after[i] < 0]
    problems = [(i, p) for i, p in problems if p]
    uncached = sum(card.model_id not in n.cached_models for n in nodes)
    kind = min(kind_rank(card, n) for n in nodes)
    if problems:
        reason = problems[0][1] if len(nodes) == 1 else ", ".join(f"{i}: {p}" for i, p in problems)
    else:
        tightest = min(after, key=lambda i: after[i])
        reason = f"fits with {gib(after[tightest])}{of[tightest]} left"
        reason += "; files cached" if uncached == 0 else ""
        reason += f"; {nodes[0].kind} preferred for {card.publisher}" if kind and len(nodes) == 1 else ""
        reason += f"; {speed[1]}" if speed[1] else ""
    return PlacementOption(
        engine=engine,
        shards=shards,
        feasible=not problems,
        reason=reason,
        memory_needed=need,
        free_after=after,
        score=option_score(kind, len(nodes), uncached, min(after.values()), speed[0]),
    )


def _pipeline_layouts(
    card: ModelCard, engine: str, facts: EngineFacts, nodes: list[NodeInfo], free: Mapping[str, int]
) -> Iterator[tuple[Shard, ...]]:
    """For each k >= 2, the k roomiest usable nodes (no other k nodes have more memory), by node_id."""
    usable = [
        n for n in nodes if not node_refusal(card, engine, n, facts, pipeline=True) and free[n.node_id] > 0
    ]
    roomiest = sorted(usable, key=lambda n: (-free[n.node_id], n.node_id))
    for k in range(2, min(len(roomiest), card.num_layers) + 1):
        chosen = sorted(roomiest[:k], key=lambda n: n.node_id)
        counts = split_layers(card.num_layers, [free[n.node_id] for n in chosen])
        ends = list(itertools.accumulate(counts))
        yield tuple(
            Shard(node_id=n.node_id, start_layer=end - count, end_layer=end)
            for n, count, end in zip(chosen, counts, ends, strict=True)
        )


def _rank(options: list[PlacementOption]) -> list[PlacementOption]:
    # reverse=True keeps the (deterministic) generation order among equals.
    return sorted(options, key=lambda o: (o.feasible, o.score), reverse=True)


def placement_options(
    state: State, model_id: str, caps: Mapping[str, EngineFacts] = ENGINE_FACTS, asked_engine: str = ""
) -> list[PlacementOption]:
    """Every way to run model_id on the cluster (on asked_engine when given), feasible first, best first."""
    card = model_card(state, model_id)
    promised = promised_bytes(state, caps)
    nodes = sorted(state.nodes.values(), key=lambda n: n.node_id)
    options: list[PlacementOption] = []
    for engine in _engines(card, caps, asked_engine):
        if refusal := engine_refusal(card, engine, caps[engine]):
            options.append(PlacementOption(engine=engine, shards=(), feasible=False, reason=refusal))
            continue
        free = free_bytes(state, caps, caps[engine], promised)
        singles = [
            _evaluate(
                state,
                card,
                engine,
                (Shard(node_id=n.node_id, start_layer=0, end_layer=card.num_layers),),
                free,
                caps[engine],
                (0, "") if asked_engine else speed_rank(card, n, engine, caps),
            )
            for n in nodes
        ]
        options += singles
        if caps[engine].pipeline:
            layouts = _pipeline_layouts(card, engine, caps[engine], nodes, free)
            options += [_evaluate(state, card, engine, shards, free, caps[engine]) for shards in layouts]
            # say which nodes the layouts left out, when a pipeline is what the model needs
            outside = [n.node_id for n in nodes if has_engine(n, engine) and n.ring_port_base <= 0]
            if outside and not any(o.feasible for o in singles):
                reason = f"{', '.join(outside)}: {NO_RINGS}"
                options.append(PlacementOption(engine=engine, shards=(), feasible=False, reason=reason))
        elif sum(has_engine(n, engine) for n in nodes) > 1 and not any(o.feasible for o in singles):
            reason = f"engine {engine} cannot split a model across nodes"
            options.append(PlacementOption(engine=engine, shards=(), feasible=False, reason=reason))
    return _rank(options)


# --- explicit placements ----------------------------------------------------------------------


def layout_problem(
    state: State, card: ModelCard, engine: str, shards: Sequence[Shard], caps: Mapping[str, EngineFacts]
) -> str:
    """Why an explicit placement is malformed ("" when it is well formed)."""
    if not shards:
        return "no shards given"
    ids = [s.node_id for s in shards]
    if missing := [i for i in ids if i not in state.nodes]:
        return f"node {missing[0]} is not in the cluster"
    if len(set(ids)) != len(ids):
        return "a node appears in more than one shard"
    if len(shards) > 1 and not caps[engine].pipeline:
        return f"engine {engine} cannot split a model across nodes"
    expected = 0
    for s in shards:
        if s.start_layer != expected:
            return f"shard on {s.node_id} starts at layer {s.start_layer}, expected {expected}"
        if s.end_layer <= s.start_layer:
            return f"shard on {s.node_id} has no layers"
        expected = s.end_layer
    if expected != card.num_layers:
        return f"shards end at layer {expected}, the model has {card.num_layers}"
    return ""


def _shard_node_refusal(
    state: State, card: ModelCard, engine: str, facts: EngineFacts, shards: Sequence[Shard]
) -> str:
    for shard in shards:
        if reason := node_refusal(card, engine, state.nodes[shard.node_id], facts, len(shards) > 1):
            return f"{shard.node_id}: {reason}"
    return ""


def _explicit_options(
    state: State,
    card: ModelCard,
    engines: list[str],
    shards: tuple[Shard, ...],
    caps: Mapping[str, EngineFacts],
) -> list[PlacementOption]:
    promised = promised_bytes(state, caps)
    options = []
    for engine in engines:
        free = free_bytes(state, caps, caps[engine], promised)
        problem = (
            engine_refusal(card, engine, caps[engine])
            or layout_problem(state, card, engine, shards, caps)
            or _shard_node_refusal(state, card, engine, caps[engine], shards)
        )
        if problem:
            options.append(PlacementOption(engine=engine, shards=shards, feasible=False, reason=problem))
        else:
            options.append(_evaluate(state, card, engine, shards, free, caps[engine]))
    return _rank(options)


def _refusal(
    card: ModelCard,
    options: list[PlacementOption],
    engines: list[str],
    caps: Mapping[str, EngineFacts],
    explicit: bool,
) -> str:
    """One line for the user: why each engine and node was refused, nodes refused alike grouped."""
    if explicit:
        reasons = (f"{o.engine}: {o.reason}" if len(engines) > 1 else o.reason for o in options)
        return f"cannot place {card.model_id} as asked: " + "; ".join(reasons)
    groups: dict[tuple[str, str], list[str]] = {}
    # per engine, single nodes before pipelines of more and more nodes; notices last
    order = sorted(
        options, key=lambda o: (not o.shards, engines.index(o.engine), len(o.shards), option_label(o))
    )
    for o in order:
        groups.setdefault((o.engine, o.reason), []).append(option_label(o))
    items = []
    for (engine, reason), labels in groups.items():
        where = ", ".join(filter(None, labels))
        where += f" ({engine})" if where and len(engines) > 1 else ""
        items.append(f"{where}: {reason}" if where else reason)
    whole = [Shard(node_id="", start_layer=0, end_layer=card.num_layers)]
    need = memory_needed(card, whole, caps[engines[0]].memory_headroom)[""]
    return f"no node fits {card.model_id} (needs {gib(need)}): " + "; ".join(items)


# --- pipeline rings ----------------------------------------------------------------------------


def ring_addresses_in_use(state: State) -> set[str]:
    return {s.ring_address for i in state.instances.values() for s in i.shards if s.ring_address}


def free_ring_address(node: NodeInfo, taken: Collection[str]) -> str:
    """The lowest port of the node's ring range on its ring host that is not `taken` ("host:port")."""
    host = node.ring_host or LOOPBACK
    ports = range(node.ring_port_base, node.ring_port_base + RING_PORT_SPAN)
    for port in ports:
        if (address := f"{host}:{port}") not in taken:
            return address
    raise PlacementError(
        f"{node.node_id}: every ring port on {host} ({ports.start}-{ports.stop - 1}) is in use"
    )


def ring_addresses(state: State, shards: Sequence[Shard], avoid: Collection[str] = ()) -> tuple[Shard, ...]:
    """Each shard with the address its rank listens on for the ring: a port no instance's rank uses on
    that host (nodes may share one: several workers on a machine), nor one in `avoid` (the addresses
    of a generation being replaced, whose processes may still be closing)."""
    taken = ring_addresses_in_use(state) | set(avoid)
    placed = []
    for shard in shards:
        address = free_ring_address(state.nodes[shard.node_id], taken)
        taken.add(address)
        placed.append(msgspec.structs.replace(shard, ring_address=address))
    return tuple(placed)


# --- the choice --------------------------------------------------------------------------------


def place(
    state: State,
    model_id: str,
    instance_id: str,
    engine: str = "",
    caps: Mapping[str, EngineFacts] = ENGINE_FACTS,
    shards: Sequence[Shard] | None = None,
    avoid_ring: Collection[str] = (),
) -> Instance:
    """The best feasible placement (on `engine` when given), or the one asked for in `shards`, checked.
    A pipeline's ranks get ring addresses (not in `avoid_ring`); a single node needs none."""
    if not state.nodes:
        raise PlacementError("no engine-worker has joined the cluster")
    card = model_card(state, model_id)
    engines = _engines(card, caps, engine)
    if shards is not None:
        options = _explicit_options(state, card, engines, tuple(shards), caps)
    else:
        options = placement_options(state, model_id, caps, engine)
    best = next((o for o in options if o.feasible), None)
    if best is None:
        raise PlacementError(_refusal(card, options, engines, caps, explicit=shards is not None))
    chosen = tuple(msgspec.structs.replace(s, ring_address="") for s in best.shards)
    granted = 0
    if len(chosen) > 1:
        chosen = ring_addresses(state, chosen, avoid_ring)
    else:
        facts, node_id = engine_facts(best.engine, caps), chosen[0].node_id
        granted = grant(card, facts, state.nodes[node_id], free_bytes(state, caps, facts)[node_id])
    return Instance(
        instance_id=instance_id,
        model_id=model_id,
        node_id=chosen[0].node_id,
        engine=best.engine,
        # A stand-in card does not know the layer count: no shards means all layers.
        shards=chosen if model_id in state.models else (),
        granted_bytes=granted,
    )


def placed_again(
    state: State, instance: Instance, caps: Mapping[str, EngineFacts] = ENGINE_FACTS
) -> Instance:
    """`instance` placed anew as its next generation (same id, model, engine and role) wherever it fits
    now, its own memory no longer counted; its ranks get other ring ports than the old generation's,
    whose processes may still be closing."""
    others = {k: v for k, v in state.instances.items() if k != instance.instance_id}
    placed = place(
        msgspec.structs.replace(state, instances=others),
        instance.model_id,
        instance.instance_id,
        instance.engine,
        caps,
        avoid_ring={s.ring_address for s in instance.shards if s.ring_address},
    )
    return msgspec.structs.replace(
        placed, role=instance.role, generation=instance.generation + 1, engine_pinned=instance.engine_pinned
    )
