"""Resumable multipart uploads: a restarted process continues an interrupted upload.

A journal, journal_dir/<sha256 of "bucket/key">.json, names the upload in flight; the server's
ListParts says which parts it holds. A held part is reused only if its ETag is the MD5 of the local
bytes (S3 part ETags are the hex MD5 of an unencrypted part; SeaweedFS and MinIO do this), and
CompleteMultipartUpload names each part by that ETag, so the object is assembled from exactly the
local bytes. Parts go up with Content-MD5 (the server rejects a damaged body); the sha256 of the bytes
read must match before completing; the completed object's size and sha256 metadata are checked after.

_Multipart is the only user of minio's private multipart primitives (tests pin their signatures).
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NamedTuple

import msgspec
from minio.datatypes import Part
from minio.error import S3Error
from minio.helpers import DictType

from fleet_store.client import MAX_PARTS, SHA256_METADATA, ObjectInfo, ObjectStore
from fleet_store.errors import IntegrityError
from fleet_store.hashing import Progress, sha256_file

MiB = 1024 * 1024
DEFAULT_PART_SIZE = 16 * MiB
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
PARALLEL_PARTS = 2
"""Parts uploading at once, and so the most parts held in memory."""


class UploadJournal(msgspec.Struct, frozen=True, kw_only=True):
    bucket: str
    key: str
    upload_id: str
    size: int
    sha256: str
    part_size: int
    mtime: float


class UploadResult(msgspec.Struct, frozen=True, kw_only=True):
    info: ObjectInfo
    uploaded_bytes: int
    skipped_bytes: int
    """Bytes of parts that the server already held from an interrupted run."""
    resumed: bool


class PartRange(NamedTuple):
    number: int
    offset: int
    length: int


# --- pure --------------------------------------------------------------------------------------


def effective_part_size(size: int, part_size: int) -> int:
    """part_size, or more (whole MiB) when the file would need more than S3's 10,000 parts."""
    needed = -(-size // MAX_PARTS)
    return max(part_size, -(-needed // MiB) * MiB)


def part_ranges(size: int, part_size: int) -> list[PartRange]:
    return [
        PartRange(index + 1, offset, min(part_size, size - offset))
        for index, offset in enumerate(range(0, size, part_size))
    ]


def journal_path(journal_dir: Path, bucket: str, key: str) -> Path:
    return Path(journal_dir) / f"{hashlib.sha256(f'{bucket}/{key}'.encode()).hexdigest()}.json"


def encode_journal(journal: UploadJournal) -> bytes:
    return msgspec.json.encode(journal)


def decode_journal(data: bytes) -> UploadJournal | None:
    """The journal, or None when data is not one (a torn or foreign file is ignored, not fatal)."""
    try:
        return msgspec.json.decode(data, type=UploadJournal)
    except msgspec.DecodeError:
        return None


def journal_matches(journal: UploadJournal, wanted: UploadJournal) -> bool:
    """Whether journal is an upload of the same file (upload id and mtime aside) to the same key."""
    same = ("bucket", "key", "size", "sha256", "part_size")
    return all(getattr(journal, name) == getattr(wanted, name) for name in same)


def stored_mismatch(stored: ObjectInfo | None, size: int, sha256: str) -> str:
    """Why the stored object is not the file we uploaded ("" when it is)."""
    if stored is None:
        return "after completing: object missing"
    if (stored.size, stored.sha256) != (size, sha256):
        return f"after completing: stored size {stored.size} and sha256 metadata differ from the file's"
    return ""


# --- journal files -----------------------------------------------------------------------------


def read_journal(path: Path) -> UploadJournal | None:
    try:
        return decode_journal(path.read_bytes())
    except FileNotFoundError:
        return None


def write_journal(path: Path, journal: UploadJournal) -> None:
    """Atomically: a crash leaves the old journal or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(encode_journal(journal))
    os.replace(tmp, path)


def _md5(data: bytes) -> bytes:
    return hashlib.md5(data, usedforsecurity=False).digest()


# --- minio's private multipart primitives ------------------------------------------------------


class _Multipart:
    """The only user of minio's private multipart methods; errors come out as StoreError."""

    def __init__(self, store: ObjectStore, bucket: str, key: str = "") -> None:
        self._store, self._client, self.bucket, self.key = store, store._client, bucket, key

    def create(self, sha256: str) -> str:
        headers: DictType = {SHA256_METADATA: sha256, "Content-Type": "application/octet-stream"}
        with self._store._translated(self.bucket, self.key):
            return self._client._create_multipart_upload(self.bucket, self.key, headers)

    def upload_part(self, upload_id: str, number: int, data: bytes, md5: bytes | None = None) -> str:
        """Send one part with Content-MD5 (md5: the digest, computed here when not given)."""
        headers: DictType = {"Content-MD5": base64.b64encode(md5 or _md5(data)).decode()}
        with self._store._translated(self.bucket, self.key):
            return self._client._upload_part(self.bucket, self.key, data, headers, upload_id, number)

    def complete(self, upload_id: str, etags: dict[int, str]) -> None:
        parts = [Part(number, etags[number]) for number in sorted(etags)]
        with self._store._translated(self.bucket, self.key):
            self._client._complete_multipart_upload(self.bucket, self.key, upload_id, parts)

    def list_parts(self, upload_id: str) -> dict[int, set[tuple[str, int]]] | None:
        """{part number: {(etag, size)}} (SeaweedFS lists every version of a re-sent part); None
        when the upload no longer exists."""
        held: dict[int, set[tuple[str, int]]] = {}
        marker: str | None = None
        with self._store._translated(self.bucket, self.key):
            try:
                while True:
                    page = self._client._list_parts(
                        self.bucket, self.key, upload_id, part_number_marker=marker
                    )
                    for part in page.parts:
                        held.setdefault(part.part_number, set()).add((part.etag, part.size or -1))
                    if not page.is_truncated or not page.next_part_number_marker:
                        return held
                    marker = page.next_part_number_marker
            except S3Error as exc:
                if exc.code == "NoSuchUpload":
                    return None
                raise

    def abort(self, key: str, upload_id: str) -> None:
        """Abort an upload; one that is already gone is not an error."""
        with self._store._translated(self.bucket, key):
            try:
                self._client._abort_multipart_upload(self.bucket, key, upload_id)
            except S3Error as exc:
                if exc.code != "NoSuchUpload":
                    raise

    def list_uploads(self, prefix: str) -> Iterator[tuple[str, str, datetime | None]]:
        """(key, upload_id, initiated) of every upload in flight under prefix."""
        key_marker = upload_marker = None
        with self._store._translated(self.bucket):
            while True:
                page = self._client._list_multipart_uploads(
                    self.bucket, prefix=prefix, key_marker=key_marker, upload_id_marker=upload_marker
                )
                for upload in page.uploads:
                    yield upload.object_name, upload.upload_id or "", upload.initiated_time
                if not page.is_truncated or not page.uploads:
                    return
                # minio 7.2 never fills next_upload_id_marker: continue after the last one listed.
                key_marker, upload_marker = page.uploads[-1].object_name, page.uploads[-1].upload_id


# --- uploads -----------------------------------------------------------------------------------


def _send_parts(
    mp: _Multipart,
    upload_id: str,
    path: Path,
    ranges: list[PartRange],
    held: dict[int, set[tuple[str, int]]],
    progress: Progress | None,
    parallel: int,
) -> tuple[dict[int, str], int, str]:
    """Read the parts in order (hashing the file as read) and send those the server lacks; returns
    (etag per part, skipped bytes, sha256 of the bytes read). At most `parallel` parts in memory."""
    total = ranges[-1].offset + ranges[-1].length
    digest, etags, done, skipped = hashlib.sha256(), {}, 0, 0
    pending: dict[Future[str], PartRange] = {}

    def collect(finished: set[Future[str]]) -> None:
        nonlocal done
        for future in finished:
            part = pending.pop(future)
            etags[part.number], done = future.result(), done + part.length
        if progress is not None and finished:
            progress(done, total)

    with open(path, "rb") as file, ThreadPoolExecutor(parallel, thread_name_prefix="fleet-upload") as pool:
        for part in ranges:
            if len(pending) >= parallel:
                collect(wait(pending, return_when=FIRST_COMPLETED).done)
            data = os.pread(file.fileno(), part.length, part.offset)
            digest.update(data)
            if len(data) != part.length:
                break  # the file shrank: its sha256 now differs, so the caller aborts
            listed = held.get(part.number, set())
            # MD5 here only to compare with a held part of the right size; else in the sending thread.
            md5 = _md5(data) if any(size == part.length for _, size in listed) else None
            if md5 is not None and (md5.hex(), part.length) in listed:
                etags[part.number], done, skipped = md5.hex(), done + part.length, skipped + part.length
                if progress is not None:
                    progress(done, total)
            else:
                pending[pool.submit(mp.upload_part, upload_id, part.number, data, md5)] = part
            del data
        collect(wait(pending).done)
    return etags, skipped, digest.hexdigest()


def put_file_resumable(
    store: ObjectStore,
    bucket: str,
    key: str,
    path: str | Path,
    journal_dir: str | Path,
    sha256: str | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    progress: Progress | None = None,
    parallel: int = PARALLEL_PARTS,
) -> UploadResult:
    """Upload a file as a multipart upload that a later call (in any process sharing journal_dir)
    continues after a crash, re-sending only the parts the server does not hold.

    Files smaller than one part go through ObjectStore.put_file. Raises IntegrityError (and leaves
    no object and no upload) when the file does not hash to sha256 or the stored object disagrees.
    """
    path, journal_dir = Path(path), Path(journal_dir)
    if part_size < MIN_PART_SIZE:
        raise ValueError(f"part_size {part_size} is below S3's minimum of {MIN_PART_SIZE}")
    stat = path.stat()
    size, jpath, mp = stat.st_size, journal_path(journal_dir, bucket, key), _Multipart(store, bucket, key)
    old = read_journal(jpath)
    if size < part_size:
        if old is not None:
            mp.abort(old.key, old.upload_id)
            jpath.unlink(missing_ok=True)
        info = store.put_file(bucket, key, path, progress=progress, sha256=sha256)
        return UploadResult(info=info, uploaded_bytes=size, skipped_bytes=0, resumed=False)

    part_size = effective_part_size(size, part_size)
    expected = sha256 or sha256_file(path)
    wanted = UploadJournal(bucket=bucket, key=key, upload_id="", size=size, sha256=expected,
                           part_size=part_size, mtime=stat.st_mtime)  # fmt: skip
    held = None
    if old is not None and journal_matches(old, wanted):
        held = mp.list_parts(old.upload_id)
        stored = store.stat(bucket, key) if held is None else None
        if stored is not None and not stored_mismatch(stored, size, expected):
            # Completed and verified before a crash kept us from deleting the journal.
            jpath.unlink(missing_ok=True)
            return UploadResult(info=stored, uploaded_bytes=0, skipped_bytes=size, resumed=True)
    resumed = held is not None
    if old is not None and held is not None:
        upload_id = old.upload_id
    else:
        if old is not None:
            mp.abort(old.key, old.upload_id)  # a different file, or an upload the server dropped
        upload_id, held = mp.create(expected), {}
        write_journal(jpath, msgspec.structs.replace(wanted, upload_id=upload_id))

    try:
        etags, skipped, actual = _send_parts(
            mp, upload_id, path, part_ranges(size, part_size), held, progress, parallel
        )
        if actual != expected:
            raise IntegrityError(bucket, key, expected, actual, "while uploading (source changed?)")
    except IntegrityError:
        mp.abort(key, upload_id)
        jpath.unlink(missing_ok=True)
        raise
    mp.complete(upload_id, etags)
    stored = store.stat(bucket, key)
    problem = stored_mismatch(stored, size, expected)
    jpath.unlink(missing_ok=True)
    if problem:
        store.delete(bucket, key)
        raise IntegrityError(bucket, key, expected, stored.sha256 if stored else "", problem)
    assert stored is not None
    return UploadResult(info=stored, uploaded_bytes=size - skipped, skipped_bytes=skipped, resumed=resumed)


def abandon_stale_uploads(
    store: ObjectStore, bucket: str, prefix: str, journal_dir: str | Path, older_than_s: float = 86_400.0
) -> list[str]:
    """Abort uploads in flight under prefix, started over older_than_s ago, that no journal in
    journal_dir refers to (housekeeping for a downloader starting up); returns their keys."""
    journals = (read_journal(path) for path in Path(journal_dir).glob("*.json"))
    kept = {journal.upload_id for journal in journals if journal is not None}
    cutoff = datetime.now(UTC) - timedelta(seconds=older_than_s)
    mp = _Multipart(store, bucket)
    stale = [
        (key, upload_id)
        for key, upload_id, initiated in mp.list_uploads(prefix)
        if upload_id and upload_id not in kept and initiated is not None and initiated <= cutoff
    ]
    for key, upload_id in stale:
        mp.abort(key, upload_id)
    return [key for key, _ in stale]
