"""Download a model repo from the Hugging Face hub (or a hub-compatible mirror) into a local folder.

huggingface_hub's snapshot_download does the transfer (into `local_dir`). This module adds:

- the file selection, as exo's downloader does it: config / tokenizer / chat template / generation
  config files and the *.safetensors weights with their index (ALLOW_PATTERNS), never `original/*` or
  `metal/*` (IGNORE_PATTERNS); other weight formats (*.bin, *.pth, *.pt, *.gguf, *.onnx, *.msgpack,
  *.h5) are not in the allow list, so they are never fetched;
- one folder per repo and revision, `<work_dir>/hub/<org>/<name>/<revision>` (hub_folder), pruned to
  the selection and marked complete by a hidden `.fleet-hub.json` (hidden entries are not staged);
- progress as (DOWNLOADING, done bytes, total bytes): the total comes from the repo's file sizes
  (model_info with files_metadata), `done` from polling the bytes under the folder every 0.25 s,
  including huggingface_hub's partial files in `.cache/huggingface/download/*.incomplete` (which
  grow in 10 MiB steps: huggingface_hub writes DOWNLOAD_CHUNK_SIZE pieces);
- cancellation: when the progress callback raises (StagingCancelled: the service is stopping), every
  file in flight stops at its next 10 MiB piece (or its end, if smaller), its partial file is
  deleted, files not yet started are not started, and the callback's exception propagates;
- errors as SourceError naming the repo and the hub's answer.

Environment, read at each call. huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE only once, when
it is imported (huggingface_hub.constants.ENDPOINT and .HF_HUB_OFFLINE, 2.4.0), so this module reads
them itself and passes `endpoint=` / skips the network explicitly:

    HF_ENDPOINT     the hub's URL (default https://huggingface.co)
    HF_TOKEN        bearer token for private and gated repos; unset = anonymous (huggingface_hub's
                    stored login, `hf auth login`, is not used: the service sends what its env says)
    HF_HUB_OFFLINE  1/true/yes/on: no network; only a folder completely downloaded before is used

Resuming: files completed by an earlier, interrupted call are kept and not fetched again (their
`.cache/huggingface/download/<file>.metadata` records the commit). A file cut off mid-way starts over:
huggingface_hub 2.4 downloads each file into a process-unique temporary file and deletes it when the
download fails. Within one call, a connection dropped mid-file is resumed with a Range request from
the last whole 10 MiB piece (up to 5 times). Files of that commit already in the local HF cache
(HF_HUB_CACHE) are copied, not fetched; nothing is written there.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import httpx2
import msgspec
from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import ModelInfo
from huggingface_hub.utils import filter_repo_objects
from huggingface_hub.utils import tqdm as hf_tqdm

from fleet_downloader.progress import StageProgress
from fleet_downloader.sources import HubSource, SourceError
from fleet_proto import DownloadPhase
from fleet_store.manifest import model_file_paths

log = logging.getLogger("fleet_downloader.hub")

ALLOW_PATTERNS = (
    "*.json",  # config, generation config, tokenizer config/vocab, special tokens, safetensors index
    "*.safetensors",
    "*.jinja",  # chat templates
    "*.txt",  # merges.txt, vocab.txt
    "tokenizer.model",
    "tiktoken.model",
    "*.tiktoken",
    "spiece.model",
    "*/spiece.model",
)
IGNORE_PATTERNS = (
    "original/*",  # the publisher's original checkpoint (consolidated.*.pth, params.json)
    "metal/*",  # gpt-oss Metal weights
    "*.bin.index.json",  # the index of PyTorch .bin weights, which are not fetched
)
DEFAULT_REVISION = "main"
MARKER_NAME = ".fleet-hub.json"
LOCK_NAME = ".fleet-hub.lock"
MAX_WORKERS = 4
POLL_INTERVAL_S = 0.25
INFO_TIMEOUT_S = 30.0
LIBRARY_NAME = "fleet-downloader"


class _Snapshot(msgspec.Struct, frozen=True):
    """The marker of a completely downloaded folder."""

    repo_id: str
    revision: str
    commit: str
    files: dict[str, int]
    """Relative path -> size: exactly the selected files of that commit."""


class _Cancelled(Exception):
    """Raised inside huggingface_hub's download threads once the progress callback has failed."""


