"""Stage a model into object storage: resolve its source to a local HF folder, then upload it.

Blocking (file I/O, torch, S3): the service runs it with asyncio.to_thread.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from fleet_downloader.convert import CONVERTER_VERSION, convert_in_child
from fleet_downloader.hub import download_repo, hub_folder
from fleet_downloader.progress import StageProgress
from fleet_downloader.sources import (
    GgufFileSource,
    HubSource,
    LocalFolderSource,
    ZippedFolderSource,
    locate,
    parse_source,
    zipped_model_folder,
)
from fleet_proto import DownloadPhase, ModelCard
from fleet_store import (
    CARD_TEXT_FILES,
    DEFAULT_REVISION,
    MODELS_BUCKET,
    ST_MODULES,
    ModelManifest,
    ObjectStore,
    file_key,
    load_manifest,
    manifest_key,
    model_card,
    pooling_config_path,
    sha256_file,
    stage_folder,
)

log = logging.getLogger("fleet_downloader.staging")


def _ignore(phase: DownloadPhase, done: int, total: int) -> None:
    pass


def converted_folder(gguf: Path, work_dir: Path) -> Path:
    """Where the HF folder converted from this GGUF is cached: keyed by content and converter version."""
    return work_dir / "converted" / f"{sha256_file(gguf)[:24]}-v{CONVERTER_VERSION}"


def keep_gguf(gguf: Path, folder: Path) -> None:
    """The GGUF beside its conversion, for engines that serve it as it is (llama.cpp): a hard link
    where the file system allows one, else a copy."""
    target = folder / gguf.name
    if target.is_file() and target.stat().st_size == gguf.stat().st_size:
        return
    partial = folder / f".{gguf.name}.part"
    partial.unlink(missing_ok=True)
    try:
        os.link(gguf, partial)
    except OSError:
        shutil.copyfile(gguf, partial)
    os.replace(partial, target)


def unzipped_folder(archive: Path, work_dir: Path) -> Path:
    """Where this archive is extracted: keyed by its content, so a changed archive is extracted anew."""
    return work_dir / "unzipped" / sha256_file(archive)[:24]


def extract_zip(archive: Path, out_dir: Path) -> None:
    """Extract archive into out_dir through a temporary folder renamed into place when complete, so
    out_dir exists only whole."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".extracting"))
    building.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        with zipfile.ZipFile(archive) as zipped:
            zipped_model_folder(archive, zipped.namelist())  # checked again: the file may have changed
            zipped.extractall(building)
        try:
            os.rename(building, out_dir)
        except OSError:
            if not out_dir.is_dir():
                raise
            # a concurrent extraction of the same content finished first: its files are these
    finally:
        shutil.rmtree(building, ignore_errors=True)


def unzipped_model_folder(zipped: ZippedFolderSource, work_dir: Path) -> Path:
    """The model folder of a zipped source, extracted under work_dir once."""
    out_dir = unzipped_folder(zipped.path, work_dir)
    if out_dir.is_dir():
        log.info("using %s, extracted earlier from %s", out_dir, zipped.path)
    else:
        log.info("extracting %s to %s", zipped.path, out_dir)
        extract_zip(zipped.path, out_dir)
    return out_dir / zipped.folder


def local_model_folder(source: str, work_dir: Path, progress: StageProgress = _ignore) -> Path:
    """A local HF folder with the model `source` names.

    A hub repo is downloaded into work_dir/hub/..., a GGUF converted and a zip extracted once (cached
    under work_dir).
    """
    parsed = parse_source(source)
    if isinstance(parsed, HubSource):
        return download_repo(parsed, hub_folder(parsed, Path(work_dir)), progress)
    located = locate(parsed)
    match located:
        case LocalFolderSource(path):
            return path
        case ZippedFolderSource():
            return unzipped_model_folder(located, work_dir)
        case GgufFileSource(path):
            size = path.stat().st_size
            progress(DownloadPhase.CONVERTING, 0, size)
            out_dir = converted_folder(path, work_dir)
            # Renamed into place only when complete, so its presence means a finished conversion.
            if out_dir.is_dir():
                log.info("using %s, converted earlier from %s", out_dir, path)
            else:
                log.info("converting %s to %s", path, out_dir)
                convert_in_child(path, out_dir)
            progress(DownloadPhase.CONVERTING, size, size)
            keep_gguf(path, out_dir)
            return out_dir


def _staged(
    store: ObjectStore, model_id: str, source: str, revision: str, work_dir: Path, report: StageProgress
) -> tuple[ModelManifest, Path | None]:
    """The manifest, and the local folder it was staged from (None when it was already staged)."""
    if store.exists(MODELS_BUCKET, manifest_key(model_id, revision)):  # also validates both
        log.info("%s@%s is already staged", model_id, revision)
        return load_manifest(store, MODELS_BUCKET, model_id, revision), None
    folder = local_model_folder(source, Path(work_dir), report)

    def uploading(done: int, total: int) -> None:
        report(DownloadPhase.UPLOADING, done, total)

    # the upload journal lets a restarted downloader continue where a crash left it
    journal = Path(work_dir) / "uploads"
    return stage_folder(store, MODELS_BUCKET, model_id, revision, folder, source, uploading, journal), folder


def stage_model(
    store: ObjectStore,
    model_id: str,
    source: str,
    revision: str = DEFAULT_REVISION,
    *,
    work_dir: Path,
    progress: StageProgress | None = None,
) -> ModelManifest:
    """The model's manifest in fleet-models, staging it from source first unless it is already there.

    A model is identified by (model_id, revision): an existing manifest is returned as it is,
    whatever source it was staged from.
    """
    return _staged(store, model_id, source, revision, work_dir, progress or _ignore)[0]


def staged_card(store: ObjectStore, manifest: ModelManifest, folder: Path | None = None) -> ModelCard:
    """The model card of a staged model; the small files it reads come from folder, else the store.

    Raises fleet_store.CardError when the model's config.json does not describe a usable model.
    """
    listed = {file.path for file in manifest.files}

    def read(name: str) -> str:
        if folder is not None:
            data = (folder / name).read_bytes()
        else:
            data = store.get_bytes(MODELS_BUCKET, file_key(manifest.model_id, manifest.revision, name))
        return data.decode("utf-8", errors="replace")

    texts = {name: read(name) for name in CARD_TEXT_FILES if name in listed}
    pooling = pooling_config_path(texts[ST_MODULES]) if ST_MODULES in texts else ""
    if pooling in listed:  # a sentence-transformers model: its Pooling module's config
        texts[pooling] = read(pooling)
    return model_card(manifest, texts)


def stage_model_with_card(
    store: ObjectStore,
    model_id: str,
    source: str,
    revision: str = DEFAULT_REVISION,
    *,
    work_dir: Path,
    progress: StageProgress | None = None,
) -> tuple[ModelManifest, ModelCard]:
    """stage_model, then the staged model's card (CardError when it has none; the files stay staged)."""
    manifest, folder = _staged(store, model_id, source, revision, work_dir, progress or _ignore)
    return manifest, staged_card(store, manifest, folder)
