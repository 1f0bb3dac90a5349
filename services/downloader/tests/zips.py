"""Zip archives and installed packages for the tests of zipped model folders."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest


def zip_of(archive: Path, members: dict[str, bytes]) -> Path:
    """A zip at archive with these members, written as given (unsafe names included)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive, "w") as zipped:
        for name, data in members.items():
            zipped.writestr(name, data)
    return archive


def model_members(folder: str = "") -> dict[str, bytes]:
    """A sentence-transformers folder's files as zip members, under `folder` ("" = top level)."""
    prefix = f"{folder}/" if folder else ""
    return {
        f"{prefix}config.json": b'{"model_type": "bert"}',
        f"{prefix}model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
        f"{prefix}modules.json": b"[]",
        f"{prefix}1_Pooling/config.json": b'{"word_embedding_dimension": 8}',
    }


def fake_package(site: Path, name: str, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed distribution `name` whose RECORD lists `files` (written under site)."""
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "RECORD").write_text("".join(f"{path},,\n" for path in files))
    for path, data in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
