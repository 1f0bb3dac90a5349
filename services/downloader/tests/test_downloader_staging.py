"""stage_model against a real S3 server (SeaweedFS from the root conftest)."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest

from fleet_downloader.convert import ConversionError
from fleet_downloader.defaults import EMBEDDING_MODEL_ID, EMBEDDING_MODEL_SOURCE
from fleet_downloader.sources import SourceError
from fleet_downloader.staging import stage_model, stage_model_with_card, staged_card
from fleet_proto import DownloadPhase, EmbeddingFacts
from fleet_store import MODELS_BUCKET, file_key, load_manifest, manifest_key


def unique_model_id() -> str:
    return f"test-org/tiny-{uuid.uuid4().hex[:8]}"


def test_file_folder_is_staged_with_its_manifest_and_a_second_call_skips(store, tiny_folder, tmp_path):
    model_id = unique_model_id()
    source = f"file://{tiny_folder}"
    reports: list[tuple[DownloadPhase, int, int]] = []

    manifest = stage_model(
        store, model_id, source, work_dir=tmp_path / "work", progress=lambda *r: reports.append(r)
    )

    assert [f.path for f in manifest.files] == ["config.json", "model.safetensors", "tokenizer_config.json"]
    assert manifest.model_id == model_id and manifest.revision == "main" and manifest.source == source
    assert manifest.config == json.loads((tiny_folder / "config.json").read_text())
    assert load_manifest(store, MODELS_BUCKET, model_id, "main") == manifest
    for file in manifest.files:
        stored = store.get_bytes(MODELS_BUCKET, file_key(model_id, "main", file.path))
        assert stored == (tiny_folder / file.path).read_bytes()
    assert reports, "no progress reported"
    assert {phase for phase, _, _ in reports} == {DownloadPhase.UPLOADING}
    assert reports[-1] == (DownloadPhase.UPLOADING, manifest.total_size, manifest.total_size)
    assert not (tmp_path / "work").exists(), "a ready folder needs no work dir"

    # Second call: the manifest is there, so the source is not even read (here it is gone).
    shutil.rmtree(tiny_folder)
    reports.clear()
    again = stage_model(
        store, model_id, source, work_dir=tmp_path / "work", progress=lambda *r: reports.append(r)
    )
    assert again == manifest
    assert reports == []


def test_revision_names_the_key_prefix(store, tiny_folder, tmp_path):
    model_id = unique_model_id()
    manifest = stage_model(store, model_id, f"file://{tiny_folder}", "v2", work_dir=tmp_path)
    assert manifest.revision == "v2"
    assert store.exists(MODELS_BUCKET, manifest_key(model_id, "v2"))
    assert not store.exists(MODELS_BUCKET, manifest_key(model_id, "main"))


@pytest.mark.parametrize(
    ("source", "error", "message"),
    [
        ("gguf:///nonexistent/model.gguf", SourceError, "does not exist"),
        ("org/model@main", SourceError, "cannot reach the hub"),  # HF_ENDPOINT: a closed port (conftest)
        ("not a source", SourceError, "is not a model source"),
    ],
)
def test_a_bad_source_raises_and_stages_nothing(store, tmp_path, source, error, message):
    model_id = unique_model_id()
    with pytest.raises(error, match=message):
        stage_model(store, model_id, source, work_dir=tmp_path)
    assert store.list_keys(MODELS_BUCKET, f"{model_id}/") == []


def test_a_gguf_that_does_not_convert_says_why_and_stages_nothing(store, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 60)  # the magic, then nothing a reader can parse
    model_id = unique_model_id()
    # the conversion runs in a child process: its error comes back as the downloader's own
    with pytest.raises(ConversionError, match=r"converting .*broken\.gguf failed: .+"):
        stage_model(store, model_id, f"gguf://{broken}", work_dir=tmp_path / "work")
    assert store.list_keys(MODELS_BUCKET, f"{model_id}/") == []
    assert not any((tmp_path / "work").rglob("*.building"))  # no half-built folder left behind


def test_an_invalid_model_id_is_rejected_before_any_work(store, tiny_folder, tmp_path):
    with pytest.raises(ValueError, match=r"'\.\.' segment"):
        stage_model(store, "../escape", f"file://{tiny_folder}", work_dir=tmp_path)


def test_the_zipped_embedding_model_is_staged_with_its_modules_and_embedding_card(store, tmp_path):
    model_id = f"{EMBEDDING_MODEL_ID}-{uuid.uuid4().hex[:8]}"
    manifest, card = stage_model_with_card(
        store, model_id, EMBEDDING_MODEL_SOURCE, work_dir=tmp_path / "work"
    )

    paths = {file.path for file in manifest.files}
    assert {"config.json", "model.safetensors", "tokenizer.json", "modules.json"} <= paths
    assert {"1_Pooling/config.json", "sentence_bert_config.json"} <= paths
    assert manifest.source == EMBEDDING_MODEL_SOURCE
    minilm = EmbeddingFacts(dimensions=384, pooling="mean", normalize=True, max_tokens=256)
    assert card.embedding == minilm
    # the card read from the store alone (how a restarted downloader or a worker reads it) agrees
    assert staged_card(store, manifest).embedding == minilm
