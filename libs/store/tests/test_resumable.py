"""Resumable multipart uploads (fleet_store.resumable) against a real SeaweedFS, plus its pure helpers."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from minio import Minio
from minio.datatypes import ListMultipartUploadsResult, ListPartsResult, Part, Upload

from fleet_local.servers import ServerHandle
from fleet_store import (
    IntegrityError,
    ObjectInfo,
    ObjectStore,
    StoreError,
    UploadResult,
    abandon_stale_uploads,
    put_file_resumable,
)
from fleet_store.resumable import (
    MIN_PART_SIZE,
    PartRange,
    UploadJournal,
    _Multipart,
    decode_journal,
    effective_part_size,
    encode_journal,
    journal_matches,
    journal_path,
    part_ranges,
    read_journal,
    stored_mismatch,
    write_journal,
)

MiB = 1024 * 1024
PART = 16 * MiB
SMALL_PART = MIN_PART_SIZE  # 5 MiB parts keep the quick tests quick


def write_random(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with path.open("wb") as file:
        left = size
        while left:
            chunk = os.urandom(min(8 * MiB, left))
            digest.update(chunk)
            file.write(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def md5_hex(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


class Interrupted(Exception):
    pass


def interrupt_after(limit: int):
    """A progress callback that stops the upload once `limit` bytes are done (an in-process crash)."""

    def progress(done: int, _total: int) -> None:
        if done >= limit:
            raise Interrupted(done)

    return progress


def uploads_in_flight(store: ObjectStore, bucket: str, prefix: str) -> list[tuple[str, str]]:
    return [(key, upload_id) for key, upload_id, _ in _Multipart(store, bucket).list_uploads(prefix)]


# --- pure helpers ------------------------------------------------------------------------------


def test_part_ranges_cover_the_file_exactly() -> None:
    assert part_ranges(10, 4) == [PartRange(1, 0, 4), PartRange(2, 4, 4), PartRange(3, 8, 2)]
    assert part_ranges(8, 4) == [PartRange(1, 0, 4), PartRange(2, 4, 4)]
    ranges = part_ranges(100 * MiB + 3, PART)
    assert sum(r.length for r in ranges) == 100 * MiB + 3
    assert all(r.offset == (r.number - 1) * PART for r in ranges)


def test_effective_part_size_grows_past_ten_thousand_parts() -> None:
    assert effective_part_size(100 * MiB, PART) == PART
    huge = 10_000 * PART + 1
    grown = effective_part_size(huge, PART)
    assert grown % MiB == 0 and grown > PART and len(part_ranges(huge, grown)) <= 10_000


def test_journal_round_trip_and_garbage() -> None:
    journal = UploadJournal(bucket="b", key="k/x", upload_id="u", size=5, sha256="ab", part_size=4, mtime=1.5)
    assert decode_journal(encode_journal(journal)) == journal
    assert decode_journal(b"{not json") is None
    assert decode_journal(b'{"bucket": "b"}') is None
    other_file = UploadJournal(bucket="b", key="k/x", upload_id="", size=5, sha256="cd", part_size=4, mtime=9)
    same_file = UploadJournal(bucket="b", key="k/x", upload_id="", size=5, sha256="ab", part_size=4, mtime=9)
    assert journal_matches(journal, same_file) and not journal_matches(journal, other_file)


def test_journal_path_is_stable_and_per_key(tmp_path: Path) -> None:
    assert journal_path(tmp_path, "b", "k") == journal_path(tmp_path, "b", "k")
    assert journal_path(tmp_path, "b", "k") != journal_path(tmp_path, "b", "k2")
    assert journal_path(tmp_path, "b", "k").parent == tmp_path


def test_stored_mismatch_names_the_problem() -> None:
    ok = ObjectInfo(bucket="b", key="k", size=10, sha256="aa", etag="e")
    assert stored_mismatch(ok, 10, "aa") == ""
    assert "missing" in stored_mismatch(None, 10, "aa")
    assert "differ" in stored_mismatch(ok, 11, "aa")
    assert "differ" in stored_mismatch(ok, 10, "bb")


def test_minio_private_multipart_signatures_are_pinned() -> None:
    """resumable.py calls these private minio methods: an SDK upgrade that changes them fails here."""
    expected = {
        "_create_multipart_upload": ["self", "bucket_name", "object_name", "headers"],
        "_upload_part": ["self", "bucket_name", "object_name", "data", "headers", "upload_id", "part_number"],
        "_complete_multipart_upload": ["self", "bucket_name", "object_name", "upload_id", "parts", "ssec"],
        "_abort_multipart_upload": ["self", "bucket_name", "object_name", "upload_id"],
        "_list_parts": [
            "self", "bucket_name", "object_name", "upload_id", "max_parts", "part_number_marker",
            "extra_headers", "extra_query_params",
        ],
        "_list_multipart_uploads": [
            "self", "bucket_name", "delimiter", "encoding_type", "key_marker", "max_uploads", "prefix",
            "upload_id_marker", "extra_headers", "extra_query_params",
        ],
    }  # fmt: skip
    for name, params in expected.items():
        assert list(inspect.signature(getattr(Minio, name)).parameters) == params, name
    part_fields = [field.name for field in dataclasses.fields(Part)]
    assert part_fields[:2] == ["part_number", "etag"] and "size" in part_fields
    assert {"parts", "is_truncated", "next_part_number_marker"} <= {
        f.name for f in dataclasses.fields(ListPartsResult)
    }
    assert {"uploads", "is_truncated"} <= {f.name for f in dataclasses.fields(ListMultipartUploadsResult)}
    assert {"object_name", "upload_id", "initiated_time"} <= {f.name for f in dataclasses.fields(Upload)}


# --- what the server must do for resumption to be safe -----------------------------------------


def test_server_part_etag_is_md5_and_content_md5_is_enforced(store: ObjectStore, bucket: str) -> None:
    mp = _Multipart(store, bucket, "probe/obj")
    upload_id = mp.create("0" * 64)
    try:
        data = os.urandom(1000)
        assert mp.upload_part(upload_id, 1, data) == md5_hex(data)
        with pytest.raises(StoreError, match="BadDigest"):
            mp.upload_part(upload_id, 2, data, hashlib.md5(b"other bytes", usedforsecurity=False).digest())
        assert mp.list_parts(upload_id) == {1: {(md5_hex(data), 1000)}}
    finally:
        mp.abort("probe/obj", upload_id)
    assert mp.list_parts(upload_id) is None


# --- uploads -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_100mb_round_trip(store: ObjectStore, bucket: str, tmp_path: Path) -> None:
    source, size = tmp_path / "big.bin", 100 * MiB + 123
    digest = write_random(source, size)
    seen: list[tuple[int, int]] = []
    result = put_file_resumable(
        store, bucket, "m/big.bin", source, tmp_path / "journal", progress=lambda d, t: seen.append((d, t))
    )
    assert isinstance(result, UploadResult)
    assert (result.uploaded_bytes, result.skipped_bytes, result.resumed) == (size, 0, False)
    assert (result.info.size, result.info.sha256) == (size, digest)
    assert seen[-1] == (size, size) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert list((tmp_path / "journal").iterdir()) == []
    got = store.get_file(bucket, "m/big.bin", tmp_path / "back.bin", expected_sha256=digest)
    assert (got.size, got.sha256) == (size, digest)
    assert uploads_in_flight(store, bucket, "m/") == []


def test_small_file_goes_through_put_file(store: ObjectStore, bucket: str, tmp_path: Path) -> None:
    source = tmp_path / "small.bin"
    digest = write_random(source, 1000)
    result = put_file_resumable(store, bucket, "s/small.bin", source, tmp_path / "journal")
    assert (result.uploaded_bytes, result.info.sha256) == (1000, digest)
    stored = store.stat(bucket, "s/small.bin")
    assert stored is not None and (stored.size, stored.sha256) == (1000, digest)


CRASH_SCRIPT = """
import sys, time
from fleet_store import ObjectStore, put_file_resumable
url, bucket, key, path, journal, stall_at = sys.argv[1:]
def progress(done, total):
    print(done, flush=True)
    if done >= int(stall_at):
        time.sleep(600)  # a stalled link: the test SIGKILLs us here
