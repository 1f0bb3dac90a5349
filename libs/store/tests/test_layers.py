"""Which weight files a pipeline shard needs: layer ranges from safetensors indexes and headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import msgspec
import numpy as np
import pytest
from safetensors.numpy import save_file

from fleet_store import ModelManifest, build_manifest, fetch_model
from fleet_store.layers import (
    SafetensorsHeaderError,
    files_for_layers,
    folder_weight_layers,
    layer_ranges,
    read_safetensors_header,
    tensor_layer,
)

pytestmark = pytest.mark.unit

NON_WEIGHT = ["config.json", "tokenizer.json", "tokenizer_config.json"]


def _tensor(seed: int) -> np.ndarray:
    return np.full((4, 8), seed, dtype=np.float32)


def _layer_tensors(layer: int) -> dict[str, np.ndarray]:
    return {
        f"model.layers.{layer}.self_attn.q_proj.weight": _tensor(layer),
        f"model.layers.{layer}.mlp.down_proj.weight": _tensor(layer + 100),
    }


def _write_text_files(folder: Path, num_layers: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": num_layers}))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")


def split_model(folder: Path) -> dict[str, dict[str, np.ndarray]]:
    """A 4-layer model in 3 files with an index: layers 0-1, layers 2-3, then embeddings/norm/head."""
    _write_text_files(folder, 4)
    files = {
        "model-00001-of-00003.safetensors": {**_layer_tensors(0), **_layer_tensors(1)},
        "model-00002-of-00003.safetensors": {**_layer_tensors(2), **_layer_tensors(3)},
        "model-00003-of-00003.safetensors": {
            "model.embed_tokens.weight": _tensor(7),
            "model.norm.weight": _tensor(8),
            "lm_head.weight": _tensor(9),
        },
    }
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, str(folder / name))
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return files


@pytest.mark.parametrize(
    ("name", "layer"),
    [
        ("model.layers.12.mlp.gate_proj.weight", 12),
        ("transformer.h.3.attn.c_attn.weight", 3),
        ("layers.7.attention.wq.weight", 7),
        ("model.language_model.layers.5.self_attn.k_proj.weight", 5),
        ("language_model.model.layers.2.mlp.up_proj.weight", 2),
        ("model.layers.0.mlp.experts.31.w1.weight", 0),
        ("backbone.layers.4.mixer.in_proj.weight", 4),
        ("model.decoder.layers.1.fc1.weight", 1),
        ("model.embed_tokens.weight", None),
        ("model.norm.weight", None),
        ("lm_head.weight", None),
        ("transformer.wte.weight", None),
        # Layers of other stacks are not pipeline layers: every shard fetches them.
        ("model.vision_tower.vision_model.encoder.layers.3.mlp.fc1.weight", None),
        ("model.visual.blocks.0.attn.qkv.weight", None),
        ("model.layers_norm.weight", None),
    ],
)
def test_tensor_layer_parses_layer_numbers(name: str, layer: int | None) -> None:
    assert tensor_layer(name) == layer


def test_layer_ranges_span_layers_and_mark_files_with_shared_tensors() -> None:
    weight_map = {
        "model.layers.0.a": "a.safetensors",
        "model.layers.1.a": "a.safetensors",
        "model.layers.2.a": "b.safetensors",
        "model.layers.5.a": "b.safetensors",  # not contiguous: the span covers 2..5
        "model.embed_tokens.weight": "c.safetensors",
        "model.layers.6.a": "c.safetensors",  # mixed with a shared tensor: every shard needs it
    }
    assert layer_ranges(weight_map) == {
        "a.safetensors": (0, 2),
        "b.safetensors": (2, 6),
        "c.safetensors": None,
    }


def test_split_model_layer_ranges_and_shards(tmp_path: Path) -> None:
    split_model(tmp_path)
    manifest = build_manifest("split", "main", tmp_path, source="test")

    assert manifest.weight_layers == {
        "model-00001-of-00003.safetensors": [0, 2],
        "model-00002-of-00003.safetensors": [2, 4],
        "model-00003-of-00003.safetensors": [],
    }
    always = [*NON_WEIGHT, "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    first = files_for_layers(manifest, 0, 2)
    second = files_for_layers(manifest, 2, 4)
    assert sorted(first) == sorted([*always, "model-00001-of-00003.safetensors"])
    assert sorted(second) == sorted([*always, "model-00002-of-00003.safetensors"])
    assert files_for_layers(manifest, 1, 3) == [file.path for file in manifest.files]
    assert files_for_layers(manifest, 0, 4) == [file.path for file in manifest.files]
    assert sorted(files_for_layers(manifest, 3, 4)) == sorted(second)
    # In the manifest's order, so a fetch reports progress in the same order as a full one.
    order = [file.path for file in manifest.files]
    assert first == [path for path in order if path in first]


@pytest.mark.parametrize(("start", "end"), [(2, 2), (3, 1), (-1, 2)])
def test_files_for_layers_rejects_empty_ranges(tmp_path: Path, start: int, end: int) -> None:
    split_model(tmp_path)
    manifest = build_manifest("split", "main", tmp_path, source="test")
    with pytest.raises(ValueError):
        files_for_layers(manifest, start, end)


def test_single_file_model_reads_the_header(tmp_path: Path) -> None:
    _write_text_files(tmp_path, 2)
    tensors = {"model.embed_tokens.weight": _tensor(1), **_layer_tensors(0), **_layer_tensors(1)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    header = read_safetensors_header(tmp_path / "model.safetensors")
    assert set(header) == {*tensors, "__metadata__"}
    manifest = build_manifest("single", "main", tmp_path, source="test")
    # Embeddings beside the layers: every shard needs the one file.
    assert manifest.weight_layers == {"model.safetensors": []}
    assert files_for_layers(manifest, 1, 2) == [file.path for file in manifest.files]


def test_header_only_files_get_their_layer_range(tmp_path: Path) -> None:
    """Without an index, each file's own header says what it holds (sharded but unindexed)."""
    _write_text_files(tmp_path, 4)
    save_file({**_layer_tensors(2), **_layer_tensors(3)}, str(tmp_path / "model-b.safetensors"))
    save_file({"lm_head.weight": _tensor(0)}, str(tmp_path / "model-c.safetensors"))
    assert folder_weight_layers(tmp_path, ["model-b.safetensors", "model-c.safetensors", "config.json"]) == {
        "model-b.safetensors": [2, 4],
        "model-c.safetensors": [],
    }


