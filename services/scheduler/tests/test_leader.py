"""LeaderLease against a real nats-server: one leader, handover on release, on crash, and step-down."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable

import msgspec
import pytest

from fleet_bus import Bus, ensure_streams
from fleet_bus.streams import LEADER_TTL_S
from fleet_local.servers import restart
from fleet_proto.subjects import LEADER_BUCKET
from fleet_scheduler.leader import LEADER_KEY, LeaderLease, LeaseValue, read_lease

STOP_STAGE_S = 10.0


class Candidate:
    """A LeaderLease on its own connection, recording when it was elected and when it lost."""

    def __init__(self, bus: Bus, name: str, **lease_options: float) -> None:
        self.bus = bus
        self.name = name
        self.lease = LeaderLease(bus, name, **lease_options)
        self.elected = asyncio.Event()
        self.lost = asyncio.Event()
        self.log: list[tuple[str, float]] = []
        self.task: asyncio.Task[None] | None = None

    async def _on_elected(self) -> None:
        self.log.append(("elected", time.monotonic()))
        self.lost.clear()
        self.elected.set()

    async def _on_lost(self) -> None:
        self.log.append(("lost", time.monotonic()))
        self.elected.clear()
        self.lost.set()

    def start(self) -> None:
        self.task = asyncio.create_task(self.lease.run(self._on_elected, self._on_lost))

    def at(self, what: str) -> float:
        return next(t for kind, t in reversed(self.log) if kind == what)

    async def stop(self) -> None:
        """Cancel the campaign and close the connection, each bounded: a stage that hangs fails the
        test by name instead of running into pytest's timeout."""
        if self.task is not None:
            self.task.cancel()
            gathered = asyncio.gather(self.task, return_exceptions=True)
            await self._bounded(gathered, "LeaderLease.run ignored cancellation")
        if not self.bus.nc.is_closed:
            await self._bounded(self.bus.nc.close(), "closing the NATS connection hung")

    async def _bounded(self, stage: Awaitable[object], what: str) -> None:
        try:
            async with asyncio.timeout(STOP_STAGE_S):
                await stage
        except TimeoutError:
            pytest.fail(f"{self.name}: {what} for {STOP_STAGE_S} s")


@pytest.fixture
async def connect(fresh_nats) -> AsyncIterator:
    candidates: list[Candidate] = []

    async def make(name: str, **lease_options: float) -> Candidate:
        bus = await Bus.connect(fresh_nats.url, name)
        await ensure_streams(bus.js)
        candidate = Candidate(bus, name, **lease_options)
        candidates.append(candidate)
        return candidate

    yield make
    for candidate in candidates:
        await candidate.stop()


async def first_elected(*candidates: Candidate, timeout_s: float) -> Candidate:
    waits = {asyncio.create_task(c.elected.wait()): c for c in candidates}
    done, pending = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    assert done, f"nobody was elected within {timeout_s} s"
    return waits[done.pop()]


async def test_exactly_one_of_two_is_elected_and_keeps_the_lease(connect):
    a, b = await connect("sched-a"), await connect("sched-b")
    a.start()
    b.start()
    leader = await first_elected(a, b, timeout_s=2)
    follower = b if leader is a else a
    await asyncio.sleep(LEADER_TTL_S + 1)  # well past the TTL: the renewals keep it
    assert leader.lease.is_leader and not follower.lease.is_leader
    assert [kind for kind, _ in leader.log] == ["elected"]
    assert follower.log == []
    lease = await read_lease(follower.bus)
    assert lease is not None and lease.holder == leader.name and lease.pid == os.getpid()


async def test_release_hands_the_lease_over_within_a_second(connect):
    a, b = await connect("sched-a"), await connect("sched-b")
    a.start()
    await asyncio.wait_for(a.elected.wait(), 2)
    b.start()
    await asyncio.sleep(0.6)  # b is following, retrying
    released = time.monotonic()
    await a.lease.release()
    assert a.lost.is_set() and not a.lease.is_leader  # on_lost ran before the key was deleted
    await asyncio.wait_for(b.elected.wait(), 2)
    takeover = b.at("elected") - released
    print(f"takeover after release: {takeover:.2f} s")
    assert takeover < 1.0
    assert a.at("lost") <= released + 0.5
    await asyncio.wait_for(a.task, 1)  # run() returns after release: a does not campaign again
    assert (await read_lease(a.bus)).holder == "sched-b"


async def test_a_crashed_leader_is_replaced_within_five_seconds(connect):
    a, b = await connect("sched-a"), await connect("sched-b")
    a.start()
    await asyncio.wait_for(a.elected.wait(), 2)
    b.start()
    await asyncio.sleep(1.5)  # a has renewed at least once since b started following
    crashed = time.monotonic()
    await a.bus.nc.close()  # no release: the lease stays until the bucket's TTL expires it
    await asyncio.wait_for(b.elected.wait(), 6)
    takeover = b.at("elected") - crashed
    print(f"takeover after crash: {takeover:.2f} s")
    assert takeover < 5.0
    # a noticed it could not renew and stepped down before b could take over
    await asyncio.wait_for(a.lost.wait(), 1)
    assert a.at("lost") < b.at("elected")
    assert not a.lease.is_leader


