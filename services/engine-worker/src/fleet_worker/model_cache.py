"""The worker's local model files: <root>/<model_id>/<revision>/, fetched from object storage on demand
and evicted least-recently-used when a size limit needs the room.

Markers in a model folder (hidden, so manifests and fetches never see them):
- `.fleet-complete`: every file of the manifest is present and was verified (what `complete_models()`
  scans for and the node advertises). A fetch of a shard's files only never writes it.
- `.fleet-partial`: some files (a shard's) are present, or the last fetch failed.
- `.fleet-last-used`: its mtime is the model's last use, so the LRU order survives a restart.
- `.fleet-manifest.json`: the manifest the files were last fetched and verified against, so an
  instance (an engine restart, a failover) can start from the cache while object storage is down.

One asyncio task fetches a model at a time (per model id + revision): concurrent `ensure` calls that
it covers wait for it instead of downloading again. A model `pin`ned by a running instance, or being
fetched, is never evicted.

Whole at ~540 lines: fetching, verifying, pinning and evicting share the markers and the one lock
on the folder; split apart, each part would have to know the others' markers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from pathlib import Path

import msgspec

from fleet_store import MODELS_BUCKET, ModelManifest, ObjectStore, Progress, fetch_model
from fleet_store.manifest import checked_relative_path, model_file_paths, model_prefix

log = logging.getLogger("fleet_worker.model_cache")

COMPLETE_MARKER = ".fleet-complete"
PARTIAL_MARKER = ".fleet-partial"
LAST_USED_MARKER = ".fleet-last-used"
MANIFEST_COPY = ".fleet-manifest.json"
MARKERS = frozenset({COMPLETE_MARKER, PARTIAL_MARKER, LAST_USED_MARKER})
LIMIT_SETTING = "FLEET_MODEL_CACHE_BYTES"

ModelKey = tuple[str, str]
"""(model_id, revision)"""


class ModelCacheError(Exception):
    """The cache cannot hold or give up a model."""


class ModelTooLarge(ModelCacheError):
    """The model's files alone are more than the cache's limit."""


class ModelCacheFull(ModelCacheError):
    """Not enough room even after evicting every model that is not in use."""


class ModelInUse(ModelCacheError):
    """The model is pinned by a running instance or being fetched."""


class FetchAbandoned(ModelCacheError):
    """Every caller waiting for a fetch went away (cancelled), so the fetch stopped."""


class CachedModel(msgspec.Struct, frozen=True, kw_only=True):
    model_id: str
    revision: str
    folder: str
    size_bytes: int
    last_used: float
    """Unix time of the last use (0 when unknown)."""
    complete: bool
    pinned: int
    """How many running instances use it."""


class _Entry(msgspec.Struct, frozen=True):
    folder: Path
    size: int
    last_used: float
    complete: bool


class _Job:
    """One fetch of one model, awaited by every `ensure` it covers."""

    def __init__(self, manifest: ModelManifest, paths: frozenset[str] | None) -> None:
        self.manifest = manifest
        self.paths = paths  # None: every file
        self.task: asyncio.Task[Path] | None = None
        self.waiters = 0
        self.progress: list[Progress] = []
        self.abandoned = threading.Event()  # read by the fetching thread

    def covers(self, manifest: ModelManifest, paths: frozenset[str] | None) -> bool:
        if self.abandoned.is_set() or self.manifest != manifest:
            return False
        return self.paths is None or (paths is not None and paths <= self.paths)

    def report(self, done: int, total: int) -> None:
        """Progress of the fetch (in its thread): fanned out to every waiter; stops an abandoned one."""
        if self.abandoned.is_set():
            raise FetchAbandoned(f"nobody waits for {self.manifest.model_id} any more")
        for callback in tuple(self.progress):
            try:
                callback(done, total)
            except Exception:  # one caller's broken callback must not fail everyone's fetch
                log.exception("progress callback failed")


def _write_manifest_copy(folder: Path, manifest: ModelManifest) -> None:
    tmp = folder / (MANIFEST_COPY + ".tmp")
    tmp.write_bytes(msgspec.json.encode(manifest))
    tmp.replace(folder / MANIFEST_COPY)


def _tree_size(folder: Path) -> int:
    """Bytes of the model's files (the manifest copy is bookkeeping, not counted against the limit)."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            if name == MANIFEST_COPY:
                continue
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _last_used(folder: Path) -> float:
    for marker in (LAST_USED_MARKER, COMPLETE_MARKER, PARTIAL_MARKER):
        mtime = _mtime(folder / marker)
        if mtime is not None:
            return mtime
    return 0.0