def test_header_is_read_without_the_data(tmp_path: Path) -> None:
    header = json.dumps({"layers.0.w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path = tmp_path / "w.safetensors"
    # The data section is absurdly short and the file is otherwise garbage: only the header matters.
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00")
    assert list(read_safetensors_header(path)) == ["layers.0.w"]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x01\x02",
        struct.pack("<Q", 1 << 40) + b"{}",
        struct.pack("<Q", 10) + b"{}",
        struct.pack("<Q", 2) + b"[]",
    ],
)
def test_broken_headers_are_errors_and_such_files_go_to_every_shard(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "broken.safetensors").write_bytes(data)
    with pytest.raises(SafetensorsHeaderError):
        read_safetensors_header(tmp_path / "broken.safetensors")
    save_file(_layer_tensors(0), str(tmp_path / "ok.safetensors"))
    manifest = build_manifest("m", "main", tmp_path, source="test")
    assert manifest.weight_layers == {"ok.safetensors": [0, 1]}
    assert "broken.safetensors" in files_for_layers(manifest, 3, 4)


def test_files_the_index_does_not_name_are_read_from_their_header(tmp_path: Path) -> None:
    split_model(tmp_path)
    everything = {f"model.layers.{n}.w": _tensor(n) for n in range(4)} | {"lm_head.weight": _tensor(5)}
    save_file(everything, str(tmp_path / "consolidated.safetensors"))
    manifest = build_manifest("split", "main", tmp_path, source="test")
    assert manifest.weight_layers["consolidated.safetensors"] == []
    assert manifest.weight_layers["model-00002-of-00003.safetensors"] == [2, 4]


def test_folder_without_safetensors_has_no_map(tmp_path: Path) -> None:
    _write_text_files(tmp_path, 2)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    manifest = build_manifest("gguf", "main", tmp_path, source="test")
    assert manifest.weight_layers == {}
    assert files_for_layers(manifest, 0, 1) == [file.path for file in manifest.files]


def test_old_manifests_without_weight_layers_decode_and_give_every_file(tmp_path: Path) -> None:
    split_model(tmp_path)
    manifest = build_manifest("split", "main", tmp_path, source="test")
    encoded = msgspec.json.decode(msgspec.json.encode(manifest))
    assert "weight_layers" in encoded
    del encoded["weight_layers"]

    old = msgspec.json.decode(json.dumps(encoded).encode(), type=ModelManifest)
    assert old.weight_layers == {}
    assert files_for_layers(old, 0, 2) == [file.path for file in manifest.files]
    # And the new field survives a round trip.
    assert msgspec.json.decode(msgspec.json.encode(manifest), type=ModelManifest) == manifest


def test_fetch_model_rejects_paths_the_manifest_does_not_list(tmp_path: Path) -> None:
    split_model(tmp_path / "src")
    manifest = build_manifest("split", "main", tmp_path / "src", source="test")
    with pytest.raises(ValueError, match="no files"):
        fetch_model(None, "bucket", manifest, tmp_path / "dest", only=["config.json", "missing.bin"])  # type: ignore[arg-type]
    assert not (tmp_path / "dest").exists()
