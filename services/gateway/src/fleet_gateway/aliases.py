"""Which staged model serves a requested model name (pure).

As in exo: a request for a quantized or converted variant ("mlx-community/Llama-3.2-1B-Instruct-4bit")
is served by a ready instance of the same base model ("meta-llama/Llama-3.2-1B-Instruct") when the
exact model has none. Names are compared by their base name (fleet_store.base_model_name), so the
requested name need not be staged or even known to the cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fleet_proto import InstanceStatus, State
from fleet_proto.routing import base_model
from fleet_proto.routing_view import RoutingView
from fleet_proto.scaling import scales_to_zero_now
from fleet_store import base_model_name


def ready_models(state: State) -> list[str]:
    return sorted({i.model_id for i in state.instances.values() if i.status == InstanceStatus.READY})


def on_demand(state: State, model_id: str) -> bool:
    """Staged, and its scaling policy places an instance when asked (scaled to zero: a request for
    it waits for one)."""
    return model_id in state.models and scales_to_zero_now(state.scaling.get(model_id))


def servable_models(state: State) -> list[str]:
    """The models a request may name now: those with a ready instance, and those on demand."""
    return sorted({m for m in state.models if on_demand(state, m)}.union(ready_models(state)))


def known_models(state: State) -> set[str]:
    return {i.model_id for i in state.instances.values()} | {d.model_id for d in state.downloads.values()}


def base_name(state: State, model_id: str) -> str:
    return base_model_name(base_model(state, model_id))


@dataclass(frozen=True)
class ReadyNames:
    """One State's ready models, and per base name the first of them (by name) that has it."""

    ready: frozenset[str]
    by_base_name: Mapping[str, str]


def ready_names(view: RoutingView) -> ReadyNames:
    by_base_name: dict[str, str] = {}
    ready = ready_models(view.state)
    for model_id in ready:  # by name: the first keeps its base name
        by_base_name.setdefault(base_name(view.state, model_id), model_id)
    return ReadyNames(frozenset(ready), by_base_name)


def serving_model(view: RoutingView, requested: str) -> str | None:
    """The model id whose instances serve `requested`: itself when it has a ready instance, else the
    first ready model (by name) of the same base model, else itself when it is staged and scales
    from zero on demand; None when there is none. Read from an index of the view's State
    (ready_names, built once per State), not a scan of its instances."""
    names = view.derived(ready_names)
    if requested in names.ready:
        return requested
    if (alias := names.by_base_name.get(base_name(view.state, requested))) is not None:
        return alias
    return requested if on_demand(view.state, requested) else None