class ModelCache:
    """Model folders under root, at most limit_bytes of them in all (0: no limit)."""

    def __init__(
        self,
        root: Path,
        limit_bytes: int = 0,
        *,
        bucket: str = MODELS_BUCKET,
        on_change: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """on_change is awaited whenever the set of complete models changes (a model became complete,
        was evicted or removed), e.g. to announce the node's cached models again."""
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.root = Path(root)
        self.limit_bytes = limit_bytes
        self._bucket = bucket
        self._on_change = on_change
        self._pins: dict[ModelKey, int] = {}
        self._jobs: dict[ModelKey, _Job] = {}
        self._reserved: dict[ModelKey, int] = {}  # bytes a fetch in flight will take when done
        self._lock = asyncio.Lock()  # one room-making / removal at a time
        self._last_stamp = 0.0

    # -- folders and markers -----------------------------------------------------------------------
    def folder(self, model_id: str, revision: str) -> Path:
        model_prefix(model_id, revision)  # rejects ids and revisions that could escape root
        return self.root / model_id / revision

    def touch(self, model_id: str, revision: str) -> None:
        """Record a use now (no-op when the model is not here)."""
        folder = self.folder(model_id, revision)
        if folder.is_dir():
            self._stamp(folder)

    def _stamp(self, folder: Path) -> None:
        # Strictly increasing within this process, so uses in quick succession keep their order.
        now = max(time.time(), self._last_stamp + 0.001)
        self._last_stamp = now
        marker = folder / LAST_USED_MARKER
        marker.touch()
        os.utime(marker, (now, now))

    def _scan(self) -> dict[ModelKey, _Entry]:
        """Every model folder under root: a folder with one of the markers, two or more levels down."""
        found: dict[ModelKey, _Entry] = {}
        if not self.root.is_dir():
            return found
        for dirpath, dirs, files in os.walk(self.root):
            dirs[:] = [name for name in dirs if not name.startswith(".")]
            names = set(files)
            if not names & MARKERS:
                continue
            dirs[:] = []  # a model folder's subfolders are its files
            folder = Path(dirpath)
            relative = folder.relative_to(self.root).as_posix()
            if "/" not in relative:
                continue
            model_id, revision = relative.rsplit("/", 1)
            found[(model_id, revision)] = _Entry(
                folder, _tree_size(folder), _last_used(folder), COMPLETE_MARKER in names
            )
        return found

    def usage_bytes(self) -> int:
        """Bytes of every model folder under root (blocking: walks the folders)."""
        return sum(entry.size for entry in self._scan().values())

    def complete_models(self) -> tuple[str, ...]:
        """Ids of the models held completely here, for NodeJoined (blocking: walks the folders)."""
        return tuple(sorted({model_id for (model_id, _), entry in self._scan().items() if entry.complete}))

    def models(self) -> list[CachedModel]:
        """The models here, least recently used first (blocking: walks the folders)."""
        entries = sorted(self._scan().items(), key=lambda item: (item[1].last_used, item[0]))
        return [
            CachedModel(
                model_id=model_id,
                revision=revision,
                folder=str(entry.folder),
                size_bytes=entry.size,
                last_used=entry.last_used,
                complete=entry.complete,
                pinned=self._pins.get((model_id, revision), 0),
            )
            for (model_id, revision), entry in entries
        ]

    # -- pins ----------------------------------------------------------------------------------------
    def cached_manifest(self, model_id: str, revision: str) -> ModelManifest | None:
        """The manifest this node's copy of the model was last verified against, if it has one."""
        path = self.folder(model_id, revision) / MANIFEST_COPY
        try:
            return msgspec.json.decode(path.read_bytes(), type=ModelManifest)
        except (OSError, msgspec.DecodeError):
            return None

    def pin(self, model_id: str, revision: str) -> None:
        """A running instance uses the model: never evict it until as many unpin() calls."""
        key = (model_id, revision)
        self.folder(*key)
        self._pins[key] = self._pins.get(key, 0) + 1
        self.touch(*key)

    def unpin(self, model_id: str, revision: str) -> None:
        key = (model_id, revision)
        count = self._pins.get(key, 0) - 1
        if count > 0:
            self._pins[key] = count
        else:
            self._pins.pop(key, None)
        self.touch(*key)  # its last use ends now

    def pinned(self, model_id: str, revision: str) -> int:
        return self._pins.get((model_id, revision), 0)

    def _in_use(self, key: ModelKey) -> bool:
        job = self._jobs.get(key)
        return self._pins.get(key, 0) > 0 or (job is not None and job.waiters > 0)

    # -- ensure --------------------------------------------------------------------------------------
    async def ensure(
        self,
        manifest: ModelManifest,
        store: ObjectStore,
        paths: Collection[str] | None = None,
        progress: Progress | None = None,
    ) -> Path:
        """The model's folder, once every file (or those `paths`, e.g. files_for_layers(...) of a
        shard) is present and matches the manifest's size and sha256.

        Makes room first by evicting least-recently-used models that are not in use; ModelTooLarge
        when the files alone exceed the limit, ModelCacheFull when models in use leave too little.
        progress(done, total) is called from a worker thread. Cancelling one caller does not stop a
        fetch another caller waits for; when no caller is left, the fetch stops at its next chunk.
        """
        key = (manifest.model_id, manifest.revision)
        self.folder(*key)
        wanted = self._wanted(manifest, paths)
        while True:
            job = self._jobs.get(key)
            if job is None or (job.task is not None and job.task.done()):
                job = self._start(key, manifest, store, wanted)
                break
            if job.covers(manifest, wanted):
                break
            # Another fetch of this model (other files, or a newer manifest): after it, ours.
            with contextlib.suppress(Exception):
                await self._wait(job, None)
        return await self._wait(job, progress)

    @staticmethod
    def _wanted(manifest: ModelManifest, paths: Collection[str] | None) -> frozenset[str] | None:
        if paths is None:
            return None
        wanted = frozenset(paths)
        listed = {file.path for file in manifest.files}
        unknown = wanted - listed
        if unknown:
            raise ValueError(f"{manifest.model_id}/{manifest.revision} has no files {sorted(unknown)}")
        return None if wanted == listed else wanted

    def _start(
        self, key: ModelKey, manifest: ModelManifest, store: ObjectStore, wanted: frozenset[str] | None
    ) -> _Job:
        job = _Job(manifest, wanted)
        self._jobs[key] = job
        job.task = asyncio.create_task(self._run(key, job, store), name=f"fetch-{key[0]}@{key[1]}")
        # A failure nobody waited for (every caller cancelled) is not "never retrieved".
        job.task.add_done_callback(lambda task: task.cancelled() or task.exception())
        return job

    async def _wait(self, job: _Job, progress: Progress | None) -> Path:
        assert job.task is not None
        job.waiters += 1
        if progress is not None:
            job.progress.append(progress)
        try:
            return await asyncio.shield(job.task)
        finally:
            job.waiters -= 1
            if progress is not None:
                job.progress.remove(progress)
            if job.waiters == 0 and not job.task.done():
                job.abandoned.set()

    async def _run(self, key: ModelKey, job: _Job, store: ObjectStore) -> Path:
        manifest = job.manifest
        folder = self.folder(*key)
        try:
            async with self._lock:
                if job.abandoned.is_set():  # every caller left while waiting for the lock
                    raise FetchAbandoned(f"nobody waits for {key[0]}@{key[1]} any more")
                protected = {k for k in self._jobs if k != key} | {k for k, n in self._pins.items() if n}
                footprint, evicted = await asyncio.to_thread(
                    self._make_room, key, manifest, job.paths, protected, dict(self._reserved)
                )
                self._reserved[key] = footprint
            if evicted:
                await self._changed()
            try:
                await asyncio.to_thread(
                    fetch_model, store, self._bucket, manifest, folder, job.report, only=job.paths
                )
            except FetchAbandoned:
                raise  # files are old or new-and-verified, never half-written: the markers still hold
            except BaseException:
                if await asyncio.to_thread(self._mark_incomplete, folder):
                    await self._changed()
                raise
            became_complete = await asyncio.to_thread(self._mark_done, folder, job.paths is None)
            await asyncio.to_thread(_write_manifest_copy, folder, manifest)
            self._stamp(folder)  # used now (the fetch may have taken a while)
            if became_complete:
                await self._changed()
            return folder
        finally:
            self._reserved.pop(key, None)
            if self._jobs.get(key) is job:
                del self._jobs[key]

    def _make_room(
        self,
        key: ModelKey,
        manifest: ModelManifest,
        wanted: frozenset[str] | None,
        protected: set[ModelKey],
        reserved: dict[ModelKey, int],
    ) -> tuple[int, bool]:
        """(In a thread.) Evict what the limit needs, then tidy the model's folder; returns the bytes
        the folder will take and whether a complete model was evicted."""
        folder = self.folder(*key)
        needed = sum(file.size for file in manifest.files if wanted is None or file.path in wanted)
        if self.limit_bytes and needed > self.limit_bytes:
            what = "its files" if wanted is None else f"the {len(wanted)} files asked for"
            raise ModelTooLarge(
                f"{key[0]}@{key[1]} needs {needed} bytes ({what}), more than the model cache's "
                f"limit of {self.limit_bytes} bytes ({LIMIT_SETTING})"
            )
        listed = {file.path for file in manifest.files}
        present = model_file_paths(folder) if folder.is_dir() else []
        # A full fetch deletes files the manifest does not list (any more), so none is loaded by
        # mistake; a shard's fetch keeps other shards' files, which stay part of the footprint.
        stale = [path for path in present if path not in listed] if wanted is None else []
        kept = [path for path in present if wanted is not None and path not in wanted]
        footprint = needed + sum((folder / path).stat().st_size for path in kept)
        evicted_complete = False
        if self.limit_bytes:
            evicted_complete = self._evict_for(key, footprint, protected, reserved)
        folder.mkdir(parents=True, exist_ok=True)
        self._stamp(folder)
        for path in stale:
            (folder / path).unlink(missing_ok=True)
        for temporary in folder.rglob(".*.part"):  # left by an interrupted download
            temporary.unlink(missing_ok=True)
        return footprint, evicted_complete

    def _evict_for(
        self, key: ModelKey, footprint: int, protected: set[ModelKey], reserved: dict[ModelKey, int]
    ) -> bool:
        """(In a thread.) Evict least-recently-used models not in use until footprint bytes fit;
        nothing when that cannot be done (ModelCacheFull). True when a complete model went."""
        entries = self._scan()
        others = {k: e for k, e in entries.items() if k != key}
        usage = sum(max(e.size, reserved.get(k, 0)) for k, e in others.items())
        usage += sum(size for k, size in reserved.items() if k != key and k not in entries)
        excess = usage + footprint - self.limit_bytes
        if excess <= 0:
            return False
        candidates = sorted(
            ((k, e) for k, e in others.items() if k not in protected),
            key=lambda item: (item[1].last_used, item[0]),
        )
        chosen: list[tuple[ModelKey, _Entry]] = []
        freed = 0
        for candidate in candidates:
            if freed >= excess:
                break
            chosen.append(candidate)
            freed += candidate[1].size
        if freed < excess:
            in_use = sorted(f"{k[0]}@{k[1]}" for k in others if k in protected)
            raise ModelCacheFull(
                f"{key[0]}@{key[1]} needs {footprint} bytes but the model cache ({LIMIT_SETTING}="
                f"{self.limit_bytes}) holds {usage} bytes of other models, and evicting every one "
                f"not in use frees only {freed}; in use: {', '.join(in_use) or 'none'}"
            )
        evicted_complete = False
        for (model_id, revision), entry in chosen:
            log.info("evicting %s@%s (%d bytes, least recently used)", model_id, revision, entry.size)
            evicted_complete |= self._delete(entry.folder)
        return evicted_complete

    @staticmethod
    def _mark_done(folder: Path, full: bool) -> bool:
        """(In a thread.) Markers after a verified fetch; True when the model just became complete."""
        complete = folder / COMPLETE_MARKER
        if not full:
            if not complete.exists():
                (folder / PARTIAL_MARKER).touch()
            return False
        created = not complete.exists()
        complete.touch()
        (folder / PARTIAL_MARKER).unlink(missing_ok=True)
        return created

    @staticmethod
    def _mark_incomplete(folder: Path) -> bool:
        """(In a thread.) After a failed fetch; True when the folder was marked complete until now."""
        if not folder.is_dir():
            return False
        (folder / PARTIAL_MARKER).touch()
        complete = folder / COMPLETE_MARKER
        was_complete = complete.exists()
        complete.unlink(missing_ok=True)
        return was_complete

    # -- removal -------------------------------------------------------------------------------------
    def _delete(self, folder: Path) -> bool:
        """(In a thread.) Remove a model folder and its empty parents; True when it was complete."""
        complete = folder / COMPLETE_MARKER
        was_complete = complete.exists()
        complete.unlink(missing_ok=True)  # first: a half-removed folder is never advertised
        shutil.rmtree(folder, ignore_errors=True)
        parent = folder.parent
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError:  # not empty (other revisions / models), or gone
                break
            parent = parent.parent
        return was_complete

    async def evict(self, model_id: str, revision: str) -> bool:
        """Remove one model's folder; False when it is not here, ModelInUse when pinned or fetching."""
        removed = await self._remove([(model_id, revision)], skip_in_use=False)
        return bool(removed)

    async def remove(self, model_id: str) -> list[str]:
        """Remove every revision of model_id that is not in use (DELETE of a model); returns the
        revisions removed. A fetch nobody waits for any more is let stop first, then removed."""
        checked_relative_path(model_id, "model id")
        entries = await asyncio.to_thread(self._scan)
        keys = {k for k in entries if k[0] == model_id} | {k for k in self._jobs if k[0] == model_id}
        removed = await self._remove(sorted(keys), skip_in_use=True)
        return [revision for _, revision in removed]

    async def _remove(self, keys: Iterable[ModelKey], skip_in_use: bool) -> list[ModelKey]:
        todo = []
        for key in keys:
            self.folder(*key)
            if self._in_use(key):
                if skip_in_use:
                    continue
                raise ModelInUse(f"{key[0]}@{key[1]} is in use (pinned by an instance, or being fetched)")
            todo.append(key)
        for key in todo:  # abandoned fetches still finishing their current chunk
            job = self._jobs.get(key)
            if job is not None and job.task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(job.task)
        removed: list[ModelKey] = []
        changed = False
        async with self._lock:
            for key in todo:
                if self._in_use(key) or key in self._jobs:  # picked up again meanwhile
                    continue
                folder = self.folder(*key)
                if not folder.is_dir():
                    continue
                changed |= await asyncio.to_thread(self._delete, folder)
                removed.append(key)
                log.info("removed %s@%s", *key)
        if changed:
            await self._changed()
        return removed

    async def _changed(self) -> None:
        if self._on_change is None:
            return
        try:
            await self._on_change()
        except Exception:  # announcing is best effort: never fail a fetch or an eviction for it
            log.warning("model cache change callback failed", exc_info=True)

    async def close(self) -> None:
        """Stop every fetch (at its next chunk) and wait for them."""
        jobs = list(self._jobs.values())
        for job in jobs:
            job.abandoned.set()
        for job in jobs:
            if job.task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(job.task)
