"""Model manifests: `<model_id>/<revision>/manifest.json` in the models bucket, beside the model's files.

The manifest is uploaded last, so its presence means every file it lists is stored.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Collection
from pathlib import Path, PurePosixPath
from typing import Any

import msgspec

from fleet_store.client import ObjectStore
from fleet_store.hashing import Progress, sha256_file
from fleet_store.layers import folder_weight_layers
from fleet_store.resumable import put_file_resumable

MANIFEST_NAME = "manifest.json"

log = logging.getLogger("fleet_store")
# The revision a model is staged under when its source names none.
DEFAULT_REVISION = "main"


class ManifestFile(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    """Relative posix path inside the model folder."""
    size: int
    sha256: str


class ModelManifest(msgspec.Struct, frozen=True, kw_only=True):
    model_id: str
    revision: str
    files: tuple[ManifestFile, ...]
    config: dict[str, Any]
    """The model's config.json ({} when it has none)."""
    created_at: float
    source: str
    """Where the files came from (a hub id, a local folder, a GGUF file ...)."""
    weight_layers: dict[str, list[int]] = {}
    """Per *.safetensors file: [first_layer, end_layer) of the transformer layers it holds, or [] when
    it holds tensors every shard needs (embeddings, norms, lm_head). See fleet_store.layers; {} in
    manifests written before it existed, and for models without safetensors: every shard needs every file."""

    @property
    def total_size(self) -> int:
        return sum(file.size for file in self.files)


class FetchResult(msgspec.Struct, frozen=True, kw_only=True):
    downloaded: tuple[str, ...]
    skipped: tuple[str, ...]
    """Already present locally with the right size and sha256."""


# --- keys (pure) -------------------------------------------------------------------------------


def checked_relative_path(path: str, what: str = "path") -> str:
    """path itself, if it is a clean relative posix path that cannot escape its folder."""
    if not path:
        raise ValueError(f"{what} is empty")
    if "\\" in path or "\0" in path:
        raise ValueError(f"{what} {path!r} has a backslash or NUL")
    if path.startswith("/"):
        raise ValueError(f"{what} {path!r} is absolute")
    segments = path.split("/")
    if any(segment in ("", ".", "..") for segment in segments):
        raise ValueError(f"{what} {path!r} has an empty, '.' or '..' segment")
    return path


def _checked_revision(revision: str) -> str:
    checked_relative_path(revision, "revision")
    # One segment, so that <model_id>/<revision>/ splits one way only.
    if "/" in revision:
        raise ValueError(f"revision {revision!r} contains '/'")
    return revision


def model_prefix(model_id: str, revision: str) -> str:
    """The key prefix of one model revision (model ids like 'org/name' keep their slash)."""
    return f"{checked_relative_path(model_id, 'model id')}/{_checked_revision(revision)}/"


def manifest_key(model_id: str, revision: str) -> str:
    return model_prefix(model_id, revision) + MANIFEST_NAME


def file_key(model_id: str, revision: str, path: str) -> str:
    return model_prefix(model_id, revision) + checked_relative_path(path)


# --- local folders -----------------------------------------------------------------------------


def model_file_paths(folder: Path) -> list[str]:
    """Relative posix paths of the files under folder, sorted.

    Hidden entries are left out: they are tool state (e.g. huggingface_hub's .cache/), not model.
    """
    paths = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [name for name in dirs if not name.startswith(".")]
        relative_root = PurePosixPath(Path(root).relative_to(folder).as_posix())
        for name in files:
            if not name.startswith("."):
                paths.append(checked_relative_path(str(relative_root / name)))
    return sorted(paths)


def build_manifest(model_id: str, revision: str, folder: str | Path, source: str) -> ModelManifest:
    folder = Path(folder)
    model_prefix(model_id, revision)  # validates both before any hashing
    files = tuple(
        ManifestFile(path=path, size=(folder / path).stat().st_size, sha256=sha256_file(folder / path))
        for path in model_file_paths(folder)
    )
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    return ModelManifest(
        model_id=model_id,
        revision=revision,
        files=files,
        config=config,
        created_at=time.time(),
        source=source,
        weight_layers=folder_weight_layers(folder, (file.path for file in files)),
    )


