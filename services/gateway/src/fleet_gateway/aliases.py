"""Which staged model serves a requested model name (pure).

As in exo: a request for a quantized or converted variant ("mlx-community/Llama-3.2-1B-Instruct-4bit")
is served by a ready instance of the same base model ("meta-llama/Llama-3.2-1B-Instruct") when the
exact model has none. Names are compared by their base name (fleet_store.base_model_name), so the
requested name need not be staged or even known to the cluster.
"""

from __future__ import annotations

from fleet_proto import InstanceStatus, State
from fleet_proto.routing import base_model
from fleet_store import base_model_name


def ready_models(state: State) -> list[str]:
    return sorted({i.model_id for i in state.instances.values() if i.status == InstanceStatus.READY})


def known_models(state: State) -> set[str]:
    return {i.model_id for i in state.instances.values()} | {d.model_id for d in state.downloads.values()}


def base_name(state: State, model_id: str) -> str:
    return base_model_name(base_model(state, model_id))


def serving_model(state: State, requested: str) -> str | None:
    """The model id whose instances serve `requested`: itself when it has a ready instance, else the
    first ready model (by name) of the same base model; None when there is none."""
    ready = ready_models(state)
    if requested in ready:
        return requested
    wanted = base_name(state, requested)
    return next((model_id for model_id in ready if base_name(state, model_id) == wanted), None)
