"""Where a new instance runs: a pure function of State (issue 4 grows the rules)."""

from __future__ import annotations

from fleet_proto import Instance, InstanceStatus, NodeInfo, State

# Loading a model needs its weights plus working memory (KV cache, activations).
MEMORY_HEADROOM = 1.3


class PlacementError(ValueError):
    """Nothing fits; the message says why, for the user."""


def model_bytes(state: State, model_id: str) -> int:
    """Size of the model's files as the downloader reported it (0 when unknown)."""
    status = state.downloads.get(model_id)
    return status.total_bytes if status is not None else 0


def _has_engine(node: NodeInfo, engine: str) -> bool:
    return any(e.name == engine for e in node.engines)


def _reserved_bytes(state: State, node_id: str) -> int:
    """Memory promised to the node's placed or loading instances (not yet visible in its metrics)."""
    return sum(
        int(model_bytes(state, i.model_id) * MEMORY_HEADROOM)
        for i in state.instances.values()
        if i.node_id == node_id and i.status in (InstanceStatus.PLACED, InstanceStatus.LOADING)
    )


def place(state: State, model_id: str, instance_id: str, engine: str = "mlx") -> Instance:
    """The node with the engine and the most free memory left after the model is loaded."""
    if not state.nodes:
        raise PlacementError("no engine-worker has joined the cluster")
    need = int(model_bytes(state, model_id) * MEMORY_HEADROOM)
    capable = [n for n in state.nodes.values() if _has_engine(n, engine)]
    if not capable:
        raise PlacementError(f"no node has the {engine!r} engine installed")
    free = {n.node_id: n.memory_available_bytes - _reserved_bytes(state, n.node_id) for n in capable}
    fitting = sorted((f - need, node_id) for node_id, f in free.items() if f >= need)
    if not fitting:
        best = max(free.values())
        raise PlacementError(
            f"{model_id} needs {need / 2**30:.2f} GiB; the most free on any node is {best / 2**30:.2f} GiB"
        )
    _, node_id = fitting[-1]
    return Instance(instance_id=instance_id, model_id=model_id, node_id=node_id, engine=engine)
