"""The leader's autoscaler: once a tick, the demand the DemandFeed folded and the State's policies go
through autoscale() (pure), and its decisions are carried out through the Placer: a ScaleUp places
its instance, a ScaleDown drains one (as DeleteInstance does: requests finish or migrate). Every
ScaleUp and ScaleDown is recorded as a ScalingDecided event with its reason; a Hold when a model starts
holding or holds for another reason, and then at most once a HOLD_EVERY_S, so that the State shows
why nothing moves without an event a second."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial

import msgspec

from fleet_proto import DeleteInstance, InstanceDeleted, ScalingDecided, ScalingDecision, State
from fleet_scheduler.autoscale import (
    Decision,
    Hold,
    ModelDemand,
    ScaleDown,
    ScaleUp,
    ScalingHistory,
    autoscale,
)
from fleet_scheduler.demand import DemandFeed
from fleet_scheduler.placer import Placer, deletion

log = logging.getLogger("fleet_scheduler.scaler")

AUTOSCALE_EVERY_S = 1.0
HOLD_EVERY_S = 60.0
PLACED_SHOWS_S = 5.0  # wait this long for our own InstancePlaced to be folded before the next tick


def seeded_history(state: State) -> dict[str, ScalingHistory]:
    """The windows a new leader starts from: when each model last scaled, as the State recorded it
    (a leader change must not let a model flap at once)."""
    history = {}
    for model_id, scaling in state.scaling.items():
        ups = [d.at for d in scaling.decisions if d.kind == "scale_up"]
        downs = [d.at for d in scaling.decisions if d.kind == "scale_down"]
        history[model_id] = ScalingHistory(
            last_up_at=max(ups, default=None), last_down_at=max(downs, default=None)
        )
    return history


def recorded(decision: Decision, now: float) -> tuple[str, ScalingDecision]:
    """The model a decision is about, and the decision as the State keeps it."""
    match decision:
        case ScaleUp():
            kept = ScalingDecision(
                kind="scale_up", reason=decision.reason, instance_id=decision.instance.instance_id, at=now
            )
            return decision.instance.model_id, kept
        case ScaleDown():
            kept = ScalingDecision(
                kind="scale_down", reason=decision.reason, instance_id=decision.instance_id, at=now
            )
            return decision.model_id, kept
        case Hold():
            return decision.model_id, ScalingDecision(kind="hold", reason=decision.reason, at=now)


def with_start_time(
    demand: Mapping[str, ModelDemand], models: list[str], started_at: float
) -> dict[str, ModelDemand]:
    """Demand for every model with a policy; one not asked for since this leader started counts
    as asked for at its start: a new leader does not scale a model to zero at once."""
    out = dict(demand)
    for model_id in models:
        asked = out.get(model_id, ModelDemand())
        if asked.last_demand_at is None:
            out[model_id] = msgspec.structs.replace(asked, last_demand_at=started_at)
    return out


class Autoscaler:
    def __init__(
        self,
        state: Callable[[], State],
        feed: DemandFeed,
        placer: Placer,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._state = state
        self._feed = feed
        self._placer = placer
        self._clock = clock
        self._history: dict[str, ScalingHistory] | None = None
        # model -> the Hold it is in (its waiting_for) and when that was last recorded
        self._holding: dict[str, tuple[str, float]] = {}
        self._started_at = clock()

    async def tick(self) -> list[Decision]:
        """One round: decide, then carry out and record what was decided."""
        state, now = self._state(), self._clock()
        policies = {m: s.policy for m, s in state.scaling.items() if s.policy.enabled}
        if not policies:
            return []
        if self._history is None:
            self._history = seeded_history(state)
        models = {i.instance_id: i.model_id for i in state.instances.values()}
        demand = with_start_time(self._feed.demand(now, models), sorted(policies), self._started_at)
        result = autoscale(state, policies, demand, self._history, now)
        self._history = dict(result.history)
        for decision in result.decisions:
            await self._carry_out(state, decision, now)
        return list(result.decisions)

    async def _carry_out(self, state: State, decision: Decision, now: float) -> None:
        model_id, kept = recorded(decision, now)
        match decision:
            case ScaleUp():
                log.warning("autoscale %s: placing %s: %s", model_id, kept.instance_id, kept.reason)
                await self._placer.publish(*(InstanceDeleted(instance_id=i) for i in decision.replaces))
                await self._placer.place(decision.instance)
            case ScaleDown():
                log.warning("autoscale %s: draining %s: %s", model_id, kept.instance_id, kept.reason)
                command = DeleteInstance(
                    command_id=f"autoscale-{kept.instance_id}", instance_id=kept.instance_id
                )
                if (event := deletion(state, command)) is not None:
                    await self._placer.publish(event)
            case Hold():
                holding = self._holding.get(model_id)
                if holding and holding[0] == decision.waiting_for and now - holding[1] < HOLD_EVERY_S:
                    return  # holding still, for the same reason: recorded recently enough
                self._holding[model_id] = (decision.waiting_for, now)
        if not isinstance(decision, Hold):
            self._holding.pop(model_id, None)
        await self._placer.publish(ScalingDecided(model_id=model_id, decision=kept))

    async def run(self, wait_for: Callable[[Callable[[State], bool], float], Awaitable[State]]) -> None:
        """Tick every AUTOSCALE_EVERY_S; after a ScaleUp, until State shows the instance (so the
        next tick counts it). `wait_for`: the follower's."""
        while True:
            await asyncio.sleep(AUTOSCALE_EVERY_S)
            decisions = await self.tick()
            placed = {d.instance.instance_id for d in decisions if isinstance(d, ScaleUp)}
            if placed:
                with contextlib.suppress(TimeoutError):
                    await wait_for(partial(_shows, placed), PLACED_SHOWS_S)


def _shows(instance_ids: set[str], state: State) -> bool:
    return instance_ids <= state.instances.keys()
