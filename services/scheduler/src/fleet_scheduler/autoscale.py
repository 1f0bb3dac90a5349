"""Instances that follow demand: per model, how many its demand asks for, and the decisions that get
there. Pure: plain data in, plain data out, no clock (`now` is an argument).

What feeds it, the scheduler already hears: State (instances, nodes, cards), NodeMetrics (per
instance: requests in flight, request slots, prompt tokens still to prefill), the gateways'
AdmissionSample (requests waiting per model), request stats (TTFT) and route requests. The caller
folds them into a ModelDemand per model and passes back the ScalingHistory each call returns.

Rules (Knative's concurrency target, HPA's windows), per model whose ScalingPolicy is enabled:
- Wanted: the most any signal asks for: requests (in flight + waiting) over target_utilization of an
  instance's slots; queued prompt tokens over target_queued_tokens; one more while TTFT p90 is over
  its target. Within [min_instances, max_instances]; at least one while demand was seen within
  idle_s, then min_instances, which may be 0 (scale to zero).
- Up: at once from zero (a request waits) or below min_instances (after scale_up_cooldown_s since
  the last add: an instance that failed to load is tried again no faster, and the next attempt
  deletes it, so failures do not pile up); else after scale_up_window_s above
  target, scale_up_cooldown_s after the last change, with no instance of it still starting. On the
  node placement prefers among those running none of the model: a worker that just joined is one.
- Down: one at a time, the least loaded instance (it drains), once demand fitted one fewer at
  scale_down_ratio of the targets for scale_down_delay_s, as long after the last change; to zero
  after idle_s; at once down to max_instances. The gap between the up and down thresholds and the
  windows keep it from flapping.
- Hold: a change the policy wants and does not make (yet), and why.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from fleet_proto import Instance, InstanceStatus, State
from fleet_proto.common import Frozen
from fleet_proto.engines import ENGINE_FACTS, EngineFacts
from fleet_proto.scaling import ScalingPolicy
from fleet_scheduler.placement import PlacementError, place

# Counted as the model's capacity: a starting instance will serve soon, so it is not added twice.
STARTING = frozenset(
    {InstanceStatus.PLACED, InstanceStatus.DOWNLOADING, InstanceStatus.LOADING, InstanceStatus.WARMING}
)
SERVING = STARTING | {InstanceStatus.READY}
SERVING_ROLES = ("both", "decode")  # the roles routing sends a model's requests to
SCALED_ROLE = "both"  # what the policy adds and drains; a disaggregated pair stays the admin's


class InstanceDemand(Frozen):
    """One instance's load as its worker last reported it (NodeMetrics, by instance id)."""

    in_flight: int = 0  # active_requests
    request_slots: int = 0  # request_slots (0: unknown)
    queued_tokens: int = 0  # queued_tokens: prompt tokens still to prefill


class ModelDemand(Frozen):
    """What one model is asked for now."""

    instances: dict[str, InstanceDemand] = {}  # by instance id
    # Requests waiting at the gateways (AdmissionSample.waiting, summed), those waiting for a model
    # with no instance included.
    waiting_requests: int = 0
    ttft_p90_s: float = -1.0  # over recent requests (RequestStats.ttft_s); -1: unknown
    # When a request for it last arrived or ran (route requests, metrics); None: not since the
    # caller started, which counts as idle: the caller gives models with instances its start time.
    last_demand_at: float | None = None


class ScalingHistory(Frozen):
    """What the windows need from earlier calls, per model (times as `now`)."""

    last_up_at: float | None = None  # the last ScaleUp
    last_down_at: float | None = None  # the last ScaleDown
    above_since: float | None = None  # demand asked for more, without a break, since
    below_since: float | None = None  # demand fitted one instance fewer, without a break, since

    @property
    def last_change_at(self) -> float | None:
        return max((t for t in (self.last_up_at, self.last_down_at) if t is not None), default=None)


class ScaleUp(Frozen, tag_field="kind", tag="scale_up"):
    """Place `instance` (placement's choice of node, engine, memory grant), deleting the model's
    failed instances first (`replaces`): each attempt that fails leaves one, not one per attempt."""

    instance: Instance
    reason: str
    replaces: tuple[str, ...] = ()


