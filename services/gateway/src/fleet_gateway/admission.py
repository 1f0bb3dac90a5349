"""Admission at saturation: when every ready instance of a model is full, a generation request waits
in a bounded, fair queue instead of piling onto one worker.

Full: an instance runs as many requests as its engine runs at once (NodeMetrics.request_slots). Its
count is what its worker last reported, plus what this gateway sent it since, minus what finished
since (never below what this gateway has in flight there): the report is a second old at most, and
this gateway's own traffic counts at once.

Order: the highest priority first (per caller: an admin sets it, `POST /admission/priorities`), then
callers in turn (the one served longest ago first), then first come, first served within a caller.
Bounds (Retry-After on each refusal): `queue` waiting requests in all (503), `queue_per_key` per
caller (429), and `timeout_s` of waiting (503). Once a slot opens the request is routed as any other,
off the instances still full: the KV-aware router decides where it goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field

from fleet_gateway.errors import ApiError
from fleet_proto import InstanceStatus, NodeMetrics, State
from fleet_proto.routing_view import RoutingView
from fleet_proto.scaling import scales_to_zero_now

# Who is asking, for the queue's fairness: set per request by the limits middleware.
CALLER: ContextVar[str] = ContextVar("fleet_caller", default="anonymous")
RETRY_AFTER_S = 2


@dataclass(frozen=True)
class AdmissionLimits:
    queue: int = 256  # waiting requests in all, in this gateway (0: no queue, never wait)
    queue_per_key: int = 64
    timeout_s: float = 30.0
    cold_start_timeout_s: float = 600.0  # waiting for a model with no instance to get one


# An instance's free slots, and whether it is full.
Occupancy = tuple[int, bool]


def occupancy(slots: int, running: int) -> Occupancy:
    """Full at as many requests as its slots; an unknown capacity (0 slots): one free slot, never full."""
    return (max(slots - running, 0), running >= slots) if slots > 0 else (1, False)


@dataclass(eq=False)
class Waiter:
    caller: str
    priority: int
    number: int  # arrival order
    admitted: asyncio.Future[None] = field(repr=False)


def next_waiter(waiters: Iterable[Waiter], last_served: Mapping[str, int]) -> Waiter:
    """Highest priority; then the caller served longest ago (never: first); then the oldest."""
    return min(waiters, key=lambda w: (-w.priority, last_served.get(w.caller, -1), w.number))


class InstanceLoad:
    """Requests running on each instance, as this gateway knows them: the workers' reports (1 Hz)
    corrected by what this gateway sent and saw finish since. `on_change(instance, before, after)`
    hears every change of an instance's occupancy; change `slots` only through on_sample."""

    def __init__(self, on_change: Callable[[str, Occupancy, Occupancy], None] | None = None) -> None:
        self.in_flight: dict[str, int] = {}  # this gateway's requests on each instance
        self._reported: dict[str, int] = {}
        self._since_report: dict[str, int] = {}  # sent minus finished since the last report
        self.slots: dict[str, int] = {}
        self._on_change = on_change

    def on_sample(self, sample: NodeMetrics) -> None:
        for instance_id, slots in sample.request_slots.items():
            before = self.occupancy(instance_id)
            self.slots[instance_id] = slots
            self._reported[instance_id] = sample.active_requests.get(instance_id, 0)
            self._since_report[instance_id] = 0
            self._changed(instance_id, before)

    def sent(self, instance_id: str) -> None:
        before = self.occupancy(instance_id)
        self.in_flight[instance_id] = self.in_flight.get(instance_id, 0) + 1
        self._since_report[instance_id] = self._since_report.get(instance_id, 0) + 1
        self._changed(instance_id, before)

    def finished(self, instance_id: str) -> None:
        before = self.occupancy(instance_id)
        left = self.in_flight.get(instance_id, 0) - 1
        if left > 0:
            self.in_flight[instance_id] = left
        else:
            self.in_flight.pop(instance_id, None)
        self._since_report[instance_id] = self._since_report.get(instance_id, 0) - 1
        self._changed(instance_id, before)

    def running_on(self, instance_id: str) -> int:
        """running().get(instance_id, 0): unreported, sent minus finished is at most what is in flight."""
        i = instance_id
        return max(self.in_flight.get(i, 0), self._reported.get(i, 0) + self._since_report.get(i, 0))

    def running(self) -> dict[str, int]:
        return {i: self.running_on(i) for i in self.in_flight.keys() | self._reported.keys()}

    def occupancy(self, instance_id: str) -> Occupancy:
        return occupancy(self.slots.get(instance_id, 0), self.running_on(instance_id))

    def _changed(self, instance_id: str, before: Occupancy) -> None:
        if self._on_change is not None and (after := self.occupancy(instance_id)) != before:
            self._on_change(instance_id, before, after)