def local_file_matches(path: Path, file: ManifestFile) -> bool:
    return path.is_file() and path.stat().st_size == file.size and sha256_file(path) == file.sha256


# --- object storage ----------------------------------------------------------------------------


def _overall(progress: Progress | None, done_before: int, total: int) -> Progress | None:
    """A per-file progress callback that reports bytes across all files."""
    if progress is None:
        return None
    return lambda done, _file_total: progress(done_before + done, total)


def stage_folder(
    store: ObjectStore,
    bucket: str,
    model_id: str,
    revision: str,
    folder: str | Path,
    source: str,
    progress: Progress | None = None,
    journal_dir: str | Path | None = None,
) -> ModelManifest:
    """Upload a model folder, then its manifest (last: the manifest marks the model complete).

    Files already stored with the same size and sha256 are not uploaded again. With a journal_dir,
    each file goes up as a resumable multipart upload: a stager that crashed and runs again with the
    same journal_dir re-sends only the parts the server does not hold.
    """
    folder = Path(folder)
    manifest = build_manifest(model_id, revision, folder, source)
    total, done = manifest.total_size, 0
    for file in manifest.files:
        key = file_key(model_id, revision, file.path)
        stored = store.stat(bucket, key)
        if stored is None or stored.size != file.size or stored.sha256 != file.sha256:
            file_progress = _overall(progress, done, total)
            if journal_dir is None:
                store.put_file(bucket, key, folder / file.path, progress=file_progress, sha256=file.sha256)
            else:
                path = folder / file.path
                result = put_file_resumable(
                    store, bucket, key, path, journal_dir, sha256=file.sha256, progress=file_progress
                )
                if result.resumed:
                    log.info(
                        "resumed %s: %d bytes reused, %d uploaded",
                        key,
                        result.skipped_bytes,
                        result.uploaded_bytes,
                    )
        done += file.size
        if progress is not None:
            progress(done, total)
    store.put_json(bucket, manifest_key(model_id, revision), manifest)
    return manifest


def load_manifest(store: ObjectStore, bucket: str, model_id: str, revision: str) -> ModelManifest:
    """The stored manifest; ObjectNotFound when the model is absent or not completely staged."""
    return store.get_json(bucket, manifest_key(model_id, revision), ModelManifest)


def fetch_model(
    store: ObjectStore,
    bucket: str,
    manifest: ModelManifest,
    dest_folder: str | Path,
    progress: Progress | None = None,
    *,
    only: Collection[str] | None = None,
) -> FetchResult:
    """Download every file of the manifest (or only those paths of it) into dest_folder, each
    verified against the manifest.

    Files already present with the right size and sha256 are skipped. A path in `only` that the
    manifest does not list is a ValueError (nothing is downloaded then).
    """
    dest_folder = Path(dest_folder)
    files = manifest.files
    if only is not None:
        wanted = set(only)
        unknown = wanted - {file.path for file in files}
        if unknown:
            raise ValueError(f"{manifest.model_id}/{manifest.revision} has no files {sorted(unknown)}")
        files = tuple(file for file in files if file.path in wanted)
    total, done = sum(file.size for file in files), 0
    downloaded: list[str] = []
    skipped: list[str] = []
    for file in files:
        key = file_key(manifest.model_id, manifest.revision, file.path)  # also rejects traversal
        local = dest_folder / file.path
        if local_file_matches(local, file):
            skipped.append(file.path)
        else:
            store.get_file(
                bucket, key, local, progress=_overall(progress, done, total), expected_sha256=file.sha256
            )
            downloaded.append(file.path)
        done += file.size
        if progress is not None:
            progress(done, total)
    return FetchResult(downloaded=tuple(downloaded), skipped=tuple(skipped))