put_file_resumable(ObjectStore(url), bucket, key, path, journal, progress=progress)
print("finished", flush=True)
"""


@pytest.mark.slow
def test_upload_killed_by_sigkill_resumes_without_resending_finished_parts(
    s3_server: ServerHandle, store: ObjectStore, bucket: str, tmp_path: Path
) -> None:
    source, size, key, journal_dir = tmp_path / "model.bin", 160 * MiB, "m/model.bin", tmp_path / "journal"
    digest = write_random(source, size)
    argv = [sys.executable, "-c", CRASH_SCRIPT, s3_server.url, bucket, key, str(source), str(journal_dir)]
    child = subprocess.Popen([*argv, str(64 * MiB)], stdout=subprocess.PIPE, text=True)
    try:
        done_before_kill = 0
        assert child.stdout is not None
        for line in child.stdout:
            assert line.strip() != "finished", "the upload finished before it could be killed"
            done_before_kill = int(line)
            if done_before_kill >= 64 * MiB:
                break
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert done_before_kill >= 4 * PART
    journal = read_journal(journal_path(journal_dir, bucket, key))
    assert journal is not None and journal.sha256 == digest
    assert store.stat(bucket, key) is None  # nothing is visible before the upload completes

    result = put_file_resumable(store, bucket, key, source, journal_dir)
    assert result.resumed
    assert result.skipped_bytes >= done_before_kill
    assert result.uploaded_bytes <= size - done_before_kill
    assert result.uploaded_bytes + result.skipped_bytes == size
    assert (result.info.size, result.info.sha256) == (size, digest)
    assert store.get_file(bucket, key, tmp_path / "back.bin").sha256 == digest
    assert not journal_path(journal_dir, bucket, key).exists()
    assert uploads_in_flight(store, bucket, "m/") == []


def test_changed_file_restarts_cleanly(store: ObjectStore, bucket: str, tmp_path: Path) -> None:
    source, key, journal_dir = tmp_path / "f.bin", "c/f.bin", tmp_path / "journal"
    write_random(source, 3 * SMALL_PART + 7)
    with pytest.raises(Interrupted):
        put_file_resumable(
            store, bucket, key, source, journal_dir, part_size=SMALL_PART, progress=interrupt_after(1)
        )
    old = read_journal(journal_path(journal_dir, bucket, key))
    assert old is not None and _Multipart(store, bucket, key).list_parts(old.upload_id)

    with source.open("r+b") as file:  # same size, different bytes
        file.write(b"changed")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    result = put_file_resumable(store, bucket, key, source, journal_dir, part_size=SMALL_PART)
    assert (result.resumed, result.skipped_bytes, result.info.sha256) == (False, 0, digest)
    assert _Multipart(store, bucket, key).list_parts(old.upload_id) is None  # the old upload was aborted
    assert store.get_bytes(bucket, key) == source.read_bytes()
    assert uploads_in_flight(store, bucket, "c/") == []


def test_part_corrupted_on_the_server_is_sent_again(store: ObjectStore, bucket: str, tmp_path: Path) -> None:
    source, key, journal_dir = tmp_path / "f.bin", "x/f.bin", tmp_path / "journal"
    size = 3 * SMALL_PART - 5
    digest = write_random(source, size)
    data = source.read_bytes()
    # An interrupted upload whose part 1 holds the wrong bytes (right size) and part 2 the right ones.
    mp = _Multipart(store, bucket, key)
    upload_id = mp.create(digest)
    garbage, part2 = os.urandom(SMALL_PART), data[SMALL_PART : 2 * SMALL_PART]
    mp.upload_part(upload_id, 1, garbage)
    mp.upload_part(upload_id, 2, part2)
    write_journal(
        journal_path(journal_dir, bucket, key),
        UploadJournal(bucket=bucket, key=key, upload_id=upload_id, size=size, sha256=digest,
                      part_size=SMALL_PART, mtime=0.0),
    )  # fmt: skip

    result = put_file_resumable(store, bucket, key, source, journal_dir, part_size=SMALL_PART)
    assert result.resumed
    assert (result.skipped_bytes, result.uploaded_bytes) == (SMALL_PART, size - SMALL_PART)
    assert store.get_bytes(bucket, key) == data


def test_wrong_sha256_raises_and_leaves_no_object_and_no_upload(
    store: ObjectStore, bucket: str, tmp_path: Path
) -> None:
    source, key, journal_dir = tmp_path / "f.bin", "w/f.bin", tmp_path / "journal"
    actual = write_random(source, 2 * SMALL_PART + 1)
    with pytest.raises(IntegrityError) as caught:
        put_file_resumable(store, bucket, key, source, journal_dir, sha256="0" * 64, part_size=SMALL_PART)
    assert caught.value.actual == actual
    assert store.stat(bucket, key) is None
    assert uploads_in_flight(store, bucket, "w/") == []
    assert not journal_path(journal_dir, bucket, key).exists()


def test_completed_upload_with_a_leftover_journal_is_not_sent_again(
    store: ObjectStore, bucket: str, tmp_path: Path
) -> None:
    source, key, journal_dir = tmp_path / "f.bin", "d/f.bin", tmp_path / "journal"
    digest = write_random(source, 2 * SMALL_PART)
    with pytest.raises(Interrupted):
        put_file_resumable(
            store, bucket, key, source, journal_dir, part_size=SMALL_PART, progress=interrupt_after(1)
        )
    jpath = journal_path(journal_dir, bucket, key)
    saved = jpath.read_bytes()
    first = put_file_resumable(store, bucket, key, source, journal_dir, part_size=SMALL_PART)
    assert first.resumed and first.info.sha256 == digest
    jpath.write_bytes(saved)  # as if the process died between completing and deleting the journal
    again = put_file_resumable(store, bucket, key, source, journal_dir, part_size=SMALL_PART)
    assert (again.resumed, again.uploaded_bytes, again.info.sha256) == (True, 0, digest)
    assert not jpath.exists()


def test_journal_whose_upload_vanished_starts_over(store: ObjectStore, bucket: str, tmp_path: Path) -> None:
    source, key, journal_dir = tmp_path / "f.bin", "v/f.bin", tmp_path / "journal"
    digest = write_random(source, 2 * SMALL_PART + 3)
    with pytest.raises(Interrupted):
        put_file_resumable(
            store, bucket, key, source, journal_dir, part_size=SMALL_PART, progress=interrupt_after(1)
        )
    old = read_journal(journal_path(journal_dir, bucket, key))
    assert old is not None
    _Multipart(store, bucket, key).abort(key, old.upload_id)
    result = put_file_resumable(store, bucket, key, source, journal_dir, part_size=SMALL_PART)
    assert (result.resumed, result.skipped_bytes, result.info.sha256) == (False, 0, digest)


def test_abandon_stale_uploads_keeps_journaled_ones(store: ObjectStore, bucket: str, tmp_path: Path) -> None:
    source, journal_dir = tmp_path / "f.bin", tmp_path / "journal"
    digest = write_random(source, 2 * SMALL_PART + 3)
    with pytest.raises(Interrupted):
        put_file_resumable(
            store,
            bucket,
            "a/kept.bin",
            source,
            journal_dir,
            part_size=SMALL_PART,
            progress=interrupt_after(1),
        )
    orphan = _Multipart(store, bucket, "a/orphan.bin").create("0" * 64)
    elsewhere = _Multipart(store, bucket, "b/orphan.bin").create("0" * 64)
    assert abandon_stale_uploads(store, bucket, "a/", journal_dir, older_than_s=3600) == []
    time.sleep(1.1)  # the server's Initiated time has whole seconds
    assert abandon_stale_uploads(store, bucket, "a/", journal_dir, older_than_s=0) == ["a/orphan.bin"]
    remaining = uploads_in_flight(store, bucket, "")
    assert ("a/orphan.bin", orphan) not in remaining and ("b/orphan.bin", elsewhere) in remaining
    assert [key for key, _ in remaining if key.startswith("a/")] == ["a/kept.bin"]
    result = put_file_resumable(store, bucket, "a/kept.bin", source, journal_dir, part_size=SMALL_PART)
    assert result.resumed and result.info.sha256 == digest
