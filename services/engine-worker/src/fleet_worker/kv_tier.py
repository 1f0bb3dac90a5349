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
deterministic keys, and routing falls back to load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path

from fleet_store import KV_BUCKET, ObjectNotFound, ObjectStore, StoreError
from fleet_store.kv import KVFolder
from fleet_store.kv_index import TIER2, KVIndex, object_key
from fleet_worker.engines.base import KVChanges

log = logging.getLogger("fleet_worker.kv")
FETCH_CONCURRENCY = 4


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

    def memory_blocks(self) -> int:
        return sum(len(held) for held in self._in_memory.values())

    async def _indexed(self, call) -> None:
        if self._index is None:
            return
        try:
            await call
        except Exception as exc:
            log.warning("KV index update failed: %s", exc)

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
        await self._indexed(self._index_update(fingerprint, changes))
        uploaded = []
        for block_hash in changes.written:
            path = self.folder.path(fingerprint, block_hash)
            if path in self._fetched or not path.is_file():
                continue
            try:
                await asyncio.to_thread(
                    self._store.put_file, KV_BUCKET, object_key(fingerprint, block_hash), path
                )
            except StoreError as exc:
                log.warning("KV block %s not uploaded (kept locally): %s", block_hash, exc)
                continue
            uploaded.append(block_hash)
            self.blocks_uploaded += 1
            self.bytes_uploaded += path.stat().st_size
            path.unlink(missing_ok=True)
        if uploaded and self._index is not None:
            await self._indexed(self._index.add(fingerprint, uploaded, TIER2))

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
                try:
                    await asyncio.to_thread(
                        self._store.get_file, KV_BUCKET, object_key(fingerprint, block_hash), path
                    )
                except ObjectNotFound:
                    return None
                except StoreError as exc:  # IntegrityError included: nothing is left behind
                    log.warning("KV block %s not fetched, the engine recomputes it: %s", block_hash, exc)
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
            await self._indexed(self._index.remove(fingerprint, sorted(held), self._node_id))

    async def close(self) -> None:
        for task in list(self._uploads):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)
        if self._index is not None:
            with contextlib.suppress(Exception):
                for fingerprint, held in self._in_memory.items():
                    await self._index.remove(fingerprint, sorted(held), self._node_id)
                await self._index.close()
