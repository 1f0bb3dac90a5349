"""fleet_store against a real S3 server (SeaweedFS `weed mini`, started by the root conftest)."""

from __future__ import annotations

import hashlib
import io
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from minio import Minio

from fleet_local.processes import free_port
from fleet_local.servers import ServerHandle, start_s3
from fleet_store import (
    IntegrityError,
    ManifestFile,
    ModelManifest,
    ObjectNotFound,
    ObjectStore,
    StoreAuthError,
    StoreError,
    StoreUnavailable,
    fetch_model,
    file_key,
    load_manifest,
    manifest_key,
    stage_folder,
)

MiB = 1024 * 1024


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(8 * MiB):
            digest.update(chunk)
    return digest.hexdigest()


def test_ensure_bucket_is_idempotent(store: ObjectStore) -> None:
    name = f"test-{uuid.uuid4().hex[:12]}"
    store.ensure_bucket(name)
    store.ensure_bucket(name)
    store.put_bytes(name, "probe", b"x")
    assert store.list_keys(name) == ["probe"]


def test_check_passes_on_a_live_server(store: ObjectStore) -> None:
    store.check()


def test_bytes_round_trip_records_sha256(store: ObjectStore, bucket: str) -> None:
    data = os.urandom(1000)
    put = store.put_bytes(bucket, "blobs/one", data)
    assert put.size == 1000 and put.sha256 == hashlib.sha256(data).hexdigest()
    assert store.get_bytes(bucket, "blobs/one") == data
    stat = store.stat(bucket, "blobs/one")
    assert stat is not None
    assert (stat.size, stat.sha256) == (1000, put.sha256)


def test_json_round_trip_decodes_typed(store: ObjectStore, bucket: str) -> None:
    value = ManifestFile(path="model.safetensors", size=12, sha256="ab" * 32)
    store.put_json(bucket, "file.json", value)
    assert store.get_json(bucket, "file.json", ManifestFile) == value
    with pytest.raises(StoreError, match="not a valid ModelManifest"):
        store.get_json(bucket, "file.json", ModelManifest)


def test_file_round_trip_verifies_sha256_and_reports_progress(
    store: ObjectStore, bucket: str, tmp_path: Path
) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(os.urandom(3 * MiB + 17))
    expected = sha256_of(source)
    ups: list[tuple[int, int]] = []
    downs: list[tuple[int, int]] = []

    put = store.put_file(bucket, "files/src.bin", source, progress=lambda d, t: ups.append((d, t)))
    got = store.get_file(
        bucket, "files/src.bin", tmp_path / "out" / "dst.bin", lambda d, t: downs.append((d, t))
    )

    assert put.sha256 == got.sha256 == expected
    assert sha256_of(tmp_path / "out" / "dst.bin") == expected
    size = source.stat().st_size
    assert ups[-1] == (size, size) and downs[-1] == (size, size)
    assert [d for d, _ in downs] == sorted(d for d, _ in downs)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["dst.bin"]  # no temporary left


def test_get_file_replaces_an_existing_file(store: ObjectStore, bucket: str, tmp_path: Path) -> None:
    store.put_bytes(bucket, "k", b"new contents")
    dest = tmp_path / "dest.bin"
    dest.write_bytes(b"old")
    store.get_file(bucket, "k", dest)
    assert dest.read_bytes() == b"new contents"


@pytest.mark.slow
def test_200mb_object_round_trip_multipart_with_sha256(
    store: ObjectStore, bucket: str, tmp_path: Path, record_property
) -> None:
    source, dest = tmp_path / "big.bin", tmp_path / "back" / "big.bin"
    digest = hashlib.sha256()
    with source.open("wb") as file:
        for _ in range(25):
            chunk = os.urandom(8 * MiB)
            digest.update(chunk)
            file.write(chunk)
    expected = digest.hexdigest()

    started = time.perf_counter()
    put = store.put_file(bucket, "big/big.bin", source)
    uploaded = time.perf_counter()
    got = store.get_file(bucket, "big/big.bin", dest)
    downloaded = time.perf_counter()

    upload_s, download_s = uploaded - started, downloaded - uploaded
    record_property("upload_s", round(upload_s, 2))
    record_property("download_s", round(download_s, 2))
    print(f"\n200 MB round trip: upload {upload_s:.2f} s, download {download_s:.2f} s")
    assert put.size == got.size == 200 * MiB
    assert put.sha256 == got.sha256 == expected
    assert sha256_of(dest) == expected
    stat = store.stat(bucket, "big/big.bin")
    assert stat is not None and stat.sha256 == expected
    assert "-" in stat.etag  # S3's multipart etag is "<md5 of part md5s>-<part count>"
    store.delete(bucket, "big/big.bin")
    assert not store.exists(bucket, "big/big.bin")


