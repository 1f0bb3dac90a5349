"""Model sources: parse the `source` of a DownloadModel command and find the files it names.

`parse_source` is pure (syntax only); `locate` looks at the local file system and installed packages.
Hub repos have no local files until they are downloaded: staging.local_model_folder fetches them
with fleet_downloader.hub.download_repo.

    pkg:<python-package>        a package that ships weights (one *.gguf, a HF folder, or one *.zip of one)
    gguf:///abs/path/file.gguf  one local GGUF file
    file:///abs/dir             a local Hugging Face folder (config.json + *.safetensors)
    org/name[@revision]         a Hugging Face hub repo (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE apply)
"""

from __future__ import annotations

import importlib.metadata
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath, PureWindowsPath
from urllib.parse import unquote, urlsplit

import msgspec

SOURCE_FORMS = "pkg:<package>, gguf:///abs/file.gguf, file:///abs/dir or org/name[@revision]"

# PEP 508 distribution names.
_PACKAGE = re.compile(r"^([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])$")
# Hugging Face repo ids: one namespace and one name, each letters, digits, '-', '_', '.' (max 96).
_HUB_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


class SourceError(ValueError):
    """A source that is malformed, or names files that are not there."""


class UnsupportedSource(SourceError):
    """A well-formed source this downloader cannot fetch (yet)."""


class PackageSource(msgspec.Struct, frozen=True):
    package: str


class GgufFileSource(msgspec.Struct, frozen=True):
    path: Path


class LocalFolderSource(msgspec.Struct, frozen=True):
    path: Path


class ZippedFolderSource(msgspec.Struct, frozen=True):
    """A HF model folder inside a zip archive; staging extracts it before uploading."""

    path: Path  # the archive
    folder: str = ""  # the model folder's path inside the archive; "" = its top level


class HubSource(msgspec.Struct, frozen=True):
    repo_id: str
    revision: str = ""  # "" = the repo's default branch


Source = PackageSource | GgufFileSource | LocalFolderSource | HubSource
LocalSource = GgufFileSource | LocalFolderSource | ZippedFolderSource


# --- parsing (pure) ----------------------------------------------------------------------------


def _local_path(text: str, scheme: str) -> Path:
    parts = urlsplit(text)
    if parts.netloc not in ("", "localhost"):
        raise SourceError(f"{text!r}: {scheme}:// takes a local path, not a host ({parts.netloc!r})")
    if parts.query or parts.fragment:
        raise SourceError(f"{text!r}: {scheme}:// takes a plain path, without '?' or '#'")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise SourceError(f"{text!r}: {scheme}:// needs an absolute path ({scheme}:///abs/path)")
    if "\0" in path or ".." in PurePosixPath(path).parts:
        raise SourceError(f"{text!r}: the path may not contain '..' or NUL")
    return Path(path)


def _parse_hub(text: str) -> HubSource:
    repo_id, at, revision = text.partition("@")
    if at and not revision:
        raise SourceError(f"{text!r}: empty revision after '@'")
    if any(char.isspace() for char in revision):
        raise SourceError(f"{text!r}: the revision may not contain spaces")
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_HUB_PART.match(part) for part in parts):
        raise SourceError(f"{text!r} is not a model source; expected {SOURCE_FORMS}")
    if any("--" in part or ".." in part or part.endswith(".") for part in parts):
        raise SourceError(f"{text!r}: a hub repo id may not contain '--' or '..', or end with '.'")
    return HubSource(repo_id=repo_id, revision=revision)


def parse_source(text: str) -> Source:
    """The typed source `text` names; SourceError when it is malformed."""
    text = text.strip()
    if not text:
        raise SourceError(f"empty source; expected {SOURCE_FORMS}")
    if text.startswith("pkg:"):
        package = text.removeprefix("pkg:")
        if not _PACKAGE.match(package):
            raise SourceError(f"{text!r}: {package!r} is not a Python package name")
        return PackageSource(package)
    if text.startswith("gguf:"):
        path = _local_path(text, "gguf")
        if path.suffix.lower() != ".gguf":
            raise SourceError(f"{text!r}: a gguf:// source names a .gguf file")
        return GgufFileSource(path)
    if text.startswith("file:"):
        return LocalFolderSource(_local_path(text, "file"))
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", text)
    if scheme:
        raise UnsupportedSource(f"{text!r}: unsupported scheme {scheme.group(1)!r}; expected {SOURCE_FORMS}")
    return _parse_hub(text)


def source_kind(source: Source) -> str:
    """A short word for logs and errors: pkg, gguf, file or hub."""
    match source:
        case PackageSource():
            return "pkg"
        case GgufFileSource():
            return "gguf"
        case LocalFolderSource():
            return "file"
        case HubSource():
            return "hub"


# --- finding the files (reads the file system) -------------------------------------------------


