"""ObjectStore: the minio SDK behind a small, verified API (sha256 in object metadata).

Every method is blocking; async callers run them with asyncio.to_thread. One ObjectStore may be
shared by many threads (minio's client and urllib3's pool are thread-safe).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

import msgspec
import urllib3
from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import InvalidResponseError, S3Error, ServerError
from urllib3.util import Retry, Timeout

from fleet_store.errors import (
    IntegrityError,
    ObjectNotFound,
    StoreError,
    StoreUnavailable,
    error_for_s3_code,
)
from fleet_store.hashing import CHUNK_SIZE, HashingReader, Progress, sha256_file

SHA256_METADATA = "x-amz-meta-sha256"
PART_SIZE = 16 * 1024 * 1024
MAX_PARTS = 10_000
CONNECT_TIMEOUT_S = 5.0
# Generous: the server may take a while to answer CompleteMultipartUpload on a large object. Only
# multipart uploads wait this long (`_client`, also resumable.py's); every other call (stat, list,
# delete, gets, single-part puts such as KV blocks) uses `_quick`, so a server that accepts
# connections but never answers (hung, SIGSTOPped) fails those in 2 x QUICK_READ_TIMEOUT_S, not 4 min.
READ_TIMEOUT_S = 120.0
QUICK_READ_TIMEOUT_S = 10.0  # the longest a healthy server goes silent mid-answer, with margin
PARALLEL_PART_UPLOADS = 3

T = TypeVar("T")


class ObjectInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One stored object. sha256 is "" when the object carries no sha256 metadata."""

    bucket: str
    key: str
    size: int
    sha256: str
    etag: str


class S3Settings(Protocol):
    """Read-only, so frozen settings (fleet_runtime.Settings) match."""

    @property
    def s3_endpoint(self) -> str: ...
    @property
    def s3_access_key(self) -> str: ...
    @property
    def s3_secret_key(self) -> str: ...
    @property
    def s3_secure(self) -> bool: ...
    @property
    def s3_region(self) -> str: ...


def part_size_for(size: int) -> int:
    """PART_SIZE, or more (whole MiB) when the object would need more than S3's 10,000 parts."""
    if size <= PART_SIZE * MAX_PARTS:
        return PART_SIZE
    mib = 1024 * 1024
    return math.ceil(size / MAX_PARTS / mib) * mib


def _http_pool(read_timeout_s: float = READ_TIMEOUT_S) -> urllib3.PoolManager:
    # minio's default pool waits 5 minutes and retries 5 times: an unreachable endpoint would
    # hang a service's startup for minutes instead of failing with a clear error.
    return urllib3.PoolManager(
        timeout=Timeout(connect=CONNECT_TIMEOUT_S, read=read_timeout_s),
        maxsize=10,
        retries=Retry(total=3, connect=1, read=1, backoff_factor=0.2, status_forcelist=(500, 502, 503, 504)),
    )