class ScaleDown(Frozen, tag_field="kind", tag="scale_down"):
    """Delete (drain) `instance_id`: its running requests finish or migrate, as any delete's do."""

    model_id: str
    instance_id: str
    reason: str


class Hold(Frozen, tag_field="kind", tag="scale_hold"):
    """The policy wants a change it does not make now, and why. `waiting_for`: the reason's kind
    (its wait without the numbers), the same from one tick to the next while nothing changes."""

    model_id: str
    reason: str
    waiting_for: str = ""


Decision = ScaleUp | ScaleDown | Hold


class Scaling(Frozen):
    decisions: tuple[Decision, ...] = ()
    history: dict[str, ScalingHistory] = {}  # pass it to the next call


@dataclass(frozen=True)
class _Load:
    """A model's demand summed over its serving instances."""

    requests: int  # in flight + waiting
    waiting: int
    queued_tokens: int
    slots: float  # mean request slots of an instance that reported them (0: none did)
    ttft_p90_s: float

    def describe(self, instances: int) -> str:
        text = f"{_count(self.requests, 'request')} ({self.waiting} waiting)"
        text += f", {self.queued_tokens} prompt tokens queued"
        text += f", TTFT p90 {self.ttft_p90_s:.2f} s" if self.ttft_p90_s >= 0 else ""
        slots = f" of {self.slots:g} slots" if self.slots else ""
        return f"{text} on {_count(instances, 'instance')}{slots}"


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def autoscale(
    state: State,
    policies: Mapping[str, ScalingPolicy],
    demand: Mapping[str, ModelDemand],
    history: Mapping[str, ScalingHistory],
    now: float,
    caps: Mapping[str, EngineFacts] = ENGINE_FACTS,
) -> Scaling:
    """The decisions for every model with an enabled policy, and the history for the next call.
    New instance ids are `auto-<now in ms, hex>-<n>`: the same inputs name the same instances."""
    decisions: list[Decision] = []
    histories: dict[str, ScalingHistory] = {}
    for model_id in sorted(m for m, p in policies.items() if p.enabled):
        serving = serving_instances(state, model_id)
        asked = demand.get(model_id, ModelDemand())
        load = _load(serving, asked)
        model = _Model(model_id, policies[model_id], serving, asked, load, now, state, caps, len(decisions))
        made, histories[model_id] = model.decide(history.get(model_id, ScalingHistory()))
        for up in (d.instance for d in made if isinstance(d, ScaleUp)):
            # the next placement (this model's or another's) counts its memory and leaves its node out
            state = msgspec.structs.replace(state, instances={**state.instances, up.instance_id: up})
        decisions += made
    return Scaling(decisions=tuple(decisions), history=histories)


def serving_instances(state: State, model_id: str) -> tuple[Instance, ...]:
    """The model's instances that serve (or will, once started) its requests, by id."""
    live = (i for i in state.instances.values() if i.model_id == model_id and i.status in SERVING)
    return tuple(sorted((i for i in live if i.role in SERVING_ROLES), key=lambda i: i.instance_id))


def _load(serving: Sequence[Instance], demand: ModelDemand) -> _Load:
    reports = [demand.instances[i.instance_id] for i in serving if i.instance_id in demand.instances]
    slots = [r.request_slots for r in reports if r.request_slots > 0]
    return _Load(
        requests=sum(r.in_flight for r in reports) + demand.waiting_requests,
        waiting=demand.waiting_requests,
        queued_tokens=sum(r.queued_tokens for r in reports),
        slots=sum(slots) / len(slots) if slots else 0.0,
        ttft_p90_s=demand.ttft_p90_s,
    )


def wanted_instances(load: _Load, policy: ScalingPolicy, current: int) -> tuple[int, str]:
    """How many instances the strongest signal asks for, and what it is."""
    asks = [(0, "no demand")]
    if load.requests:
        per_instance = load.slots * policy.target_utilization
        # no slots reported yet (no instance ready): one instance, sized once it reports
        count = math.ceil(load.requests / per_instance) if per_instance > 0 else 1
        target = f"target {per_instance:g} per instance" if per_instance > 0 else "no slots reported yet"
        asks.append((count, f"{load.requests} in flight or waiting ({target})"))
    if (target_tokens := policy.target_queued_tokens) > 0 and load.queued_tokens:
        count = math.ceil(load.queued_tokens / target_tokens)
        asks.append((count, f"{load.queued_tokens} prompt tokens queued (target {target_tokens} each)"))
    if current and 0 < policy.target_ttft_p90_s < load.ttft_p90_s:
        asks.append((current + 1, f"TTFT p90 over its {policy.target_ttft_p90_s:g} s target"))
    return max(asks, key=lambda ask: ask[0])