def check_hf_folder(folder: Path) -> LocalFolderSource:
    """folder, if it holds a Hugging Face model: config.json and safetensors weights."""
    if not folder.is_dir():
        raise SourceError(f"{folder} is not a directory")
    if not (folder / "config.json").is_file():
        raise SourceError(f"{folder} has no config.json: not a Hugging Face model folder")
    if not any(folder.glob("*.safetensors")):
        raise SourceError(f"{folder} has no *.safetensors weights")
    return LocalFolderSource(folder)


def check_gguf_file(path: Path) -> GgufFileSource:
    if not path.is_file():
        raise SourceError(f"GGUF file {path} does not exist")
    with path.open("rb") as file:
        if file.read(4) != b"GGUF":
            raise SourceError(f"{path} is not a GGUF file (no GGUF magic)")
    return GgufFileSource(path)


def _escapes(member: str) -> bool:
    """Whether extracting this archive member could write outside the extraction folder."""
    return (
        member.startswith("/")
        or "\\" in member
        or bool(PureWindowsPath(member).drive)
        or ".." in PurePosixPath(member).parts
    )


def zipped_model_folder(archive: Path, members: Iterable[str]) -> str:
    """The HF model folder among an archive's members: its top level, else its one folder that holds
    config.json and *.safetensors ("" for the top level). SourceError for unsafe member paths."""
    names = list(members)
    unsafe = [name for name in names if _escapes(name)]
    if unsafe:
        raise SourceError(f"{archive}: refusing to extract members with absolute or '..' paths: {unsafe[:3]}")
    paths = [PurePosixPath(name) for name in names if not name.endswith("/")]
    models = {path.parent for path in paths if path.name == "config.json"} & {
        path.parent for path in paths if path.suffix == ".safetensors"
    }
    # the top level wins: a sentence-transformers module folder (2_Dense/) may hold weights of its own
    if PurePosixPath(".") in models:
        return ""
    folders = sorted(str(folder) for folder in models if len(folder.parts) == 1)
    if len(folders) > 1:
        listed = ", ".join(folders)
        raise SourceError(f"{archive}: holds {len(folders)} model folders ({listed}); extract one")
    if not folders:
        raise SourceError(
            f"{archive}: holds no model folder (config.json + *.safetensors) at its top level or one below"
        )
    return folders[0]


def check_zipped_folder(archive: Path) -> ZippedFolderSource:
    """archive, if it is a zip holding a Hugging Face model folder that extracts safely."""
    try:
        with zipfile.ZipFile(archive) as zipped:
            members = zipped.namelist()
    except (OSError, zipfile.BadZipFile) as exc:
        raise SourceError(f"{archive} is not a readable zip archive: {exc}") from None
    return ZippedFolderSource(archive, zipped_model_folder(archive, members))


def package_weights(package: str) -> LocalSource:
    """The weights an installed package ships: its single *.gguf file, else its one HF folder, else
    its one *.zip of a HF folder."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise SourceError(f"pkg:{package}: Python package {package!r} is not installed") from None
    files = [Path(str(dist.locate_file(file))) for file in dist.files or ()]
    ggufs = sorted(path for path in files if path.suffix.lower() == ".gguf")
    if len(ggufs) > 1:
        names = ", ".join(path.name for path in ggufs)
        raise SourceError(f"pkg:{package}: ships {len(ggufs)} GGUF files ({names}); name one with gguf://")
    if ggufs:
        return check_gguf_file(ggufs[0])
    folders = sorted(
        {path.parent for path in files if path.name == "config.json"}
        & {path.parent for path in files if path.suffix == ".safetensors"}
    )
    if len(folders) > 1:
        raise SourceError(f"pkg:{package}: ships {len(folders)} model folders; name one with file://")
    if folders:
        return check_hf_folder(folders[0])
    zips = sorted(path for path in files if path.suffix.lower() == ".zip")
    if len(zips) > 1:
        names = ", ".join(path.name for path in zips)
        raise SourceError(
            f"pkg:{package}: ships {len(zips)} zip archives ({names}); extract one and name it with file://"
        )
    if zips:
        return check_zipped_folder(zips[0])
    raise SourceError(f"pkg:{package}: the package ships no *.gguf file, no model folder and no *.zip of one")


def locate(source: Source) -> LocalSource:
    """The local file or folder behind a local source; UnsupportedSource for hub repos.

    A hub repo is downloaded first (fleet_downloader.hub.download_repo, which staging calls).
    """
    match source:
        case PackageSource(package):
            return package_weights(package)
        case GgufFileSource(path):
            return check_gguf_file(path)
        case LocalFolderSource(path):
            return check_hf_folder(path)
        case HubSource(repo_id, revision):
            at = f"@{revision}" if revision else ""
            raise UnsupportedSource(
                f"{repo_id}{at}: a hub repo has no local files to locate; "
                "download it with fleet_downloader.hub.download_repo"
            )
