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
from fleet_proto import NodeMetrics, State
from fleet_proto.routing import ready_instances

# Who is asking, for the queue's fairness: set per request by the limits middleware.
CALLER: ContextVar[str] = ContextVar("fleet_caller", default="anonymous")
RETRY_AFTER_S = 2


@dataclass(frozen=True)
class AdmissionLimits:
    queue: int = 256  # waiting requests in all, in this gateway (0: no queue, never wait)
    queue_per_key: int = 64
    timeout_s: float = 30.0


def full_instances(
    candidates: Iterable[str], slots: Mapping[str, int], running: Mapping[str, int]
) -> set[str]:
    """The candidates running as many requests as they have slots (an unknown capacity: never full)."""
    return {i for i in candidates if slots.get(i, 0) > 0 and running.get(i, 0) >= slots[i]}


def free_slots(candidates: Iterable[str], slots: Mapping[str, int], running: Mapping[str, int]) -> int:
    """Slots free over the candidates; one with an unknown capacity counts as one free slot."""
    return sum(max(slots[i] - running.get(i, 0), 0) if slots.get(i, 0) > 0 else 1 for i in candidates)


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
    corrected by what this gateway sent and saw finish since."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}  # this gateway's requests on each instance
        self._reported: dict[str, int] = {}
        self._since_report: dict[str, int] = {}  # sent minus finished since the last report
        self.slots: dict[str, int] = {}

    def on_sample(self, sample: NodeMetrics) -> None:
        for instance_id, slots in sample.request_slots.items():
            self.slots[instance_id] = slots
            self._reported[instance_id] = sample.active_requests.get(instance_id, 0)
            self._since_report[instance_id] = 0

    def sent(self, instance_id: str) -> None:
        self.in_flight[instance_id] = self.in_flight.get(instance_id, 0) + 1
        self._since_report[instance_id] = self._since_report.get(instance_id, 0) + 1

    def finished(self, instance_id: str) -> None:
        left = self.in_flight.get(instance_id, 0) - 1
        if left > 0:
            self.in_flight[instance_id] = left
        else:
            self.in_flight.pop(instance_id, None)
        self._since_report[instance_id] = self._since_report.get(instance_id, 0) - 1

    def running(self) -> dict[str, int]:
        instances = self.in_flight.keys() | self._reported.keys()
        return {
            i: max(self.in_flight.get(i, 0), self._reported.get(i, 0) + self._since_report.get(i, 0))
            for i in instances
        }


class Admission:
    """The queue in front of routing (one per gateway)."""

    def __init__(
        self,
        state: Callable[[], State],
        limits: AdmissionLimits = AdmissionLimits(),
        priority: Callable[[str], int] = lambda caller: 0,
    ) -> None:
        self._state = state
        self._limits = limits
        self._priority = priority
        self.load = InstanceLoad()
        self._waiting: dict[str, list[Waiter]] = {}  # model id -> its waiters
        # model id -> requests let in that have not sent their task yet: their room is held
        self._entering: dict[str, int] = {}
        self._last_served: dict[str, int] = {}
        self._turns = itertools.count()
        self._arrivals = itertools.count()
        self.refused: dict[str, int] = {}  # reason -> requests refused since start

    def waiting(self) -> dict[str, int]:
        return {m: len(w) for m, w in self._waiting.items() if w}

    def _candidates(self, model_id: str) -> list[str]:
        return [i.instance_id for i in ready_instances(self._state(), model_id)]

    def full(self, model_id: str) -> tuple[str, ...]:
        """The model's ready instances that are full now: a request is routed off them."""
        running = self.load.running()
        return tuple(sorted(full_instances(self._candidates(model_id), self.load.slots, running)))

    def _room(self, model_id: str) -> int:
        candidates = self._candidates(model_id)
        if not candidates:  # no instance at all: routing says so (a queue would wait for nothing)
            return 1
        return free_slots(candidates, self.load.slots, self.load.running()) - self._entering.get(model_id, 0)

    @contextlib.asynccontextmanager
    async def entry(self, model_id: str, caller: str) -> AsyncIterator[Ticket]:
        """Wait, if the model has no room, until it has; refused with a 429 or 503 (ApiError) over a
        bound or past the deadline. Inside, the request tells its ticket where it sent its task and
        when that stream ended (each hop of a moved request)."""
        ticket = Ticket(self, model_id)
        if self._waiting.get(model_id) or self._room(model_id) <= 0:
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
        try:
            await asyncio.wait_for(asyncio.shield(waiter.admitted), self._limits.timeout_s)
        except BaseException as exc:  # past the deadline, or the client went away
            if waiter.admitted.done():  # let in as it gave up: its room goes to the next one
                self.let_go(model_id)
            else:
                self._waiting[model_id].remove(waiter)
                waiter.admitted.cancel()
            if isinstance(exc, TimeoutError):
                busy = f"Every instance of {model_id} stayed busy for {self._limits.timeout_s:g} s."
                raise self._refusal("timeout", 503, busy) from None
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
            room = self._room(model_id)
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