def test_tampered_object_is_detected_and_leaves_no_file(
    s3_server: ServerHandle, store: ObjectStore, bucket: str, tmp_path: Path
) -> None:
    raw = Minio(s3_server.url, secure=False, region="us-east-1")
    data = b"these bytes do not match their recorded hash"
    lie = hashlib.sha256(b"something else").hexdigest()
    raw.put_object(bucket, "tampered", io.BytesIO(data), len(data), metadata={"x-amz-meta-sha256": lie})

    dest_dir = tmp_path / "dest"
    with pytest.raises(IntegrityError) as caught:
        store.get_file(bucket, "tampered", dest_dir / "file.bin")
    message = str(caught.value)
    assert f"{bucket}/tampered" in message
    assert lie in message and hashlib.sha256(data).hexdigest() in message
    assert list(dest_dir.iterdir()) == []
    with pytest.raises(IntegrityError):
        store.get_bytes(bucket, "tampered")


def test_put_file_with_a_wrong_known_hash_stores_nothing(
    store: ObjectStore, bucket: str, tmp_path: Path
) -> None:
    source = tmp_path / "f.bin"
    source.write_bytes(b"actual contents")
    with pytest.raises(IntegrityError):
        store.put_file(bucket, "f.bin", source, sha256="0" * 64)
    assert not store.exists(bucket, "f.bin")


def test_missing_object_raises_object_not_found(store: ObjectStore, bucket: str, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound, match=f"{bucket}/nope"):
        store.get_bytes(bucket, "nope")
    with pytest.raises(LookupError):
        store.get_json(bucket, "nope.json", ManifestFile)
    with pytest.raises(ObjectNotFound):
        store.get_file(bucket, "nope", tmp_path / "nope.bin")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ObjectNotFound, match="bucket does not exist"):
        store.get_bytes("no-such-bucket-here", "k")
    assert store.stat(bucket, "nope") is None
    assert not store.exists(bucket, "nope")
    store.delete(bucket, "nope")  # deleting what is not there is fine


def test_list_and_delete_prefix(store: ObjectStore, bucket: str) -> None:
    for key in ("kv/a/1", "kv/a/2", "kv/b/1", "other"):
        store.put_bytes(bucket, key, key.encode())
    assert store.list_keys(bucket, "kv/") == ["kv/a/1", "kv/a/2", "kv/b/1"]
    assert store.delete_prefix(bucket, "kv/a/") == 2
    assert store.list_keys(bucket) == ["kv/b/1", "other"]
    with pytest.raises(ValueError):
        store.delete_prefix(bucket, "")


def test_a_server_takes_more_buckets_than_free_disk_would_size_it_for(tmp_path: Path) -> None:
    # weed mini's default volume count is free disk / volume size: with 31 GiB free the 31st bucket
    # (each is a collection with volumes of its own) failed with 500 "no free volumes" (a CI run).
    handle = start_s3(tmp_path / "s3")
    store = ObjectStore(handle.url)
    try:
        for index in range(40):
            name = f"many-{index}-{uuid.uuid4().hex[:8]}"
            store.ensure_bucket(name)
            store.put_bytes(name, "k", b"x")
            assert store.get_bytes(name, "k") == b"x"
    finally:
        store.close()
        handle.stop()


def test_unreachable_endpoint_fails_fast_and_clearly() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    store = ObjectStore(endpoint)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        store.check()
    assert time.monotonic() - started < 15
    assert endpoint in str(caught.value) and "not reachable" in str(caught.value)
    with pytest.raises(StoreUnavailable):
        store.get_bytes("fleet-models", "x")


@pytest.fixture(scope="module")
def s3_with_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    handle = start_s3(tmp_path_factory.mktemp("s3-auth"), access_key="fleetkey", secret_key="fleetsecret")
    try:
        yield handle
    finally:
        handle.stop()