@dataclass(eq=False)
class Room:
    """One model's candidates (its ready instances on one State), their free slots in all and those
    full (`occupancy` of each), kept as the load changes."""

    candidates: tuple[str, ...]
    free: int
    full: set[str]
    _full_sorted: tuple[str, ...] | None = field(default=None, init=False, repr=False)

    def full_sorted(self) -> tuple[str, ...]:
        if self._full_sorted is None:
            self._full_sorted = tuple(sorted(self.full))
        return self._full_sorted

    def changed(self, instance_id: str, before: Occupancy, after: Occupancy) -> None:
        self.free += after[0] - before[0]
        if after[1] != before[1]:
            (self.full.add if after[1] else self.full.discard)(instance_id)
            self._full_sorted = None


class Admission:
    """The queue in front of routing (one per gateway). `view`: the RoutingView of the State current
    now (the gateway's KeptView, shared with model resolution and routing)."""

    def __init__(
        self,
        view: Callable[[], RoutingView],
        limits: AdmissionLimits = AdmissionLimits(),
        priority: Callable[[str], int] = lambda caller: 0,
    ) -> None:
        self._view = view
        self._limits = limits
        self._priority = priority
        self.load = InstanceLoad(self._load_changed)
        # Rooms of the models asked for on _rooms_state (a new State: rebuilt as asked for again)
        self._rooms_state: State | None = None
        self._rooms: dict[str, Room] = {}
        self._rooms_of: dict[str, list[Room]] = {}  # instance id -> the rooms it is a candidate in
        self._waiting: dict[str, list[Waiter]] = {}  # model id -> its waiters
        # model id -> requests let in that have not sent their task yet: their room is held
        self._entering: dict[str, int] = {}
        self._last_served: dict[str, int] = {}
        self._turns = itertools.count()
        self._arrivals = itertools.count()
        self.refused: dict[str, int] = {}  # reason -> requests refused since start

    def waiting(self) -> dict[str, int]:
        return {m: len(w) for m, w in self._waiting.items() if w}

    def _room_of(self, model_id: str) -> Room:
        """The model's Room on the State current now: its candidates are ready_instances(state,
        model_id), read from the view's index; their load from here on is kept by _load_changed."""
        view = self._view()
        if view.state is not self._rooms_state:
            self._rooms_state, self._rooms, self._rooms_of = view.state, {}, {}
        if (room := self._rooms.get(model_id)) is None:
            candidates = tuple(i.instance_id for i in view.ready(model_id))
            taken = [self.load.occupancy(i) for i in candidates]
            full = {i for i, (_, is_full) in zip(candidates, taken, strict=True) if is_full}
            room = self._rooms[model_id] = Room(candidates, sum(free for free, _ in taken), full)
            for instance_id in candidates:
                self._rooms_of.setdefault(instance_id, []).append(room)
        return room

    def _load_changed(self, instance_id: str, before: Occupancy, after: Occupancy) -> None:
        for room in self._rooms_of.get(instance_id, ()):
            room.changed(instance_id, before, after)

    def full(self, model_id: str) -> tuple[str, ...]:
        """The model's ready instances that are full now: a request is routed off them."""
        return self._room_of(model_id).full_sorted()

    def room(self, model_id: str) -> int:
        """Requests the model takes now without waiting: its free slots less those held for requests
        let in that have not sent yet. With no ready instance: 0 while one is coming (starting), else
        1 (routing says there is none: a queue would wait for nothing)."""
        room = self._room_of(model_id)
        if not room.candidates:
            return 0 if self.starting(model_id) else 1
        return room.free - self._entering.get(model_id, 0)

    def starting(self, model_id: str) -> bool:
        """Whether the model has no ready instance and its scaling policy places one on demand: a
        request waits for it (cold_start_timeout_s), counted as waiting, which is the demand the
        scheduler's autoscaler sees."""
        view = self._view()
        return not view.ready(model_id) and scales_to_zero_now(view.state.scaling.get(model_id))

    def starting_status(self, model_id: str) -> str:
        """Where a cold start is, in words: the model's instances coming up, or none placed yet."""
        state = self._view().state
        coming = sorted(
            (
                i
                for i in state.instances.values()
                if i.model_id == model_id and i.status != InstanceStatus.FAILED
            ),
            key=lambda i: i.instance_id,
        )
        if not coming:
            scaling = state.scaling.get(model_id)
            held = [d.reason for d in scaling.decisions[-1:] if d.kind == "hold"] if scaling else []
            why = f": it holds ({held[0]})" if held else ""
            return f"waiting for the scheduler to place an instance of {model_id}{why}"
        return "; ".join(
            f"{i.instance_id} on {i.node_id or '?'}: {i.status} ({i.progress:.0%})" for i in coming
        )

    @contextlib.asynccontextmanager
    async def entry(self, model_id: str, caller: str) -> AsyncIterator[Ticket]:
        """Wait, if the model has no room, until it has; refused with a 429 or 503 (ApiError) over a
        bound or past the deadline. Inside, the request tells its ticket where it sent its task and
        when that stream ended (each hop of a moved request)."""
        ticket = Ticket(self, model_id)
        if self._waiting.get(model_id) or self.room(model_id) <= 0:
            await self._wait(model_id, caller)  # let in: its room is held (wake counted it)
        else:
            self._entering[model_id] = self._entering.get(model_id, 0) + 1
        ticket.entering = True
        try:
            yield ticket
        finally:
            ticket.close()
            self._last_served[caller] = next(self._turns)
            self.wake()

    async def _wait(self, model_id: str, caller: str) -> None:
        queued = [w for ws in self._waiting.values() for w in ws]
        if len(queued) >= self._limits.queue:
            raise self._refusal(
                "queue_full",
                503,
                f"Every instance of {model_id} is busy and {len(queued)} requests wait already.",
            )
        if sum(w.caller == caller for w in queued) >= self._limits.queue_per_key:
            raise self._refusal(
                "key_queue_full",
                429,
                f"This key has {self._limits.queue_per_key} requests waiting for busy models already.",
            )
        loop = asyncio.get_running_loop()
        waiter = Waiter(caller, self._priority(caller), next(self._arrivals), loop.create_future())
        self._waiting.setdefault(model_id, []).append(waiter)
        cold = self.starting(model_id)
        timeout_s = self._limits.cold_start_timeout_s if cold else self._limits.timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(waiter.admitted), timeout_s)
        except BaseException as exc:  # past the deadline, or the client went away
            if waiter.admitted.done():  # let in as it gave up: its room goes to the next one
                self.let_go(model_id)
            else:
                self._waiting[model_id].remove(waiter)
                waiter.admitted.cancel()
            if isinstance(exc, TimeoutError):
                busy = f"Every instance of {model_id} stayed busy for {timeout_s:g} s."
                if cold:
                    where = self.starting_status(model_id)
                    busy = f"No instance of {model_id} started within {timeout_s:g} s ({where})."
                raise self._refusal("cold_start_timeout" if cold else "timeout", 503, busy) from None
            raise

    def _refusal(self, reason: str, status: int, message: str) -> ApiError:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        code = "queue_limit" if status == 429 else "overloaded"
        return ApiError(
            status,
            f"{message} Retry after {RETRY_AFTER_S} s.",
            code=code,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    def let_go(self, model_id: str) -> None:
        """A request let in has sent its task (the load counts it now) or will not send one."""
        self._entering[model_id] = max(self._entering.get(model_id, 0) - 1, 0)
        self.wake()

    def wake(self) -> None:
        """Let waiters in while their model has room (a slot opened, a report came)."""
        for model_id, waiters in self._waiting.items():
            if not waiters:
                continue
            room = self.room(model_id)
            while waiters and room > 0:
                waiter = next_waiter(waiters, self._last_served)
                waiters.remove(waiter)
                waiter.admitted.set_result(None)
                self._entering[model_id] = self._entering.get(model_id, 0) + 1
                room -= 1


class Ticket:
    """One request's place: where its task went (each hop), so the load counts it at once."""

    def __init__(self, admission: Admission, model_id: str) -> None:
        self._admission = admission
        self.model_id = model_id
        self.entering = False  # let in; its room is held until it sends
        self._on: str = ""  # the instance it runs on now

    def sent(self, instance_id: str) -> None:
        self.ended()
        self._admission.load.sent(instance_id)
        self._on = instance_id
        if self.entering:
            self.entering = False
            self._admission.let_go(self.model_id)

    def ended(self) -> None:
        """Its stream on the instance ended (finished, broken, or moving on)."""
        if self._on:
            self._admission.load.finished(self._on)
            self._on = ""

    def close(self) -> None:
        self.ended()
        if self.entering:
            self.entering = False
            self._admission.let_go(self.model_id)
