"""Leader election for scheduler replicas: a lease on one key of the JetStream KV bucket `fleet-leader`.

Every replica runs a LeaderLease. The one whose `create` of the key succeeds is the leader: it renews
the key with compare-and-set updates (`update(last=revision)`) every renew_every_s, and only it runs the
leader-only work (consuming commands, timers). The bucket's TTL (max_age) makes a lease that is not
renewed expire on its own, so when the leader dies without a goodbye (SIGKILL, lost host), a follower's
next `create` succeeds about TTL after the leader's last renewal; a leader that shuts down cleanly
deletes the key (`release`) and a follower takes over within one retry interval.

Safety: a leader that cannot renew (NATS unreachable, slow) steps down, calling on_lost, once
ttl_s - margin_s has passed since it *sent* its last successful write. The server stored that write
no earlier than it was sent, so the key cannot expire, and nobody else can create it, before then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import msgspec
import nats.errors
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from fleet_bus import Bus, error_text
from fleet_bus.cancel import raise_if_cancelling
from fleet_bus.streams import LEADER_TTL_S
from fleet_proto.subjects import LEADER_BUCKET

log = logging.getLogger("fleet_scheduler.leader")

LEADER_KEY = "scheduler"
RENEW_EVERY_S = 1.0
RETRY_EVERY_S = 0.5
MARGIN_S = 0.5

# What a KV operation may fail with when NATS is unreachable, slow or refuses us (besides CAS failures).
_NATS_TROUBLE = (TimeoutError, OSError, nats.errors.Error)


class LeaseValue(msgspec.Struct, kw_only=True):
    """The JSON stored under the lease key: who leads, since when (unix time), and where it runs."""

    holder: str
    since: float
    pid: int = 0
    host: str = ""


async def read_lease(bus: Bus, key: str = LEADER_KEY) -> LeaseValue | None:
    """The current lease holder, or None when nobody holds it (never held, released or expired)."""
    kv = await bus.js.key_value(LEADER_BUCKET)
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:  # KeyDeletedError is a KeyNotFoundError too
        return None
    if not entry.value:
        return None
    return msgspec.json.decode(entry.value, type=LeaseValue)


class LeaderLease:
    """One replica's side of the election. `run` campaigns until cancelled or `release`d.

    holder_id must be unique per process (the service id). The bucket's TTL is what frees the lease of a
    dead leader; if the bucket's TTL is shorter than ttl_s, the lease uses the bucket's.
    """

    def __init__(
        self,
        bus: Bus,
        holder_id: str,
        ttl_s: float = LEADER_TTL_S,
        renew_every_s: float = RENEW_EVERY_S,
        *,
        key: str = LEADER_KEY,
        retry_every_s: float = RETRY_EVERY_S,
        margin_s: float = MARGIN_S,
    ) -> None:
        if not 0 < renew_every_s < ttl_s - margin_s:
            raise ValueError(
                f"renew_every_s ({renew_every_s}) must be positive and below ttl_s - margin_s "
                f"({ttl_s} - {margin_s})"
            )
        self._bus = bus
        self.holder_id = holder_id
        self.ttl_s = ttl_s
        self.renew_every_s = renew_every_s
        self.retry_every_s = retry_every_s
        self.margin_s = margin_s
        self.key = key
        self._kv: KeyValue | None = None
        self._value = b""
        self._revision: int | None = None  # of our last successful write, while we may hold the key
        self._leader = False
        self._deadline = 0.0  # monotonic time by which we step down unless a renewal succeeds
        self._stop = asyncio.Event()
        self._not_leading = asyncio.Event()  # clear from election until on_lost has returned
        self._not_leading.set()
        self._lock = asyncio.Lock()  # one write on the key at a time (renew vs release)

    @property
    def is_leader(self) -> bool:
        return self._leader and time.monotonic() < self._deadline

    async def run(
        self, on_elected: Callable[[], Awaitable[None]], on_lost: Callable[[], Awaitable[None]]
    ) -> None:
        """Campaign for the lease; call on_elected when we get it and on_lost when we no longer hold it.

        on_lost follows every on_elected exactly once: when a renewal fails, when the lease is
        released, when on_elected raises, and when this task is cancelled (shutdown). on_elected should
        start the leader-only work and return; renewals run while it does. Returns after release().
        """
        kv = await self._bucket()
        while kv is not None and await self._acquire(kv):
            self._not_leading.clear()
            renewer = asyncio.create_task(self._renew(kv), name=f"lease-renew-{self.key}")
            try:
                await on_elected()
                await renewer
            finally:
                renewer.cancel()
                await asyncio.gather(renewer, return_exceptions=True)
                self._leader = False
                try:
                    await on_lost()
                finally:
                    self._not_leading.set()

    async def lead(self, jobs: Mapping[str, Callable[[], Coroutine[Any, Any, Any]]]) -> None:
        """Run each job (name -> coroutine function) as a task for as long as we are the leader.

        Jobs are cancelled when leadership ends and started again on the next election. A job that
        raises ends leadership and raises out of lead(), so a service that spawned lead() stops (and
        a healthy replica takes over) rather than stay leader without doing the leader's work.
        """
        tasks: list[asyncio.Task[Any]] = []
        crashed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

        def on_done(task: asyncio.Task[Any]) -> None:
            if task.cancelled() or crashed.done():
                return
            exc = task.exception()
            crashed.set_result(exc or RuntimeError(f"leader job {task.get_name()} returned"))

        async def on_elected() -> None:
            log.info("%s is the leader: starting %s", self.holder_id, ", ".join(jobs))
            for name, job in jobs.items():
                task = asyncio.create_task(job(), name=name)
                task.add_done_callback(on_done)
                tasks.append(task)

        async def on_lost() -> None:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            tasks.clear()

        campaign = asyncio.create_task(self.run(on_elected, on_lost), name=f"lease-{self.key}")
        either: list[asyncio.Future[Any]] = [campaign, crashed]
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not campaign.done():
                campaign.cancel()
            await asyncio.gather(campaign, return_exceptions=True)
        if crashed.done():
            raise crashed.result()
        campaign.result()  # raises what run() raised

    async def release(self) -> None:
        """Stop campaigning and delete the key if we hold it, so a follower takes over at once.

        If run() is leading, its on_lost is awaited first, so the leader-only work has stopped before
        a follower can be elected. Safe to call at any time (also after run() was cancelled); the
        delete is compare-and-set, so it never removes another holder's lease.
        """
        self._stop.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.ttl_s):
                await self._not_leading.wait()
        async with self._lock:
            revision, self._revision = self._revision, None
            self._leader = False
            if revision is None or self._kv is None:
                return
            try:
                async with asyncio.timeout(self._bus.timeout_s):
                    try:
                        await self._kv.delete(self.key, last=revision)
                    except KeyWrongLastSequenceError:
                        # a renewal cancelled by the shutdown may have landed after all (the key
                        # names us at a later revision): delete that one; else it is not ours
                        await self._kv.delete(self.key, last=await self._own_revision(self._kv))
            except (*_NATS_TROUBLE, KeyWrongLastSequenceError) as exc:
                log.warning("could not release the leader lease (it will expire): %s", error_text(exc))
            else:
                log.info("%s released the leader lease", self.holder_id)

    async def _own_revision(self, kv: KeyValue) -> int:
        """The key's revision while it names us; KeyWrongLastSequenceError when it does not."""
        entry = await self._own_entry(kv)
        if entry is None:
            raise KeyWrongLastSequenceError
        return entry[0]

    async def _own_entry(self, kv: KeyValue) -> tuple[int, bytes] | None:
        """The key's revision and value while it names us; None when it is gone, junk or another's."""
        try:
            entry = await kv.get(self.key)
            current = msgspec.json.decode(entry.value or b"", type=LeaseValue)
        except (KeyNotFoundError, msgspec.DecodeError):  # gone in between (next create wins), or junk
            return None
        if current.holder != self.holder_id or entry.revision is None or not entry.value:
            return None
        return entry.revision, entry.value

    async def _bucket(self) -> KeyValue | None:
        """Bind to the bucket (created by ensure_streams), waiting for it; None once released."""
        warned = False
        while not self._stop.is_set():
            try:
                async with asyncio.timeout(self._bus.timeout_s):
                    kv = await self._bus.js.key_value(LEADER_BUCKET)
                    bucket_ttl = (await kv.status()).ttl
            except (*_NATS_TROUBLE, BucketNotFoundError) as exc:
                raise_if_cancelling()
                if not warned:
                    log.warning("leader bucket %s not available yet: %s", LEADER_BUCKET, error_text(exc))
                    warned = True
                await self._sleep(self.retry_every_s)
                continue
            if not bucket_ttl:
                log.error("bucket %s has no TTL: a dead leader's lease will never expire", LEADER_BUCKET)
            elif bucket_ttl < self.ttl_s:
                log.warning(
                    "bucket %s TTL is %.1f s, below the lease's %.1f s", LEADER_BUCKET, bucket_ttl, self.ttl_s
                )
                self.ttl_s = bucket_ttl
                self.renew_every_s = min(self.renew_every_s, (bucket_ttl - self.margin_s) / 2)
            self._kv = kv
            return kv
        return None

    async def _acquire(self, kv: KeyValue) -> bool:
        """Try to create the key every retry_every_s until we hold it (True) or are released (False)."""
        warned = False
        while not self._stop.is_set():
            value = LeaseValue(
                holder=self.holder_id, since=time.time(), pid=os.getpid(), host=socket.gethostname()
            )
            payload = msgspec.json.encode(value)
            sent = time.monotonic()
            revision = None
            try:
                async with asyncio.timeout(self.ttl_s - self.margin_s), self._lock:
                    if self._stop.is_set():
                        return False
                    try:
                        revision = await kv.create(self.key, payload)
                    except KeyWrongLastSequenceError:
                        revision, payload = await self._adopt(kv)
            except _NATS_TROUBLE as exc:
                raise_if_cancelling()
                if not warned:
                    log.warning("cannot reach the leader lease: %s", error_text(exc))
                    warned = True
            if revision is not None and time.monotonic() < sent + self.ttl_s - self.margin_s:
                self._value = payload
                self._revision = revision
                self._deadline = sent + self.ttl_s - self.margin_s
                self._leader = True
                log.info("%s holds the leader lease (revision %d)", self.holder_id, revision)
                return True
            await self._sleep(self.retry_every_s)
        return False

    async def _adopt(self, kv: KeyValue) -> tuple[int | None, bytes]:
        """The key exists: if it names us (a write of ours that landed after we gave up on it), take it
        back with compare-and-set, since nobody else can lead while it names us; else (None, b"")."""
        if (own := await self._own_entry(kv)) is None:
            return None, b""
        revision, value = own
        try:
            return await kv.update(self.key, value, last=revision), value
        except KeyWrongLastSequenceError:
            return None, b""

    async def _renew(self, kv: KeyValue) -> None:
        """Renew until the lease is lost (CAS failure, or no renewal for ttl_s - margin_s) or released."""
        wait = self.renew_every_s
        while True:
            await self._sleep(min(wait, max(0.0, self._deadline - time.monotonic())))
            if self._stop.is_set():
                return
            now = time.monotonic()
            if now >= self._deadline:
                log.error(
                    "%s could not renew the leader lease for %.1f s: stepping down",
                    self.holder_id,
                    self.ttl_s - self.margin_s,
                )
                self._lose()
                return
            try:
                async with asyncio.timeout(min(self._deadline - now, max(self.renew_every_s, 0.5))):
                    async with self._lock:
                        if self._stop.is_set() or self._revision is None:
                            return
                        revision = await kv.update(self.key, self._value, last=self._revision)
            except KeyWrongLastSequenceError:
                log.error("%s lost the leader lease (expired or taken over): stepping down", self.holder_id)
                self._lose()
                return
            except _NATS_TROUBLE as exc:
                raise_if_cancelling()
                log.warning("renewing the leader lease failed, retrying: %s", error_text(exc))
                wait = min(self.retry_every_s, self.renew_every_s)
                continue
            self._revision = revision
            self._deadline = now + self.ttl_s - self.margin_s
            wait = self.renew_every_s

    def _lose(self) -> None:
        self._leader = False
        self._revision = None

    async def _sleep(self, seconds: float) -> None:
        """Sleep, waking early when released. Every retry and renewal loop sleeps here, so a cancel
        that nats-py's wait_for dropped as a reply came (raise_if_cancelling) ends the loop here."""
        raise_if_cancelling()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()
