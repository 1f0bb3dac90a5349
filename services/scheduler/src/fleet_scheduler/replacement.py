"""A pipeline instance whose rank failed is placed again, a few times at most (pure).

A pipeline's ranks are one ring: when one rank's engine dies or fails to load, the others cannot go on
and the instance fails as a whole. The leader then places it anew as its next generation (same id, so
clients keep addressing it): every rank starts over, with fresh ring ports, on the nodes that fit now.
At most `REPLACE_POLICY.max_restarts` times within its window per instance; beyond that, or when
nothing fits, the instance stays failed and its reason says why it was not re-placed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fleet_proto import Instance, InstanceFailed, InstancePlaced, InstanceStatus, State
from fleet_runtime.restarts import RestartPolicy

REPLACE_POLICY = RestartPolicy(max_restarts=3, window_s=600.0)
# Appended to the failure's reason; the reducer lets a reason that extends the first one replace it.
NOT_REPLACED = "; not re-placed: "


def failed_pipeline(state: State, event: InstanceFailed) -> Instance | None:
    """The pipeline instance `event` (now applied) left failed at its current generation, unless its
    reason already says it is not re-placed; else None."""
    instance = state.instances.get(event.instance_id)
    if instance is None or not instance.is_pipeline or instance.status != InstanceStatus.FAILED:
        return None
    if event.generation >= 0 and event.generation != instance.generation:
        return None  # about a generation replaced since
    return None if NOT_REPLACED in instance.reason else instance


def not_replaced(instance: Instance, why: str) -> InstanceFailed:
    return InstanceFailed(
        instance_id=instance.instance_id,
        generation=instance.generation,
        reason=f"{instance.reason}{NOT_REPLACED}{why}",
    )


def replacement(
    state: State,
    instance: Instance,
    replace: Callable[[State, Instance], Instance],
    replaced_at: Sequence[float],
    now: float,
    policy: RestartPolicy = REPLACE_POLICY,
) -> InstancePlaced | InstanceFailed:
    """The event that answers a failed pipeline: its next generation placed by `replace` (which raises
    ValueError, e.g. PlacementError, when nothing fits), or why not. `replaced_at`: when it was
    re-placed before (monotonic)."""
    if not policy.allows(replaced_at, now):
        return not_replaced(
            instance, f"placed again {policy.max_restarts} times within {policy.window_s:.0f} s already"
        )
    try:
        return InstancePlaced(instance=replace(state, instance))
    except ValueError as exc:
        return not_replaced(instance, str(exc))