def _ignore(phase: DownloadPhase, done: int, total: int) -> None:
    pass


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) now, or when huggingface_hub was imported."""
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE") or constants.HF_HUB_OFFLINE


def hub_endpoint() -> str:
    """HF_ENDPOINT now (huggingface_hub's constants.ENDPOINT holds its value at import time)."""
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_token() -> str | bool:
    """HF_TOKEN, or False: no token at all (not huggingface_hub's stored login)."""
    return os.environ.get("HF_TOKEN") or False


def hub_label(source: HubSource) -> str:
    return f"{source.repo_id}@{source.revision}" if source.revision else source.repo_id


def hub_folder(source: HubSource, work_dir: Path) -> Path:
    """Where download_repo keeps source's files: <work_dir>/hub/<org>/<name>/<revision, one segment>."""
    return Path(work_dir) / "hub" / source.repo_id / quote(source.revision or DEFAULT_REVISION, safe="")


def select_files(paths: list[str]) -> list[str]:
    """The repo files Fleet stages: ALLOW_PATTERNS less IGNORE_PATTERNS, as snapshot_download filters."""
    return list(
        filter_repo_objects(paths, allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=list(IGNORE_PATTERNS))
    )


# --- errors ------------------------------------------------------------------------------------


def _http_reason(exc: HfHubHTTPError) -> str:
    response = exc.response
    reason = f"HTTP {response.status_code} {response.reason_phrase}".rstrip()
    return f"{reason}: {exc.server_message}" if exc.server_message else reason


def _offline_error(label: str, dest: Path, detail: str) -> SourceError:
    return SourceError(
        f"{label}: HF_HUB_OFFLINE is set (offline mode) and {detail} in {dest}; "
        "unset HF_HUB_OFFLINE to download it"
    )


def _source_error(exc: BaseException, label: str, revision: str, dest: Path) -> SourceError | None:
    """The SourceError that explains exc, or None when exc is not about the hub."""
    where = hub_endpoint()
    match exc:
        case GatedRepoError():
            token = "HF_TOKEN was refused" if os.environ.get("HF_TOKEN") else "no HF_TOKEN is set"
            return SourceError(
                f"{label}: gated repo on {where}, {token} ({_http_reason(exc)}); "
                "accept its terms on the hub with an account whose token is in HF_TOKEN"
            )
        case RevisionNotFoundError():
            return SourceError(f"{label}: revision {revision!r} not found on {where} ({_http_reason(exc)})")
        case RepositoryNotFoundError():
            return SourceError(
                f"{label}: repository not found on {where} ({_http_reason(exc)}); "
                "a private repo needs HF_TOKEN"
            )
        case RemoteEntryNotFoundError():
            return SourceError(f"{label}: a file the repo lists is missing on {where} ({_http_reason(exc)})")
        case HfHubHTTPError():
            return SourceError(f"{label}: the hub at {where} answered {_http_reason(exc)}")
        case OfflineModeIsEnabled():
            return _offline_error(label, dest, "nothing can be fetched")
        case LocalEntryNotFoundError():
            return SourceError(f"{label}: could not download from {where}: {str(exc).splitlines()[0]}")
        case httpx2.TransportError():
            return SourceError(f"{label}: cannot reach the hub at {where}: {type(exc).__name__}: {exc}")
    return None


# --- the folder --------------------------------------------------------------------------------


@contextmanager
def _locked(dest: Path) -> Iterator[None]:
    """One download into dest at a time, across threads and processes."""
    with (dest / LOCK_NAME).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_marker(dest: Path) -> _Snapshot | None:
    try:
        return msgspec.json.decode((dest / MARKER_NAME).read_bytes(), type=_Snapshot)
    except (FileNotFoundError, msgspec.DecodeError):
        return None


def _write_marker(dest: Path, snapshot: _Snapshot) -> None:
    tmp = dest / f"{MARKER_NAME}.tmp"
    tmp.write_bytes(msgspec.json.encode(snapshot))
    tmp.replace(dest / MARKER_NAME)


def _missing(dest: Path, files: dict[str, int]) -> list[str]:
    """The files that are not in dest with their expected size."""
    missing = []
    for path, size in sorted(files.items()):
        local = dest / path
        if not local.is_file() or local.stat().st_size != size:
            missing.append(path)
    return missing


def _size_on_disk(path: Path) -> int:
    return path.stat().st_size if path.is_file() else -1


def _prune(dest: Path, keep: set[str]) -> None:
    """Delete the (non-hidden) files that are not in keep: left from another commit or selection."""
    for path in model_file_paths(dest):
        if path not in keep:
            log.info("removing %s from %s: not part of the snapshot", path, dest)
            (dest / path).unlink()
    for root, dirs, _ in os.walk(dest, topdown=False):
        for name in dirs:
            folder = Path(root) / name
            if not name.startswith(".") and not any(folder.iterdir()):
                folder.rmdir()


def _bytes_present(dest: Path, files: dict[str, int | None]) -> int:
    """Bytes of the selected files under dest, finished or partial."""
    done = 0
    for path, size in files.items():
        try:
            present = (dest / path).stat().st_size
        except OSError:
            continue
        done += present if size is None else min(present, size)
    downloads = dest / ".cache" / "huggingface" / "download"
    if downloads.is_dir():
        for partial in downloads.rglob("*.incomplete"):
            try:
                done += partial.stat().st_size
            except OSError:  # renamed into place meanwhile
                pass
    return done


# --- download ----------------------------------------------------------------------------------


def _repo_info(source: HubSource, label: str, dest: Path) -> ModelInfo:
    api = HfApi(endpoint=hub_endpoint(), token=hub_token(), library_name=LIBRARY_NAME)
    try:
        info = api.model_info(
            source.repo_id, revision=source.revision or None, files_metadata=True, timeout=INFO_TIMEOUT_S
        )
    except Exception as exc:
        error = _source_error(exc, label, source.revision or DEFAULT_REVISION, dest)
        if error is None:
            raise
        raise error from exc
    if not info.sha or info.siblings is None:
        raise SourceError(f"{label}: the hub at {hub_endpoint()} sent no commit or file list for the repo")
    return info


def _selection(info: ModelInfo, label: str) -> dict[str, int | None]:
    """Selected path -> size (None: the hub did not say); SourceError when there is nothing to stage."""
    siblings = info.siblings or []
    sizes = {s.rfilename: s.size if s.size is not None else (s.lfs.size if s.lfs else None) for s in siblings}
    selected = {path: sizes[path] for path in select_files(list(sizes))}
    if "config.json" not in selected:
        raise SourceError(f"{label}: the repo has no config.json: not a Hugging Face model repo")
    if not any(path.endswith(".safetensors") for path in selected):
        formats = sorted(
            {Path(path).suffix for path in sizes if Path(path).suffix in (".bin", ".pth", ".gguf")}
        )
        hint = f" (it has {', '.join(formats)} files)" if formats else ""
        if ".gguf" in formats:
            hint += "; stage a GGUF file with a gguf:// source"
        raise SourceError(f"{label}: the repo has no *.safetensors weights{hint}")
    return selected


def _cancellable_tqdm(cancelled: threading.Event) -> type[hf_tqdm]:
    """A progress bar class for snapshot_download whose update() stops the download once cancelled.

    huggingface_hub calls update() for every piece it writes (10 MiB, or a file's last bytes), in the
    thread that downloads it; raising there ends that file's download and, through hf_thread_map,
    cancels the files not yet started.
    """

    class CancellableTqdm(hf_tqdm):
        def update(self, n: float | None = 1) -> bool | None:
            if cancelled.is_set():
                raise _Cancelled("download cancelled")
            return super().update(n)

    return CancellableTqdm


def _fetch(
    source: HubSource, commit: str, dest: Path, files: dict[str, int | None], progress: StageProgress
) -> None:
    """snapshot_download of commit into dest, reporting progress from a polling thread."""
    total = sum(size or 0 for size in files.values())
    progress(DownloadPhase.DOWNLOADING, min(_bytes_present(dest, files), total), total)
    stop, cancelled = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def poll() -> None:
        while not stop.wait(POLL_INTERVAL_S):
            try:
                progress(DownloadPhase.DOWNLOADING, min(_bytes_present(dest, files), total), total)
            except BaseException as exc:  # the callback's way to cancel (StagingCancelled)
                failure.append(exc)
                cancelled.set()
                return

    poller = threading.Thread(target=poll, name=f"hub-progress-{source.repo_id}", daemon=True)
    poller.start()
    try:
        snapshot_download(
            source.repo_id,
            revision=commit,  # exactly the commit that was sized and selected
            local_dir=dest,
            endpoint=hub_endpoint(),
            token=hub_token(),
            allow_patterns=list(ALLOW_PATTERNS),
            ignore_patterns=list(IGNORE_PATTERNS),
            max_workers=MAX_WORKERS,
            library_name=LIBRARY_NAME,
            tqdm_class=_cancellable_tqdm(cancelled),
        )
    except Exception as exc:
        if failure:
            raise failure[0] from None
        error = _source_error(exc, hub_label(source), commit, dest)
        if error is None:
            raise
        raise error from exc
    finally:
        stop.set()
        poller.join()
    if failure:
        raise failure[0]


def download_repo(source: HubSource, dest: Path, progress: StageProgress = _ignore) -> Path:
    """dest, holding the selected files of the hub repo `source` names; downloads what is missing.

    Reports (DOWNLOADING, done, total) as files arrive, ending with (DOWNLOADING, total, total).
    SourceError for a missing repo or revision, a gated repo without an accepted token, an unreachable
    hub, a repo without config.json or safetensors weights, and offline mode without a complete copy.
    """
    dest = Path(dest)
    label = hub_label(source)
    if hub_offline():
        snapshot = _read_marker(dest)
        if snapshot is None:
            raise _offline_error(label, dest, "the repo was never completely downloaded")
        missing = _missing(dest, snapshot.files)
        if missing:
            raise _offline_error(label, dest, f"{len(missing)} downloaded file(s) are missing or changed")
        total = sum(snapshot.files.values())
        log.info("offline: using %s (commit %s) from %s", label, snapshot.commit, dest)
        progress(DownloadPhase.DOWNLOADING, total, total)
        return dest

    info = _repo_info(source, label, dest)
    assert info.sha is not None
    selected = _selection(info, label)
    dest.mkdir(parents=True, exist_ok=True)
    with _locked(dest):
        previous = _read_marker(dest)
        if previous is not None and previous.commit != info.sha:
            (dest / MARKER_NAME).unlink()  # an interrupted update must not pass for complete
        log.info("downloading %s (commit %s, %d files) into %s", label, info.sha, len(selected), dest)
        _fetch(source, info.sha, dest, selected, progress)
        _prune(dest, set(selected))
        files = {
            path: _size_on_disk(dest / path) if size is None else size for path, size in selected.items()
        }
        missing = _missing(dest, files)
        if missing:
            raise SourceError(
                f"{label}: after the download, {', '.join(missing[:3])} are missing or truncated"
            )
        _write_marker(dest, _Snapshot(source.repo_id, source.revision, info.sha, files))
    total = sum(files.values())
    progress(DownloadPhase.DOWNLOADING, total, total)
    return dest
