"""An instance runs on the engine its node measured fastest for its model (pure).

Placement ranks engines by the node's calibrations once every engine there is measured, and by the
node kind's prior before (fleet_proto.speed). A worker measures the engine it loads at once and the
node's other engines in the background, so an instance placed by the prior can turn out to run on a
slower engine: the leader then places it again, as its next generation (same id, so clients keep
addressing it), on the same node with the faster engine. Only where the user did not pin the
engine, only for whole-model instances that both prefill and decode (a disaggregated pair's KV must
stay compatible), and only when the faster engine takes at most UPGRADE_MARGIN of the time.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from fleet_proto import Instance, InstanceStatus, Shard, State
from fleet_proto.engines import ENGINE_FACTS, EngineFacts
from fleet_proto.speed import MEASURED, calibration, engine_order, reference_seconds
from fleet_scheduler.placement import node_engines, place, staged_card

UPGRADE_MARGIN = 0.8


def faster_engine(state: State, instance: Instance, caps: Mapping[str, EngineFacts] = ENGINE_FACTS) -> str:
    """The engine `instance` should move to on its node, or "" when it should stay."""
    if instance.engine_pinned or instance.is_pipeline or instance.role != "both":
        return ""
    node, card = state.nodes.get(instance.node_id), staged_card(state, instance.model_id)
    if instance.status != InstanceStatus.READY or node is None or card is None:
        return ""
    engines = node_engines(card, node, caps)
    if instance.engine not in engines:
        return ""
    order, how = engine_order(node, card.model_id, engines)
    best, current = (
        calibration(node, order[0], card.model_id),
        calibration(node, instance.engine, card.model_id),
    )
    if how != MEASURED or order[0] == instance.engine or best is None or current is None:
        return ""
    return order[0] if reference_seconds(best) <= UPGRADE_MARGIN * reference_seconds(current) else ""


def moved_to_engine(
    state: State, instance: Instance, engine: str, caps: Mapping[str, EngineFacts] = ENGINE_FACTS
) -> Instance:
    """`instance`'s next generation on its node with `engine`, its own memory no longer counted
    (PlacementError when it does not fit there)."""
    others = {k: v for k, v in state.instances.items() if k != instance.instance_id}
    card = state.models[instance.model_id]
    placed = place(
        msgspec.structs.replace(state, instances=others),
        instance.model_id,
        instance.instance_id,
        engine,
        caps,
        shards=(Shard(node_id=instance.node_id, start_layer=0, end_layer=card.num_layers),),
    )
    return msgspec.structs.replace(placed, role=instance.role, generation=instance.generation + 1)
