"""Scheduler high availability with real servers: two scheduler processes, SIGKILL the leader.

The lease lives in the JetStream KV bucket `fleet-leader` (fleet_scheduler.leader); the follower must
hold it within 5 s of the leader's death and then be the one that consumes commands.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from fleet_bus import Bus, ensure_streams
from fleet_local.processes import pid_alive, process_started_at, spawn, stop_pid
from fleet_proto import CreateInstance, InstancePlaced
from fleet_proto.subjects import event_subject
from fleet_scheduler.leader import LeaseValue, read_lease

# Both tests need main.py to run the scheduler's leader-only work under a LeaderLease (without that
# wiring no scheduler process takes the lease at all).

TAKEOVER_LIMIT_S = 5.0


class Scheduler(msgspec.Struct):
    proc: subprocess.Popen
    started_at: float
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@pytest.fixture
def schedulers(fresh_nats, redis_server, tmp_path: Path) -> Iterator[list[Scheduler]]:
    env = os.environ | {
        "FLEET_NATS_URL": fresh_nats.url,
        "FLEET_REDIS_URL": redis_server.url,
        "FLEET_HEALTH_PORT": "0",
        "FLEET_LOG_FORMAT": "text",
    }
    started: list[Scheduler] = []
    try:
        for index in range(2):
            log_path = tmp_path / f"scheduler-{index}.log"
            proc = spawn([sys.executable, "-m", "fleet_scheduler"], log_path, env=env)
            started.append(Scheduler(proc, process_started_at(proc.pid), log_path))
        yield started
    finally:
        for scheduler in started:
            stop_pid(scheduler.proc.pid, scheduler.started_at)


@pytest.fixture
async def bus(fresh_nats) -> AsyncIterator[Bus]:
    bus = await Bus.connect(fresh_nats.url, "test-failover")
    await ensure_streams(bus.js)
    yield bus
    await bus.close()


async def wait_for_lease(
    bus: Bus, schedulers: list[Scheduler], timeout_s: float, not_pid: int = 0
) -> tuple[LeaseValue, float]:
    """The lease once a live scheduler (other than not_pid) holds it, and when that was first seen."""
    pids = {s.proc.pid for s in schedulers} - {not_pid}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lease = await read_lease(bus)
        if lease is not None and lease.pid in pids:
            return lease, time.monotonic()
        for scheduler in schedulers:
            if scheduler.proc.pid != not_pid and scheduler.proc.poll() is not None:
                pytest.fail(f"a scheduler exited early:\n{scheduler.log_tail()}")
        await asyncio.sleep(0.05)
    logs = "\n---\n".join(s.log_tail() for s in schedulers)
    pytest.fail(f"no scheduler held the lease within {timeout_s} s (now {lease}):\n{logs}")


async def kill_the_leader(bus: Bus, schedulers: list[Scheduler]) -> tuple[LeaseValue, LeaseValue, float]:
    """Wait for a leader, SIGKILL it, wait for the other to hold the lease: (old, new, seconds taken)."""
    old, _ = await wait_for_lease(bus, schedulers, timeout_s=60)
    await asyncio.sleep(1.5)  # the follower is up and following, the leader has renewed
    assert (await read_lease(bus)).holder == old.holder  # still the same leader: the lease is renewed
    victim = next(s for s in schedulers if s.proc.pid == old.pid)
    os.kill(victim.proc.pid, signal.SIGKILL)  # no goodbye: the lease is freed only by its TTL
    killed = time.monotonic()
    victim.proc.wait(timeout=5)
    new, seen = await wait_for_lease(bus, schedulers, timeout_s=TAKEOVER_LIMIT_S + 5, not_pid=old.pid)
    assert new.holder != old.holder
    return old, new, seen - killed


async def test_the_follower_takes_the_lease_within_5_s_of_the_leader_being_killed(bus, schedulers):
    old, new, takeover = await kill_the_leader(bus, schedulers)
    print(f"takeover after SIGKILL: {takeover:.2f} s ({old.holder} -> {new.holder})")
    assert takeover < TAKEOVER_LIMIT_S
    survivor = next(s for s in schedulers if s.proc.pid == new.pid)
    assert pid_alive(survivor.proc.pid, survivor.started_at)


async def test_the_new_leader_consumes_commands(bus, schedulers):
    await kill_the_leader(bus, schedulers)
    placed = await bus.nc.subscribe(event_subject(InstancePlaced))
    try:
        # State has no nodes: placement fails and the instance is placed as failed, which still shows
        # that the new leader consumed the command.
        await bus.publish_command(
            CreateInstance(command_id="cmd-failover", model_id="tiny/model", instance_id="inst-failover")
        )
        deadline = time.monotonic() + 10
        while True:
            msg = await placed.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            instance = json.loads(msg.data)["instance"]
            if instance["instance_id"] == "inst-failover":
                break
        assert instance["status"] == "failed"
    finally:
        await placed.unsubscribe()


async def test_a_leader_stopped_with_sigterm_releases_the_lease_to_the_follower(bus, schedulers):
    old, _ = await wait_for_lease(bus, schedulers, timeout_s=60)
    await asyncio.sleep(1.0)  # the follower is up and campaigning
    leader = next(s for s in schedulers if s.proc.pid == old.pid)
    os.kill(old.pid, signal.SIGTERM)  # graceful: the leader stops its duties and deletes the lease
    stopped = time.monotonic()
    leader.proc.wait(timeout=30)
    # The handover is the release (a compare-and-set delete), not the TTL running out: the leader's
    # own log says so. (Takeover times are measured, not asserted: the machine may be loaded.)
    assert "released the leader lease" in leader.log_tail(), leader.log_tail()
    new, seen = await wait_for_lease(bus, schedulers, timeout_s=TAKEOVER_LIMIT_S, not_pid=old.pid)
    print(f"takeover after SIGTERM: {seen - stopped:.2f} s")
    assert new.holder != old.holder