def test_wrong_credentials_raise_store_auth_error(s3_with_auth: ServerHandle) -> None:
    wrong_secret = ObjectStore(s3_with_auth.url, access_key="fleetkey", secret_key="not-the-secret")
    with pytest.raises(StoreAuthError) as caught:
        wrong_secret.check()
    assert "fleetkey" in str(caught.value) and "not-the-secret" not in str(caught.value)
    with pytest.raises(StoreAuthError):
        wrong_secret.ensure_bucket("fleet-models")

    with pytest.raises(StoreAuthError, match="intruder"):
        ObjectStore(s3_with_auth.url, access_key="intruder", secret_key="fleetsecret").check()
    with pytest.raises(StoreAuthError, match="no credentials"):
        ObjectStore(s3_with_auth.url).check()

    right = ObjectStore(s3_with_auth.url, access_key="fleetkey", secret_key="fleetsecret")
    right.check()
    right.ensure_bucket("fleet-models")
    right.ensure_bucket("fleet-models")
    right.put_bytes("fleet-models", "k", b"v")
    assert right.get_bytes("fleet-models", "k") == b"v"


class RecordingStore(ObjectStore):
    """Records the order of writes, to check that the manifest goes last."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.written: list[str] = []

    def put_file(
        self, bucket, key, path, progress=None, sha256=None, content_type="application/octet-stream"
    ):
        self.written.append(key)
        return super().put_file(bucket, key, path, progress, sha256, content_type)

    def put_json(self, bucket, key, value):
        self.written.append(key)
        return super().put_json(bucket, key, value)


def _model_folder(root: Path) -> dict[str, bytes]:
    files = {
        "config.json": b'{"model_type": "llama", "hidden_size": 64}',
        "model.safetensors": os.urandom(20 * MiB),  # above the part size: multipart
        "tokenizer/tokenizer.json": b'{"version": "1.0"}',
        "empty.txt": b"",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_stage_folder_then_fetch_model_twice(s3_server: ServerHandle, bucket: str, tmp_path: Path) -> None:
    files = _model_folder(tmp_path / "src")
    store = RecordingStore(s3_server.url)
    progress: list[tuple[int, int]] = []

    manifest = stage_folder(
        store,
        bucket,
        "org/tiny",
        "rev1",
        tmp_path / "src",
        "local:test",
        lambda d, t: progress.append((d, t)),
    )

    total = sum(len(d) for d in files.values())
    assert progress[-1] == (total, total)
    assert store.written[-1] == manifest_key("org/tiny", "rev1")
    assert sorted(store.written[:-1]) == sorted(file_key("org/tiny", "rev1", p) for p in files)
    assert manifest.config == {"model_type": "llama", "hidden_size": 64}
    assert load_manifest(store, bucket, "org/tiny", "rev1") == manifest
    assert len(store.list_keys(bucket, "org/tiny/rev1/")) == len(files) + 1

    store.written.clear()
    assert (
        stage_folder(store, bucket, "org/tiny", "rev1", tmp_path / "src", "local:test").files
        == manifest.files
    )
    assert store.written == [manifest_key("org/tiny", "rev1")]  # unchanged files are not uploaded again

    dest = tmp_path / "dest"
    first = fetch_model(store, bucket, manifest, dest)
    assert sorted(first.downloaded) == sorted(files) and first.skipped == ()
    for rel, data in files.items():
        assert (dest / rel).read_bytes() == data

    second = fetch_model(store, bucket, manifest, dest)
    assert second.downloaded == () and sorted(second.skipped) == sorted(files)

    (dest / "tokenizer/tokenizer.json").write_bytes(b'{"version": "2.0"}')  # same size, other bytes
    third = fetch_model(store, bucket, manifest, dest)
    assert third.downloaded == ("tokenizer/tokenizer.json",)
    assert (dest / "tokenizer/tokenizer.json").read_bytes() == files["tokenizer/tokenizer.json"]


def test_fetch_model_rejects_files_that_differ_from_the_manifest(
    store: ObjectStore, bucket: str, tmp_path: Path
) -> None:
    _model_folder(tmp_path / "src")
    manifest = stage_folder(store, bucket, "tiny", "rev1", tmp_path / "src", "local:test")
    wrong = ManifestFile(path="config.json", size=manifest.files[0].size, sha256="f" * 64)
    lying = ModelManifest(
        model_id="tiny", revision="rev1", files=(wrong,), config={}, created_at=0.0, source="test"
    )
    with pytest.raises(IntegrityError, match="f" * 64):
        fetch_model(store, bucket, lying, tmp_path / "dest")
    assert not (tmp_path / "dest" / "config.json").exists()