def fits(load: _Load, policy: ScalingPolicy, count: int) -> bool:
    """Whether `count` instances carry the demand at scale_down_ratio of the targets: below the up
    thresholds, so that removing one does not ask for it back at once."""
    if count <= 0:
        return load.requests == 0 and load.queued_tokens == 0
    share = count * policy.scale_down_ratio
    requests = not load.slots or load.requests <= share * load.slots * policy.target_utilization
    tokens = policy.target_queued_tokens <= 0 or load.queued_tokens <= share * policy.target_queued_tokens
    return requests and tokens and not 0 < policy.target_ttft_p90_s < load.ttft_p90_s


def _since(at: float | None, now: float) -> float:
    return math.inf if at is None else now - at


def spare_nodes(state: State, model_id: str) -> State:
    """`state` with only the nodes that run no live instance of the model: another instance on the
    same node would share its compute, not add to it."""
    busy = {
        node_id
        for i in state.instances.values()
        if i.model_id == model_id and i.status != InstanceStatus.FAILED
        for node_id in {i.node_id, *(s.node_id for s in i.shards)}
    }
    return msgspec.structs.replace(state, nodes={k: v for k, v in state.nodes.items() if k not in busy})


@dataclass(frozen=True)
class _Model:
    """One model's step: its policy, what serves it and what it is asked for, now."""

    model_id: str
    policy: ScalingPolicy
    serving: tuple[Instance, ...]
    demand: ModelDemand
    load: _Load
    now: float
    state: State
    caps: Mapping[str, EngineFacts]
    numbered: int  # decisions made before this model's in this call: numbers its new instances

    def decide(self, past: ScalingHistory) -> tuple[list[Decision], ScalingHistory]:
        policy, n, load, now = self.policy, len(self.serving), self.load, self.now
        wanted, signal = wanted_instances(load, policy, n)
        recent = _since(self.demand.last_demand_at, now) < policy.idle_s
        idle = load.requests == 0 and load.queued_tokens == 0 and not recent
        floor = policy.min_instances if idle else max(policy.min_instances, 1)
        desired = min(max(wanted, floor), policy.max_instances)
        shrinks = desired < n and fits(load, policy, n - 1)
        history = msgspec.structs.replace(
            past,
            above_since=(now if past.above_since is None else past.above_since) if desired > n else None,
            below_since=(now if past.below_since is None else past.below_since) if shrinks else None,
        )
        if desired > wanted:  # a bound or recent demand, not load, sets the count
            ago = _since(self.demand.last_demand_at, now)
            signal = f"min_instances {policy.min_instances}" if policy.min_instances >= desired else ""
            signal = signal or f"demand {ago:.0f} s ago (idle after {policy.idle_s:g} s)"
        elif idle and desired < n:
            signal = f"no demand for {policy.idle_s:g} s"
        elif desired < wanted:
            signal += f", capped by max_instances {policy.max_instances}"
        why = f"{signal}; {load.describe(n)}"
        made: list[Decision] = []
        if desired > n:
            made = self.scale_up(history, desired, why)
        elif desired < n and (shrinks or n > policy.max_instances):
            made = self.scale_down(history, desired, why, idle)
        elif wanted > policy.max_instances == n:
            made = [self.hold(wanted, "at max_instances", why)]
        if any(isinstance(d, ScaleUp) for d in made):  # the windows start over after a change
            history = ScalingHistory(last_up_at=now, last_down_at=history.last_down_at)
        if any(isinstance(d, ScaleDown) for d in made):
            history = ScalingHistory(last_up_at=history.last_up_at, last_down_at=now)
        return made, history

    def hold(self, count: int, wait: str, why: str) -> Hold:
        reason = f"wants {count}, has {len(self.serving)}: {wait}; {why}"
        return Hold(model_id=self.model_id, reason=reason, waiting_for=re.sub(r"\d+(\.\d+)?", "N", wait))

    def scale_up(self, history: ScalingHistory, desired: int, why: str) -> list[Decision]:
        policy, n = self.policy, len(self.serving)
        above, changed = _since(history.above_since, self.now), _since(history.last_change_at, self.now)
        added, wait = _since(history.last_up_at, self.now), ""
        # From zero a request waits, and below min_instances no load needs proving: neither waits for
        # the window, only for an instance added within the cooldown to show in State.
        if n == 0 or n < policy.min_instances:
            if added < policy.scale_up_cooldown_s:
                wait = f"added one {added:.0f} s ago, cooldown {policy.scale_up_cooldown_s:g} s"
        elif starting := [i for i in self.serving if i.status in STARTING]:
            wait = f"{starting[0].instance_id} is {starting[0].status}: its capacity comes first"
        elif above < policy.scale_up_window_s:
            wait = f"above target for {above:.0f} s of the {policy.scale_up_window_s:g} s window"
        elif changed < policy.scale_up_cooldown_s:
            wait = f"changed {changed:.0f} s ago, cooldown {policy.scale_up_cooldown_s:g} s"
        if wait:
            return [self.hold(desired, wait, why)]
        decisions: list[Decision] = []
        state = self.state
        for k in range(n, desired):
            instance_id = f"auto-{int(self.now * 1000):x}-{self.numbered + len(decisions)}"
            if not (spare := spare_nodes(state, self.model_id)).nodes:
                return [*decisions, self.hold(desired, "every node runs an instance of it already", why)]
            try:
                instance = place(spare, self.model_id, instance_id, caps=self.caps)
            except PlacementError as exc:
                return [*decisions, self.hold(desired, f"no node without an instance of it fits: {exc}", why)]
            reason, replaces = f"{k} -> {k + 1} instances: {why}", tuple[str, ...]()
            if not decisions and (failed := self.failed()):
                replaces = tuple(i.instance_id for i in failed)
                reason += "; replaces " + ", ".join(f"{i.instance_id} (failed: {i.reason})" for i in failed)
            decisions.append(ScaleUp(instance=instance, reason=reason, replaces=replaces))
            state = msgspec.structs.replace(state, instances={**state.instances, instance_id: instance})
        return decisions

    def failed(self) -> list[Instance]:
        """The model's failed instances of the role the policy adds, by id."""
        mine = (i for i in self.state.instances.values() if i.model_id == self.model_id)
        failed = (i for i in mine if i.status == InstanceStatus.FAILED and i.role == SCALED_ROLE)
        return sorted(failed, key=lambda i: i.instance_id)

    def scale_down(self, history: ScalingHistory, desired: int, why: str, idle: bool) -> list[Decision]:
        n, delay, wait = len(self.serving), self.policy.scale_down_delay_s, ""
        below, changed = _since(history.below_since, self.now), _since(history.last_change_at, self.now)
        if n <= self.policy.max_instances:  # over the maximum it goes at once
            if below < delay and not idle:  # idle_s was the wait to zero
                wait = f"fits {n - 1} for {below:.0f} s of the {delay:g} s delay"
            elif changed < delay:
                wait = f"changed {changed:.0f} s ago, delay {delay:g} s"
        victims = [i for i in self.serving if i.role == SCALED_ROLE]
        if wait or not victims:
            return [self.hold(desired, wait or f"none of its instances has role {SCALED_ROLE}", why)]

        def load_of(instance: Instance) -> tuple[bool, int, int, str]:
            # one still starting serves nothing yet: it goes first; ties: the lowest id
            report = self.demand.instances.get(instance.instance_id, InstanceDemand())
            ready = instance.status == InstanceStatus.READY
            return ready, report.in_flight, report.queued_tokens, instance.instance_id

        victim = min(victims, key=load_of)
        _, in_flight, queued, _ = load_of(victim)
        drained = f"{victim.instance_id} drains (least loaded: {in_flight} in flight, {queued} tokens queued)"
        reason = f"{n} -> {n - 1} instances, {drained}: {why}"
        return [ScaleDown(model_id=self.model_id, instance_id=victim.instance_id, reason=reason)]
