"""What route() reads of one State, indexed for the decisions made on it (pure: no I/O, no globals).

Scanning the State per decision (the ready instances of a model, their calibrations, each decoder's
prefill partners) costs O(instances): 2.4 ms at 1,000 workers. A RoutingView answers the same
questions from an index of one State object, built on first use and kept, so a decision costs what
the requested model's instances cost, however large the cluster. apply() returns a new State for
every event and never changes one, so a view holds for exactly the State object it was made from:
whoever holds the State keeps the view beside it and takes a new one when the object changes
(`view_of`). Its answers equal the scans' (fleet_proto.routing.ready_instances, partners.partners).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar, cast

from fleet_proto.common import EngineCalibration, Instance, InstanceStatus
from fleet_proto.engines import EngineFacts, engine_facts
from fleet_proto.partners import DECODE_ROLES, PREFILL_ROLES, base_model, prefills_for_model
from fleet_proto.speed import calibration
from fleet_proto.state import State

T = TypeVar("T")


def embeds(state: State, model_id: str) -> bool:
    """An embedding model: its instances serve embeddings only (ModelCard.embedding)."""
    card = state.models.get(model_id)
    return card is not None and card.embedding is not None


def serving(state: State, instance: Instance) -> bool:
    """Ready, and every node it runs on is in the cluster (a worker that is stopping leaves first)."""
    nodes = {instance.node_id, *(s.node_id for s in instance.shards)}
    return instance.status == InstanceStatus.READY and all(n in state.nodes for n in nodes)


def instance_calibration(state: State, instance: Instance) -> EngineCalibration | None:
    node = state.nodes.get(instance.node_id)
    return calibration(node, instance.engine, instance.model_id) if node is not None else None


def fastest_engines(
    measure: Callable[[Instance], EngineCalibration | None],
    instances: Sequence[Instance],
    speed: str,
    prior: Callable[[EngineFacts], bool],
) -> tuple[str, ...]:
    """The engines of `instances` with the highest measured `speed` ("prefill_tokens_per_s" or
    "decode_tokens_per_s") on their nodes (`measure`: an instance's calibration there); those whose
    facts have `prior` while any is unmeasured."""
    measured = []
    for instance in instances:
        if (m := measure(instance)) is None:  # the prior decides: measuring the rest changes nothing
            return tuple(dict.fromkeys(i.engine for i in instances if prior(engine_facts(i.engine))))
        measured.append(m)
    if not measured:
        return ()
    top = max(getattr(m, speed) for m in measured)
    return tuple(i.engine for i, m in zip(instances, measured, strict=True) if getattr(m, speed) == top)


def fastest_decoders(
    measure: Callable[[Instance], EngineCalibration | None], candidates: Sequence[Instance]
) -> Sequence[Instance]:
    """The candidates whose engine decodes fastest (measured, else decode-preferred; all when none is)."""
    fastest = fastest_engines(measure, candidates, "decode_tokens_per_s", lambda f: f.decode_preferred)
    return [i for i in candidates if i.engine in fastest] or candidates


class RoutingView:
    """One State's routing facts, each computed once, on first use: the index by model and base
    model in one pass over the instances, then per model its candidates and per instance its
    calibration. Not thread-safe (its memos fill as it is read); a new State needs a new view."""

    def __init__(self, state: State) -> None:
        self.state = state
        self._indexed = False
        # serving instances of a decoding role, by model and by base model (State order)
        self._decoders_by_model: dict[str, list[Instance]] = {}
        self._decoders_by_base: dict[str, list[Instance]] = {}
        # READY instances that export KV in a prefilling role, by base model (instance id order)
        self._prefillers_by_base: dict[str, list[Instance]] = {}
        self._ready: dict[str, tuple[Instance, ...]] = {}
        self._decoders: dict[str, tuple[tuple[Instance, ...], Sequence[Instance]]] = {}
        self._pools: dict[tuple[str, str], tuple[Instance, ...]] = {}  # (model, engine) -> partners
        self._calibrations: dict[str, EngineCalibration | None] = {}
        self._speeds: dict[str, float] = {}
        self._derived: dict[Callable[[RoutingView], object], object] = {}

    def _index(self) -> None:
        state = self.state
        exports = {
            engine: engine_facts(engine).kv_export for engine in {i.engine for i in state.instances.values()}
        }
        for instance in state.instances.values():
            if instance.status != InstanceStatus.READY:
                continue
            base = base_model(state, instance.model_id)
            if instance.role in DECODE_ROLES and serving(state, instance):
                self._decoders_by_model.setdefault(instance.model_id, []).append(instance)
                self._decoders_by_base.setdefault(base, []).append(instance)
            if instance.role in PREFILL_ROLES and exports[instance.engine]:
                self._prefillers_by_base.setdefault(base, []).append(instance)
        for prefillers in self._prefillers_by_base.values():
            prefillers.sort(key=lambda i: i.instance_id)
        self._indexed = True

    def ready(self, model_id: str) -> tuple[Instance, ...]:
        """ready_instances(state, model_id): the model's, else those of its base model and kind."""
        if (found := self._ready.get(model_id)) is not None:
            return found
        if not self._indexed:
            self._index()
        exact = self._decoders_by_model.get(model_id)
        if exact:
            found = tuple(exact)
        else:
            state = self.state
            base, kind = base_model(state, model_id), embeds(state, model_id)
            same_base = self._decoders_by_base.get(base, ())
            found = tuple(i for i in same_base if embeds(state, i.model_id) == kind)
        self._ready[model_id] = found
        return found

    def derived(self, build: Callable[[RoutingView], T]) -> T:
        """build(self), once per view: an index that whoever holds the view derives from its State
        (the gateway's model names), gone with the view. `build` is the key: a module-level function."""
        if build not in self._derived:
            self._derived[build] = build(self)
        return cast(T, self._derived[build])

    def decoders(self, model_id: str) -> tuple[tuple[Instance, ...], Sequence[Instance]]:
        """ready(model_id), and those of them whose engine decodes fastest (fastest_decoders)."""
        if (found := self._decoders.get(model_id)) is None:
            candidates = self.ready(model_id)
            found = self._decoders[model_id] = (candidates, fastest_decoders(self.calibration, candidates))
        return found

    def calibration(self, instance: Instance) -> EngineCalibration | None:
        """The measurement the instance's engine counts with on its node for its model."""
        key = instance.instance_id
        if key not in self._calibrations:
            self._calibrations[key] = instance_calibration(self.state, instance)
        return self._calibrations[key]

    def prefill_speed(self, instance: Instance) -> float:
        """partners.prefill_speed: measured prefill tokens/s (0: not measured)."""
        key = instance.instance_id
        if (speed := self._speeds.get(key)) is None:
            measured = self.calibration(instance)
            speed = self._speeds[key] = measured.prefill_tokens_per_s if measured is not None else 0.0
        return speed

    def partners(self, decoder: Instance, avoid_nodes: tuple[str, ...] = ()) -> list[Instance]:
        """partners.partners(state, decoder, avoid_nodes): who may prefill for it, by instance id."""
        key = (decoder.model_id, decoder.engine)
        if (pool := self._pools.get(key)) is None:
            if not self._indexed:
                self._index()
            state = self.state
            same_base = self._prefillers_by_base.get(base_model(state, decoder.model_id), ())
            pool = self._pools[key] = tuple(c for c in same_base if prefills_for_model(state, decoder, c))
        me = decoder.instance_id
        if avoid_nodes:
            return [p for p in pool if p.instance_id != me and p.node_id not in avoid_nodes]
        return [p for p in pool if p.instance_id != me]


def view_of(state: State, view: RoutingView | None) -> RoutingView:
    """`view` while it is `state`'s, else a new view of `state` (a new State object is a new State)."""
    return view if view is not None and view.state is state else RoutingView(state)


class KeptView:
    """The view of the State that `state()` returns now, kept while that State object stays the same:
    one per service, shared by every decision it makes per request (model resolution, admission,
    routing). Each call reads the State current then, so a step that runs after an await sees events
    folded meanwhile, as it would reading the State itself."""

    def __init__(self, state: Callable[[], State]) -> None:
        self._state = state
        self._view: RoutingView | None = None

    def __call__(self) -> RoutingView:
        self._view = view_of(self._state(), self._view)
        return self._view
