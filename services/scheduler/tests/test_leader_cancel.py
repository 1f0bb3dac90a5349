"""A leader's campaign ends when cancelled even when the cancel reaches it inside a NATS call that
drops it (Python 3.11's asyncio.wait_for, inside nats-py, can return a reply that races a cancel and
forget the cancel). FakeBus and FakeKV stand in for NATS and its KV bucket: FakeKV's update drops
the cancel the way that race does."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from fleet_scheduler.leader import LeaderLease

pytestmark = pytest.mark.unit


class FakeKV:
    def __init__(self) -> None:
        self.updating = asyncio.Event()

    async def status(self) -> SimpleNamespace:
        return SimpleNamespace(ttl=3.0)

    async def create(self, key: str, value: bytes) -> int:
        return 1

    async def update(self, key: str, value: bytes, last: int) -> int:
        self.updating.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass  # the reply came as the cancel did: returned, the cancel forgotten
        return last + 1

    async def delete(self, key: str, last: int) -> None:
        return None


class FakeBus:
    def __init__(self, kv: FakeKV) -> None:
        self.timeout_s = 1.0
        self.js = SimpleNamespace(key_value=self._key_value)
        self._kv = kv

    async def _key_value(self, bucket: str) -> FakeKV:
        return self._kv


async def test_a_cancel_dropped_inside_a_renewal_still_ends_the_campaign() -> None:
    kv = FakeKV()
    lease = LeaderLease(FakeBus(kv), "sched-a", ttl_s=3.0, renew_every_s=0.01)  # type: ignore[arg-type]
    elected, lost = asyncio.Event(), asyncio.Event()

    async def on_elected() -> None:
        elected.set()

    async def on_lost() -> None:
        lost.set()

    campaign = asyncio.create_task(lease.run(on_elected, on_lost))
    await asyncio.wait_for(elected.wait(), 1)
    await asyncio.wait_for(kv.updating.wait(), 1)  # a renewal is in flight
    campaign.cancel()
    done, _ = await asyncio.wait({campaign}, timeout=1)
    if not done:  # the cancel was lost: end the campaign the way the cancel did not, then fail
        await lease.release()
        await asyncio.wait({campaign}, timeout=5)
    assert done and campaign.cancelled(), "the campaign went on after its cancel"
    assert lost.is_set() and not lease.is_leader