class ObjectStore:
    def __init__(
        self,
        endpoint: str,
        access_key: str = "",
        secret_key: str = "",
        secure: bool = False,
        region: str = "us-east-1",
    ) -> None:
        self.endpoint = endpoint
        self.access_key = access_key
        self.secure = secure
        self._http = _http_pool()
        self._quick_http = _http_pool(QUICK_READ_TIMEOUT_S)

        def client(http: urllib3.PoolManager) -> Minio:
            return Minio(
                endpoint,
                access_key=access_key or None,
                secret_key=secret_key or None,
                secure=secure,
                region=region or None,
                http_client=http,
            )

        self._client = client(self._http)  # multipart uploads only (see READ_TIMEOUT_S)
        self._quick = client(self._quick_http)  # everything else

    @classmethod
    def from_settings(cls, settings: S3Settings) -> ObjectStore:
        return cls(
            endpoint=settings.s3_endpoint,
            access_key=settings.s3_access_key,
            secret_key=settings.s3_secret_key,
            secure=settings.s3_secure,
            region=settings.s3_region,
        )

    @property
    def url(self) -> str:
        return f"{'https' if self.secure else 'http'}://{self.endpoint}"

    def close(self) -> None:
        self._http.clear()
        self._quick_http.clear()

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r}, access_key={self.access_key!r})"

    # --- errors -----------------------------------------------------------------------------

    @contextmanager
    def _translated(self, bucket: str | None = None, key: str | None = None) -> Iterator[None]:
        """Turn minio/urllib3 exceptions into StoreError subclasses."""
        try:
            yield
        except S3Error as exc:
            raise error_for_s3_code(
                exc.code,
                exc.message,
                endpoint=self.url,
                access_key=self.access_key,
                bucket=bucket,
                key=key,
            ) from exc
        except urllib3.exceptions.HTTPError as exc:
            reason = getattr(exc, "reason", None) or exc
            raise StoreUnavailable(f"object storage at {self.url} is not reachable: {reason}") from exc
        except (ServerError, InvalidResponseError) as exc:
            raise StoreUnavailable(f"object storage at {self.url} failed to answer: {exc}") from exc

    # --- buckets and health -----------------------------------------------------------------

    def check(self) -> None:
        """Raise StoreUnavailable or StoreAuthError unless the server answers an authenticated call."""
        with self._translated():
            self._quick.list_buckets()

    def ensure_bucket(self, name: str) -> None:
        with self._translated(name):
            if self._quick.bucket_exists(name):
                return
            try:
                self._quick.make_bucket(name)
            except S3Error as exc:
                # Another process created it between our check and our create.
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    # --- writes -----------------------------------------------------------------------------

    def put_file(
        self,
        bucket: str,
        key: str,
        path: str | Path,
        progress: Progress | None = None,
        sha256: str | None = None,
        content_type: str = "application/octet-stream",
    ) -> ObjectInfo:
        """Stream a file up (multipart when large) with its sha256 in the object's metadata.

        Pass sha256 when already known to skip the hashing pass; it is still checked on the way up.
        """
        size = os.stat(path).st_size
        expected = sha256 or sha256_file(path)
        with open(path, "rb") as file:
            return self._put_verified(bucket, key, file, size, expected, content_type, progress)

    def put_bytes(
        self, bucket: str, key: str, data: bytes, content_type: str = "application/octet-stream"
    ) -> ObjectInfo:
        digest = hashlib.sha256(data).hexdigest()
        return self._put_verified(bucket, key, io.BytesIO(data), len(data), digest, content_type, None)

    def put_stream(
        self,
        bucket: str,
        key: str,
        readable: BinaryIO,
        length: int,
        sha256: str | None = None,
        content_type: str = "application/octet-stream",
        progress: Progress | None = None,
    ) -> ObjectInfo:
        """Upload length bytes from a stream (-1: until EOF).

        The sha256 metadata needs the hash before the upload starts, so it is stored only when the
        caller passes sha256 (then checked on the way up); the returned ObjectInfo always has it.
        """
        return self._put_verified(bucket, key, readable, length, sha256, content_type, progress)

    def _put_verified(
        self,
        bucket: str,
        key: str,
        readable: BinaryIO,
        length: int,
        sha256: str | None,
        content_type: str,
        progress: Progress | None,
    ) -> ObjectInfo:
        reader = HashingReader(readable, length, progress)
        metadata: dict[str, Any] = {SHA256_METADATA: sha256} if sha256 else {}
        # one PUT unless minio splits it into parts (then CompleteMultipartUpload may take long)
        client = self._quick if 0 <= length <= PART_SIZE else self._client
        with self._translated(bucket, key):
            result = client.put_object(
                bucket,
                key,
                reader,  # type: ignore[arg-type]  # duck-typed: minio only calls read()
                length,
                content_type=content_type,
                metadata=metadata,
                part_size=part_size_for(max(length, 0)),
                num_parallel_uploads=PARALLEL_PART_UPLOADS,
            )
        actual = reader.hexdigest()
        if sha256 and actual != sha256:
            # The source changed between hashing and uploading: never leave bytes that lie.
            self.delete(bucket, key)
            raise IntegrityError(bucket, key, sha256, actual, "while uploading (source changed?)")
        return ObjectInfo(
            bucket=bucket, key=key, size=reader.bytes_read, sha256=actual, etag=result.etag or ""
        )

    def put_json(self, bucket: str, key: str, value: msgspec.Struct) -> ObjectInfo:
        return self.put_bytes(bucket, key, msgspec.json.encode(value), "application/json")

    # --- reads ------------------------------------------------------------------------------

    def get_file(
        self,
        bucket: str,
        key: str,
        path: str | Path,
        progress: Progress | None = None,
        expected_sha256: str | None = None,
    ) -> ObjectInfo:
        """Download into a temporary file beside path, verify sha256, then rename it into place.

        Verified against the object's sha256 metadata when it has one, and against expected_sha256
        when given; on a mismatch IntegrityError is raised and no file is left behind.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, self._translated(bucket, key):
                response = self._quick.get_object(bucket, key)
                try:
                    recorded = response.headers.get(SHA256_METADATA, "")
                    etag = response.headers.get("etag", "").strip('"')
                    total = int(response.headers.get("content-length", -1))
                    digest, done = hashlib.sha256(), 0
                    for chunk in response.stream(CHUNK_SIZE):
                        digest.update(chunk)
                        out.write(chunk)
                        done += len(chunk)
                        if progress is not None:
                            progress(done, total)
                    out.flush()
                    os.fsync(out.fileno())
                finally:
                    response.close()
                    response.release_conn()
            actual = digest.hexdigest()
            for expected in (recorded, expected_sha256):
                if expected and expected != actual:
                    raise IntegrityError(bucket, key, expected, actual)
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        return ObjectInfo(bucket=bucket, key=key, size=done, sha256=actual, etag=etag)

    def get_bytes(self, bucket: str, key: str) -> bytes:
        """The object's bytes, verified against its sha256 metadata when it has one."""
        with self._translated(bucket, key):
            response = self._quick.get_object(bucket, key)
            try:
                recorded = response.headers.get(SHA256_METADATA, "")
                data = response.read()
            finally:
                response.close()
                response.release_conn()
        if recorded:
            actual = hashlib.sha256(data).hexdigest()
            if actual != recorded:
                raise IntegrityError(bucket, key, recorded, actual)
        return data

    def get_json(self, bucket: str, key: str, type: type[T]) -> T:
        data = self.get_bytes(bucket, key)
        try:
            return msgspec.json.decode(data, type=type)
        except msgspec.DecodeError as exc:
            raise StoreError(f"{bucket}/{key} is not a valid {type.__name__}: {exc}") from exc

    def stat(self, bucket: str, key: str) -> ObjectInfo | None:
        try:
            with self._translated(bucket, key):
                found = self._quick.stat_object(bucket, key)
        except ObjectNotFound:
            return None
        # HTTPHeaderDict: case-insensitive (SeaweedFS answers X-Amz-Meta-sha256, MinIO ...-Sha256).
        metadata = found.metadata or {}
        return ObjectInfo(
            bucket=bucket,
            key=key,
            size=found.size or 0,
            sha256=metadata.get(SHA256_METADATA, ""),
            etag=found.etag or "",
        )

    def exists(self, bucket: str, key: str) -> bool:
        return self.stat(bucket, key) is not None

    def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key under prefix (recursive), in S3's lexicographic order."""
        with self._translated(bucket):
            return [
                obj.object_name
                for obj in self._quick.list_objects(bucket, prefix=prefix or None, recursive=True)
                if obj.object_name is not None
            ]

    # --- deletes ----------------------------------------------------------------------------

    def delete(self, bucket: str, key: str) -> None:
        """Remove one object; removing a missing object is not an error."""
        with self._translated(bucket, key):
            self._quick.remove_object(bucket, key)

    def delete_prefix(self, bucket: str, prefix: str) -> int:
        """Remove every object under prefix; returns how many there were."""
        if not prefix:
            # An empty prefix would empty the whole bucket: make that impossible by accident.
            raise ValueError("delete_prefix needs a non-empty prefix")
        keys = self.list_keys(bucket, prefix)
        with self._translated(bucket):
            errors = list(self._quick.remove_objects(bucket, (DeleteObject(key) for key in keys)))
        if errors:
            first = errors[0]
            raise StoreError(
                f"could not delete {len(errors)} of {len(keys)} objects under {bucket}/{prefix}: "
                f"{first.name}: {first.code}: {first.message}"
            )
        return len(keys)