async def test_a_leader_cut_off_from_nats_steps_down_before_its_lease_expires(connect, fresh_nats):
    a = await connect("sched-a")
    a.start()
    await asyncio.wait_for(a.elected.wait(), 2)
    os.kill(fresh_nats.pid, signal.SIGSTOP)  # NATS hangs: renewals time out instead of failing fast
    frozen = time.monotonic()
    try:
        await asyncio.wait_for(a.lost.wait(), LEADER_TTL_S)
        stepped_down = a.at("lost") - frozen
        print(f"stepped down {stepped_down:.2f} s after NATS froze")
        # the last renewal was sent before the freeze, so the key lives at least TTL after `frozen`
        assert stepped_down < LEADER_TTL_S - 0.2
        assert not a.lease.is_leader
    finally:
        os.kill(fresh_nats.pid, signal.SIGCONT)
    # once NATS is back, a is elected again (its own lease either expired or is adopted)
    await asyncio.wait_for(a.elected.wait(), LEADER_TTL_S + 3)


async def test_the_leader_leads_again_within_5_s_of_a_killed_nats_being_restarted(connect, fresh_nats):
    """SIGKILL nats-server, restart it on the same port and store: the lease survives in the file
    store (or has expired), and the leader that stepped down during the outage is elected again."""
    a = await connect("sched-a")
    a.start()
    await asyncio.wait_for(a.elected.wait(), 2)
    os.kill(fresh_nats.pid, signal.SIGKILL)
    await asyncio.wait_for(a.lost.wait(), LEADER_TTL_S)  # it cannot renew: it steps down
    handle = await asyncio.to_thread(restart, fresh_nats)
    back = time.monotonic()
    try:
        await asyncio.wait_for(a.elected.wait(), 5)
        print(f"leader again {a.at('elected') - back:.2f} s after NATS was back")
        assert a.lease.is_leader
        assert (await read_lease(a.bus)).holder == "sched-a"
    finally:
        await a.stop()
        handle.stop()


async def test_a_leader_whose_lease_was_taken_steps_down_at_its_next_renewal(connect):
    a, b = await connect("sched-a"), await connect("sched-b")
    a.start()
    await asyncio.wait_for(a.elected.wait(), 2)
    kv = await b.bus.js.key_value(LEADER_BUCKET)
    stolen = LeaseValue(holder="sched-b", since=time.time())
    await kv.put(LEADER_KEY, msgspec.json.encode(stolen))  # not compare-and-set: it overwrites a's
    await asyncio.wait_for(a.lost.wait(), 1.5)  # the next renewal's compare-and-set fails
    assert not a.lease.is_leader
    await asyncio.sleep(0.5)
    assert not a.elected.is_set()  # and it does not take the key back while b's value is there


async def test_a_lease_that_names_us_is_adopted(connect):
    a = await connect("sched-a")
    kv = await a.bus.js.key_value(LEADER_BUCKET)
    await kv.create(LEADER_KEY, msgspec.json.encode(LeaseValue(holder="sched-a", since=time.time())))
    a.start()  # e.g. a create whose reply was lost: the key is ours even though we never heard so
    await asyncio.wait_for(a.elected.wait(), 1)


async def test_lead_runs_jobs_only_while_leader_and_a_crashing_job_ends_it(connect):
    a, b = await connect("sched-a"), await connect("sched-b")
    running: dict[str, int] = {"sched-a": 0, "sched-b": 0}
    crash = asyncio.Event()

    def job(name: str):
        async def run() -> None:
            running[name] += 1
            try:
                await crash.wait()
                raise RuntimeError(f"{name} job failed")
            finally:
                running[name] -= 1

        return run

    lead_a = asyncio.create_task(a.lease.lead({"job": job("sched-a")}))
    await asyncio.sleep(0.3)
    lead_b = asyncio.create_task(b.lease.lead({"job": job("sched-b")}))
    await asyncio.sleep(0.5)
    assert running == {"sched-a": 1, "sched-b": 0}
    crash.set()
    with pytest.raises(RuntimeError, match="sched-a job failed"):
        await asyncio.wait_for(lead_a, 2)
    crash.clear()
    assert running["sched-a"] == 0
    await a.lease.release()  # what the service's shutdown does after its tasks stopped
    for _ in range(20):
        if running["sched-b"]:
            break
        await asyncio.sleep(0.1)
    assert running == {"sched-a": 0, "sched-b": 1}
    lead_b.cancel()
    await asyncio.gather(lead_b, return_exceptions=True)
    assert running["sched-b"] == 0  # cancelling lead() stops the jobs
    with contextlib.suppress(Exception):
        await b.lease.release()


async def test_ensure_streams_brings_an_old_leader_bucket_to_the_current_ttl(fresh_nats):
    bus = await Bus.connect(fresh_nats.url, "test")
    try:
        await bus.js.create_key_value(bucket=LEADER_BUCKET, history=1, ttl=10.0)  # an older release's
        await ensure_streams(bus.js)
        info = await bus.js.stream_info(f"KV_{LEADER_BUCKET}")
        assert info.config.max_age == pytest.approx(LEADER_TTL_S)
        assert info.config.duplicate_window <= LEADER_TTL_S
        await ensure_streams(bus.js)  # idempotent
    finally:
        await bus.close()


def test_renewing_slower_than_the_ttl_allows_is_refused():
    with pytest.raises(ValueError, match="renew_every_s"):
        LeaderLease(None, "x", ttl_s=3.0, renew_every_s=2.8)  # type: ignore[arg-type]
