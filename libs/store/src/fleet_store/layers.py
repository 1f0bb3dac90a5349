"""Which weight files hold which transformer layers, so a pipeline shard fetches only what it needs.

A weight file's layers come from the tensor names the safetensors index (`*.safetensors.index.json`,
weight_map: tensor name -> file) gives it or, for a file no index names (a single-file model), from
the file's own safetensors header: 8 bytes of little-endian header length, then that much JSON. The
tensor data is never read.

The manifest records, per `*.safetensors` file, `[first_layer, end_layer)` when the file holds only
layer tensors, or `[]` when it holds any tensor outside the layers (embeddings, final norm, lm_head,
a vision tower ...): every shard fetches those (tied embeddings make even the last shard need
embed_tokens, so "needed by every shard" is the simple rule that is always correct). Files the map
does not mention (config, tokenizer, non-safetensors weights) are fetched by every shard too, and a
manifest without the map (older ones, GGUF or .bin models) makes every shard fetch every file.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleet_store.manifest import ModelManifest

SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # what the safetensors format itself allows

# The transformer layer number of a tensor: the first `layers.N.` / `h.N.` / `blocks.N.` reached
# through language-model prefixes only (model., transformer., language_model., ...). Layers of other
# stacks (a vision tower's `vision_tower.encoder.layers.3.`, an encoder's `encoder.layers.3.`) are
# not transformer layers of the pipeline: they count as non-layer tensors that every shard fetches.
_LAYER_NAME = re.compile(
    r"^(?:(?:model|transformer|language_model|text_model|backbone|gpt_neox|decoder)\.)*"
    r"(?:layers|h|blocks)\.(\d+)\."
)

LayerRange = tuple[int, int]
"""[first_layer, end_layer): the layers whose tensors a weight file holds."""


class SafetensorsHeaderError(ValueError):
    """A file that does not start with a valid safetensors header."""


def tensor_layer(name: str) -> int | None:
    """The transformer layer a tensor belongs to, None for tensors outside the layers."""
    match = _LAYER_NAME.match(name)
    return int(match.group(1)) if match else None


def layer_ranges(weight_map: Mapping[str, str]) -> dict[str, LayerRange | None]:
    """Per weight file of weight_map (tensor name -> file): its layer range, or None when the file
    holds any non-layer tensor (or no tensor at all): every shard needs such a file.

    A range spans the lowest to the highest layer in the file, so a file with layers 2 and 5 says
    [2, 6): a shard of layer 3 fetches it needlessly, but never misses a file.
    """
    layers: dict[str, list[int]] = {}
    shared: set[str] = set()
    for name, file in weight_map.items():
        layer = tensor_layer(name)
        if layer is None:
            shared.add(file)
        else:
            layers.setdefault(file, []).append(layer)
    ranges: dict[str, LayerRange | None] = {file: None for file in shared}
    for file, numbers in layers.items():
        if file not in shared:
            ranges[file] = (min(numbers), max(numbers) + 1)
    return ranges


def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> dtype/shape/offsets, plus __metadata__)."""
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) != 8:
            raise SafetensorsHeaderError(f"{path}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise SafetensorsHeaderError(f"{path}: header length {length} is not plausible")
        raw = file.read(length)
    if len(raw) != length:
        raise SafetensorsHeaderError(f"{path}: header is cut short ({len(raw)} of {length} bytes)")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsHeaderError(f"{path}: header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{path}: header is not a JSON object")
    return header


def _index_weight_map(folder: Path, index_path: str) -> dict[str, str]:
    """tensor -> file (relative to folder) from one index; {} when the index is unreadable."""
    try:
        index = json.loads((folder / index_path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        return {}
    parent = PurePosixPath(index_path).parent
    return {
        name: str(parent / file)
        for name, file in weight_map.items()
        if isinstance(name, str) and isinstance(file, str)
    }


def folder_weight_layers(folder: str | Path, paths: Iterable[str]) -> dict[str, list[int]]:
    """The manifest's weight_layers for a model folder whose files are `paths` (relative, posix).

    Every `*.safetensors` file among paths gets `[first, end]` or `[]` (see the module doc); its
    tensor names come from an index that names it, else from its header. A file whose header cannot
    be read is left out, so every shard fetches it.
    """
    folder = Path(folder)
    paths = list(paths)
    weights = [path for path in paths if path.endswith(SAFETENSORS_SUFFIX)]
    if not weights:
        return {}
    weight_map: dict[str, str] = {}
    for index_path in (path for path in paths if path.endswith(INDEX_SUFFIX)):
        weight_map.update(_index_weight_map(folder, index_path))
    named = set(weight_map.values())
    for path in weights:
        if path in named:
            continue
        try:
            header = read_safetensors_header(folder / path)
        except (OSError, SafetensorsHeaderError):
            continue
        weight_map.update({name: path for name in header if name != "__metadata__"})
        named.add(path)
    ranges = layer_ranges(weight_map)
    result: dict[str, list[int]] = {}
    for path in weights:
        if path in named:
            span = ranges.get(path)
            result[path] = [] if span is None else list(span)
    return result


def files_for_layers(manifest: ModelManifest, start_layer: int, end_layer: int) -> list[str]:
    """The manifest's files a shard of layers [start_layer, end_layer) needs, in manifest order.

    Every file the weight map does not call a layer-only weight file (config, tokenizer, files with
    embeddings / norms / lm_head) plus the weight files holding any layer in the range. Without a
    weight map (older manifests, models that are not safetensors) that is every file.
    """
    if start_layer < 0 or end_layer <= start_layer:
        raise ValueError(f"layer range [{start_layer}, {end_layer}) is empty or negative")
    weight_layers = manifest.weight_layers
    needed = []
    for file in manifest.files:
        span = weight_layers.get(file.path)
        if span is None or len(span) != 2 or (span[0] < end_layer and start_layer < span[1]):
            needed.append(file.path)
    return needed
