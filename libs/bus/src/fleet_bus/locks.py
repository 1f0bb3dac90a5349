"""A cluster-wide lock in the JetStream KV bucket `fleet-locks`: one holder per key at a time.

Acquire = create the key (atomic: fails if it exists); the holder renews it by compare-and-set while
it works, so a crashed holder's lock expires after the bucket's TTL; release = compare-and-set delete.
Used so that downloader replicas never stage the same model twice at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats.errors
from nats.js.errors import KeyWrongLastSequenceError

from fleet_bus.cancel import raise_if_cancelling
from fleet_bus.connection import Bus
from fleet_bus.streams import LOCK_TTL_S
from fleet_proto.subjects import LOCKS_BUCKET

log = logging.getLogger("fleet_bus.locks")
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_=.-]")


def lock_key(name: str) -> str:
    """A KV key for any name (model ids have '/'): unsafe characters become '_' plus a short hash."""
    safe = _KEY_UNSAFE.sub("_", name)
    # the same key in every process (hash() is salted per process)
    return safe if safe == name else f"{safe}.{hashlib.sha256(name.encode()).hexdigest()[:12]}"


@asynccontextmanager
async def kv_lock(bus: Bus, name: str, holder: str, retry_every_s: float = 0.5) -> AsyncIterator[None]:
    """Hold the lock `name` for the duration of the `async with`; waits while someone else holds it."""
    kv = await bus.js.key_value(LOCKS_BUCKET)
    key = lock_key(name)
    waited = False
    while True:
        try:
            revision = await kv.create(key, holder.encode())
            break
        except KeyWrongLastSequenceError:  # someone holds it
            raise_if_cancelling()
            if not waited:
                log.info("waiting for the lock %s (held by another)", name)
                waited = True
            await asyncio.sleep(retry_every_s)

    async def renew() -> None:
        nonlocal revision
        while True:
            await asyncio.sleep(LOCK_TTL_S / 3)
            with contextlib.suppress(TimeoutError, nats.errors.Error):
                revision = await kv.update(key, holder.encode(), last=revision)

    renewing = asyncio.create_task(renew(), name=f"lock-{key}")
    try:
        yield
    finally:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)
        with contextlib.suppress(KeyWrongLastSequenceError, TimeoutError, nats.errors.Error):
            await kv.delete(key, last=revision)
