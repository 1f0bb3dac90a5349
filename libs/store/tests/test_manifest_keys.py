"""Pure logic of fleet_store: keys, path checks, manifests of local folders, part sizes, error mapping."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgspec
import pytest

from fleet_store import (
    IntegrityError,
    ModelManifest,
    ObjectNotFound,
    StoreAuthError,
    StoreError,
    build_manifest,
    file_key,
    manifest_key,
)
from fleet_store.client import MAX_PARTS, PART_SIZE, part_size_for
from fleet_store.errors import error_for_s3_code
from fleet_store.manifest import local_file_matches, model_file_paths

pytestmark = pytest.mark.unit


def test_keys_put_files_beside_manifest() -> None:
    assert (
        manifest_key("HuggingFaceTB/SmolLM2-135M", "main") == "HuggingFaceTB/SmolLM2-135M/main/manifest.json"
    )
    assert file_key("smol", "abc123", "model.safetensors") == "smol/abc123/model.safetensors"
    assert file_key("smol", "abc123", "tokenizer/vocab.json") == "smol/abc123/tokenizer/vocab.json"


@pytest.mark.parametrize(
    "path",
    ["", "/etc/passwd", "../secret", "a/../../b", "a/./b", "a//b", "a\\b", "..\\evil", "a/", "./a", "a\0b"],
)
def test_file_key_rejects_paths_that_could_escape(path: str) -> None:
    with pytest.raises(ValueError):
        file_key("smol", "main", path)


@pytest.mark.parametrize(
    ("model_id", "revision"), [("../x", "main"), ("/abs", "main"), ("m", "a/b"), ("m", "..")]
)
def test_model_id_and_revision_are_checked_too(model_id: str, revision: str) -> None:
    with pytest.raises(ValueError):
        manifest_key(model_id, revision)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_build_manifest_hashes_every_file_sorted_with_posix_paths(tmp_path: Path) -> None:
    config = {"model_type": "llama", "num_hidden_layers": 2}
    files = {
        "config.json": json.dumps(config).encode(),
        "model.safetensors": b"\x01" * 3_000_000,  # spans several hashing chunks
        "tokenizer/tokenizer.json": b"{}",
        "empty.txt": b"",
    }
    for rel, data in files.items():
        _write(tmp_path / rel, data)
    _write(tmp_path / ".cache" / "huggingface" / "download.lock", b"x")
    _write(tmp_path / ".gitattributes", b"x")

    manifest = build_manifest("smol", "main", tmp_path, source="local:/models/smol")

    assert [f.path for f in manifest.files] == sorted(files)
    for file in manifest.files:
        assert file.size == len(files[file.path])
        assert file.sha256 == hashlib.sha256(files[file.path]).hexdigest()
    assert manifest.config == config
    assert manifest.total_size == sum(len(d) for d in files.values())
    assert (manifest.model_id, manifest.revision, manifest.source) == ("smol", "main", "local:/models/smol")
    decoded = msgspec.json.decode(msgspec.json.encode(manifest), type=ModelManifest)
    assert decoded == manifest


def test_build_manifest_without_config_has_empty_config(tmp_path: Path) -> None:
    _write(tmp_path / "weights.bin", b"abc")
    assert build_manifest("m", "r", tmp_path, source="test").config == {}


def test_model_file_paths_ignores_hidden_directories(tmp_path: Path) -> None:
    _write(tmp_path / "a" / "b.bin", b"1")
    _write(tmp_path / ".git" / "HEAD", b"ref")
    assert model_file_paths(tmp_path) == ["a/b.bin"]


def test_local_file_matches_needs_size_and_hash(tmp_path: Path) -> None:
    _write(tmp_path / "w.bin", b"abcd")
    manifest = build_manifest("m", "r", tmp_path, source="test")
    (entry,) = manifest.files
    assert local_file_matches(tmp_path / "w.bin", entry)
    (tmp_path / "w.bin").write_bytes(b"abce")  # same size, different bytes
    assert not local_file_matches(tmp_path / "w.bin", entry)
    assert not local_file_matches(tmp_path / "missing.bin", entry)


def test_part_size_stays_within_s3_part_limit() -> None:
    assert part_size_for(0) == PART_SIZE
    assert part_size_for(200 * 1024 * 1024) == PART_SIZE
    huge = PART_SIZE * MAX_PARTS * 3 + 1
    size = part_size_for(huge)
    assert size % (1024 * 1024) == 0
    assert -(-huge // size) <= MAX_PARTS


def test_s3_error_codes_map_to_store_errors_without_the_secret() -> None:
    common = {"endpoint": "http://s3:9000", "access_key": "fleetkey", "bucket": "b", "key": "k"}
    auth = error_for_s3_code("SignatureDoesNotMatch", "bad signature", **common)
    assert isinstance(auth, StoreAuthError)
    assert "fleetkey" in str(auth) and "http://s3:9000" in str(auth)

    missing = error_for_s3_code("NoSuchKey", "no", **common)
    assert isinstance(missing, ObjectNotFound) and isinstance(missing, LookupError)
    assert "b/k" in str(missing)

    other = error_for_s3_code("SlowDown", "later", **common)
    assert type(other) is StoreError and "SlowDown" in str(other)


def test_integrity_error_names_object_and_both_hashes() -> None:
    error = IntegrityError("fleet-models", "m/r/w.bin", "aa" * 32, "bb" * 32)
    assert "fleet-models/m/r/w.bin" in str(error)
    assert "aa" * 32 in str(error) and "bb" * 32 in str(error)
