"""This worker's side of the shared KV cache (tier 2 and the index).

Engines keep blocks in memory and read/write the local KV folder (`<state>/kv`); this class moves
blocks between that folder and object storage and keeps the Redis index true:

- a block an engine holds in memory is indexed with this node as holder (evicted: removed), which
  is what KV-aware routing reads;
- a block an engine wrote to the folder is uploaded to `fleet-kv/<fingerprint>/<hash>` (sha256 in
  the object's metadata), indexed as in object storage, and removed locally;
- before a task reaches the engine, the leading prompt blocks that neither the engine's memory nor
  the folder holds are fetched from object storage, concurrently, each verified on arrival; the
  first missing or corrupt one ends the run (the engine prefills from there). Fetched files stay
  until the request finishes, then go.

The index is advisory: when Redis fails, blocks are still uploaded and fetched by their
deterministic keys, and routing falls back to load. What a failed write would have said is kept
(bounded), and once Redis answers again (`keep_index`, every second) the node writes everything it
holds again: a Redis restarted empty would otherwise never learn of blocks already in memory here.
A per-node marker key tells a Redis that lost its data (restart, flush) from one that did not.

Object storage is advisory too: once it fails to answer, tier 2 is skipped for STORE_RETRY_S (blocks
are recomputed and stay local) rather than waited on by every request, and its calls run on this
class's own threads, so a hung server never starves the loop's default executor (node metrics, the
worker's heartbeat, go through it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fleet_store import KV_BUCKET, ObjectNotFound, ObjectStore, StoreError, StoreUnavailable
from fleet_store.kv import KVFolder
from fleet_store.kv_index import TIER2, KVIndex, object_key
from fleet_worker.engines.base import KVChanges

log = logging.getLogger("fleet_worker.kv")
FETCH_CONCURRENCY = 4
INDEX_CHECK_S = 1.0  # how often keep_index looks whether the index needs writing again
MAX_LOST_ENTRIES = 100_000  # index writes remembered while Redis is down (beyond: the TTL cleans up)
# After object storage failed to answer, tier 2 is left alone this long (then the next request tries
# again): requests stop waiting on a dead or hung server, and tier 2 is back this soon after it is.
STORE_RETRY_S = 10.0
STORE_THREADS = FETCH_CONCURRENCY + 2  # fetches of one request, and uploads beside them


class WorkerKV:
    def __init__(self, node_id: str, store: ObjectStore, index: KVIndex | None, folder: KVFolder) -> None:
        self._node_id = node_id
        self._store = store
        self._index = index
        self.folder = folder
        self._in_memory: dict[str, set[str]] = {}  # fingerprint -> blocks an engine here holds
        self._fetched: dict[Path, int] = {}  # fetched file -> requests still reading it
        self._uploads: set[asyncio.Task[None]] = set()
        self.bytes_fetched = 0
        self.blocks_fetched = 0
        self.bytes_uploaded = 0
        self.blocks_uploaded = 0
        # Index writes that failed (Redis down): rewritten by resync_index once it answers again.
        self._index_stale = False
        self._index_failures = 0
        self._lost_tier2: dict[str, set[str]] = {}  # uploaded blocks the index does not know of
        self._lost_removals: dict[str, set[str]] = {}  # blocks gone from memory still indexed here
        self._store_down_until = 0.0  # monotonic time before which tier 2 is skipped
        self._store_threads = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="kv-store")

    def memory_blocks(self) -> int:
        return sum(len(held) for held in self._in_memory.values())

    async def _indexed(self, call, fingerprint: str = "", tier2=(), removed=()) -> None:
        """Run one index write; when it fails, remember what it would have said (tier-2 entries and
        removals: blocks in memory are rewritten from `_in_memory` anyway)."""
        if self._index is None:
            return
        try:
            await call
        except Exception as exc:
            if not self._index_stale:
                log.warning("KV index (Redis) writes fail, rewritten once it answers: %s", exc)
            self._index_stale = True
            self._index_failures += 1
            self._remember(self._lost_tier2, fingerprint, tier2)
            self._remember(self._lost_removals, fingerprint, removed)

    def _remember(self, lost: dict[str, set[str]], fingerprint: str, hashes) -> None:
        room = (
            MAX_LOST_ENTRIES
            - sum(len(v) for v in self._lost_tier2.values())
            - sum(len(v) for v in self._lost_removals.values())
        )
        if hashes and room > 0:
            lost.setdefault(fingerprint, set()).update(list(hashes)[:room])

    def _store_usable(self) -> bool:
        return time.monotonic() >= self._store_down_until

    def _store_failed(self, exc: StoreError) -> None:
        """Object storage did not answer: skip tier 2 for a while (logged once per outage)."""
        if self._store_usable():
            log.warning(
                "object storage failed (%s): KV blocks are neither fetched nor uploaded for %.0f s; "
                "engines recompute them and keep new ones locally",
                exc,
                STORE_RETRY_S,
            )
        self._store_down_until = time.monotonic() + STORE_RETRY_S

    async def _on_store_threads(self, call, *args):
        return await asyncio.get_running_loop().run_in_executor(self._store_threads, call, *args)

    def on_engine_changes(self, fingerprint: str, changes: KVChanges) -> None:
        """Called on the loop with an engine's changes: index now, upload in the background."""
        held = self._in_memory.setdefault(fingerprint, set())
        held.update(changes.in_memory)
        held.difference_update(changes.evicted)
        work = self._apply(fingerprint, changes)
        task = asyncio.get_running_loop().create_task(work)
        self._uploads.add(task)
        task.add_done_callback(self._uploads.discard)

    async def _apply(self, fingerprint: str, changes: KVChanges) -> None:
        await self._indexed(self._index_update(fingerprint, changes), fingerprint, removed=changes.evicted)
        uploaded = []
        for block_hash in changes.written:
            path = self.folder.path(fingerprint, block_hash)
            if path in self._fetched or not path.is_file() or not self._store_usable():
                continue  # not ours to upload, gone, or object storage is down: it stays local
            try:
                await self._on_store_threads(
                    self._store.put_file, KV_BUCKET, object_key(fingerprint, block_hash), path
                )
            except StoreError as exc:
                log.warning("KV block %s not uploaded (kept locally): %s", block_hash, exc)
                if isinstance(exc, StoreUnavailable):
                    self._store_failed(exc)
                continue
            uploaded.append(block_hash)
            self.blocks_uploaded += 1
            self.bytes_uploaded += path.stat().st_size
            path.unlink(missing_ok=True)
        if uploaded and self._index is not None:
            await self._indexed(self._index.add(fingerprint, uploaded, TIER2), fingerprint, tier2=uploaded)

    async def _index_update(self, fingerprint: str, changes: KVChanges) -> None:
        assert self._index is not None
        await self._index.add(fingerprint, list(changes.in_memory), self._node_id)
        await self._index.remove(fingerprint, list(changes.evicted), self._node_id)

    def held_run(self, fingerprint: str, hashes: Sequence[str]) -> int:
        """How many of the leading blocks an engine here holds in memory or the local folder."""
        held = self._in_memory.get(fingerprint, set())
        count = 0
        for block_hash in hashes:
            if block_hash not in held and not self.folder.contains(fingerprint, block_hash):
                break
            count += 1
        return count

    async def prefetch(self, fingerprint: str, hashes: Sequence[str]) -> list[Path]:
        """Fetch the run of leading blocks this node lacks; returns the files to release afterwards."""
        held = self._in_memory.get(fingerprint, set())
        missing: list[str] = []
        for block_hash in hashes:
            if block_hash in held or self.folder.contains(fingerprint, block_hash):
                if missing:
                    break  # a block after a gap: fetch the gap first, the rest next time
                continue
            missing.append(block_hash)
        fetched: list[Path] = []
        limit = asyncio.Semaphore(FETCH_CONCURRENCY)

        async def fetch(block_hash: str) -> Path | None:
            path = self.folder.path(fingerprint, block_hash)
            async with limit:
                if not self._store_usable():  # failed moments ago: recompute rather than wait on it
                    return None
                try:
                    await self._on_store_threads(
                        self._store.get_file, KV_BUCKET, object_key(fingerprint, block_hash), path
                    )
                except ObjectNotFound:
                    return None
                except StoreError as exc:  # IntegrityError included: nothing is left behind
                    log.warning("KV block %s not fetched, the engine recomputes it: %s", block_hash, exc)
                    if isinstance(exc, StoreUnavailable):
                        self._store_failed(exc)
                    return None
            return path

        results = await asyncio.gather(*(fetch(h) for h in missing))
        for path in results:
            if path is None:
                break  # the engine's prefix stops at the first block it cannot read
            fetched.append(path)
        for path in results[len(fetched) :]:  # blocks after a miss are no use to this request
            if path is not None:
                path.unlink(missing_ok=True)
        for path in fetched:
            self._fetched[path] = self._fetched.get(path, 0) + 1
            self.blocks_fetched += 1
            self.bytes_fetched += path.stat().st_size
        return fetched

    def release(self, paths: Sequence[Path]) -> None:
        """A request that needed fetched files is done with them (the engine has read them)."""
        for path in paths:
            left = self._fetched.get(path, 0) - 1
            if left > 0:
                self._fetched[path] = left
                continue
            self._fetched.pop(path, None)
            path.unlink(missing_ok=True)

    async def forget(self, fingerprint: str) -> None:
        """An engine holding this model's blocks is gone: this node no longer holds them."""
        held = self._in_memory.pop(fingerprint, set())
        if held and self._index is not None:
            await self._indexed(
                self._index.remove(fingerprint, sorted(held), self._node_id), fingerprint, removed=held
            )

    async def resync_index(self) -> bool:
        """Write the index again when it needs it (writes failed, or Redis lost this node's marker):
        every block in memory here, the uploads and removals that failed. True when it is in sync."""
        if self._index is None:
            return True
        failures = self._index_failures
        try:
            if not self._index_stale and await self._index.node_marked(self._node_id):
                return True
            held = {fp: sorted(hashes) for fp, hashes in self._in_memory.items()}
            for fingerprint, ordered in held.items():
                await self._index.add(fingerprint, ordered, self._node_id)
            for fingerprint, hashes in list(self._lost_tier2.items()):
                await self._index.add(fingerprint, sorted(hashes), TIER2)
            for fingerprint, hashes in list(self._lost_removals.items()):
                gone = hashes - self._in_memory.get(fingerprint, set())
                await self._index.remove(fingerprint, sorted(gone), self._node_id)
            await self._index.mark_node(self._node_id)
        except Exception as exc:
            if not self._index_stale:
                log.warning("KV index (Redis) unavailable: %s", exc)
            self._index_stale = True
            return False
        if self._index_failures == failures:  # no write failed meanwhile: nothing is left to redo
            was_stale = self._index_stale
            self._index_stale = False
            self._lost_tier2.clear()
            self._lost_removals.clear()
            blocks = sum(len(hashes) for hashes in held.values())
            if was_stale:
                log.info("KV index (Redis) answers again: rewrote the %d blocks held here", blocks)
        return not self._index_stale

    async def keep_index(self, interval_s: float = INDEX_CHECK_S) -> None:
        """For the worker's lifetime: brings the index back in sync once Redis answers again."""
        while True:
            await asyncio.sleep(interval_s)
            await self.resync_index()

    async def close(self) -> None:
        for task in list(self._uploads):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)
        self._store_threads.shutdown(wait=False, cancel_futures=True)  # a hung call must not block exit
        if self._index is not None:
            with contextlib.suppress(Exception):
                for fingerprint, held in self._in_memory.items():
                    await self._index.remove(fingerprint, sorted(held), self._node_id)
                await self._index.close()
