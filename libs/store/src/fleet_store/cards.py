"""Model cards: what placement needs to know about a staged model, derived from its manifest.

Pure: everything comes from the manifest (config.json and the file list) and, optionally, the text of
a few small files (`CARD_TEXT_FILES`) that the caller read from the model folder or the store. What
a model's name implies (its publisher's conventions) is computed here too, into the card's facts:
placement reads those, never the name. `embedding_facts_of_folder` alone reads files: those of a
local model folder, for the engines that embed it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from fleet_proto import EmbeddingFacts, ModelCard, NodeKind
from fleet_proto.engines import ENGINE_FACTS, EngineFacts
from fleet_store.manifest import ManifestFile, ModelManifest

TOKENIZER_CONFIG = "tokenizer_config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# a sentence-transformers model's modules, pooling and input length (an embedding model's card)
ST_MODULES = "modules.json"
ST_CONFIG = "sentence_bert_config.json"
CARD_TEXT_FILES: tuple[str, ...] = (TOKENIZER_CONFIG, SAFETENSORS_INDEX, ST_MODULES, ST_CONFIG)
"""Files whose text makes a card more exact; pass those the manifest lists as `files_text`."""

DEFAULT_DTYPE = "bfloat16"
MLX_PUBLISHER = "mlx-community"
MLX_FORMAT = "mlx"  # ModelCard.quantization_format of MLX's packed quantized weights
# mlx-community publishes MLX conversions: they run best on Apple silicon, then on CPUs.
MLX_PUBLISHER_KINDS = (NodeKind.APPLE, NodeKind.CPU)
_UNQUANTIZED = frozenset({"", "bf16", "fp16", "bfloat16", "float16", "fp32", "float32"})

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
_DTYPE_KEYS = ("torch_dtype", "dtype")

# Quantization / format suffixes of a model name ("-4bit", "-bf16", "-MLX" ...), stripped repeatedly.
# GGUF repos name their format and llama.cpp's quant types: "-GGUF", "-Q4_K_M", "-IQ3_XS", "-F16"
_QUANT_SUFFIX = re.compile(
    r"-(?:\d+bit|bf16|fp16|fp32|fp8|f16|f32|mlx|gguf|i?q\d(?:_[a-z0-9]+)*)$", re.IGNORECASE
)
# A hub id: exactly "org/name", each part starting with a letter or digit.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class CardError(ValueError):
    """The manifest does not describe a model placement can use (e.g. config.json has no layer count)."""


# --- names -------------------------------------------------------------------------------------


def publisher_of(model_id: str) -> str:
    """The org part of a hub id ("mlx-community/x" -> "mlx-community"), "" when there is none."""
    return model_id.split("/", 1)[0] if "/" in model_id else ""


def base_model_name(model_id: str) -> str:
    """The name part of a model id without quantization suffixes, so conversions match their original.

    "mlx-community/Llama-3.2-1B-Instruct-4bit" and "meta-llama/Llama-3.2-1B-Instruct" both give
    "Llama-3.2-1B-Instruct". Only quantization / format suffixes go ("-4bit", "-8bit", "-bf16",
    "-fp16", "-fp32", "-fp8", "-mlx", "-GGUF", llama.cpp's "-Q4_K_M" and the like, any case);
    "-Instruct" and the like name different weights.
    """
    name = model_id.rsplit("/", 1)[-1]
    while True:
        stripped = _QUANT_SUFFIX.sub("", name)
        if stripped == name or not stripped:
            return name
        name = stripped


def _base_model(model_id: str, config: Mapping[str, Any]) -> str:
    """config's `_name_or_path` when it is another hub id, else the model id itself; both normalised."""
    name_or_path = config.get("_name_or_path")
    if isinstance(name_or_path, str) and name_or_path != model_id and _HUB_ID.match(name_or_path):
        return base_model_name(name_or_path)
    return base_model_name(model_id)


# --- config ------------------------------------------------------------------------------------


def _layers(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    """Where a field is looked up, first match wins: a multimodal config's text_config, then the top."""
    text = config.get("text_config")
    return (text, config) if isinstance(text, Mapping) else (config,)


def _lookup(layers: tuple[Mapping[str, Any], ...], keys: tuple[str, ...]) -> object:
    for layer in layers:
        for key in keys:
            if layer.get(key) is not None:
                return layer[key]
    return None


def _positive_int(model_id: str, layers: tuple[Mapping[str, Any], ...], keys: tuple[str, ...]) -> int | None:
    value = _lookup(layers, keys)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CardError(f"{model_id}: config.json has {keys[0]}={value!r}, not a positive integer")
    return value


def _required_int(
    model_id: str, layers: tuple[Mapping[str, Any], ...], keys: tuple[str, ...], what: str
) -> int:
    value = _positive_int(model_id, layers, keys)
    if value is None:
        raise CardError(f"{model_id}: config.json has no {what} ({', '.join(keys)})")
    return value


def _dtype(layers: tuple[Mapping[str, Any], ...]) -> str:
    value = _lookup(layers, _DTYPE_KEYS)
    if not isinstance(value, str) or not value:
        return DEFAULT_DTYPE
    return value.removeprefix("torch.")


def _quantization(config: Mapping[str, Any], publisher: str) -> str:
    """ "mlx-<bits>bit" (or "mlx-<mode>") for MLX quantization, the quant_method otherwise, "" for none.

    MLX writes `quantization: {group_size, bits}` (and often the same under `quantization_config`)
    without a quant_method; transformers-style methods (fp8, awq, gptq ...) always name theirs.
    """
    for key in ("quantization", "quantization_config"):
        spec = config.get(key)
        if not isinstance(spec, Mapping) or not spec:
            continue
        method = spec.get("quant_method")
        if isinstance(method, str) and method:
            return method.lower()
        bits = spec.get("bits")
        mlx_style = key == "quantization" or "group_size" in spec or publisher == MLX_PUBLISHER
        if mlx_style and isinstance(bits, int) and not isinstance(bits, bool):
            mode = spec.get("mode")
            if isinstance(mode, str) and mode and mode != "affine":
                return f"mlx-{mode.lower()}"
            return f"mlx-{bits}bit"
    return ""


def _supported_engines(quantization: str, paths: set[str]) -> tuple[str, ...]:
    """Which engines can load the staged weights.

    Staged models are Hugging Face safetensors folders (the downloader converts GGUF first), and
    mlx-lm loads most architectures, so: "mlx" unless the weights use a non-MLX quantization
    (fp8, awq, gptq ... which mlx-lm cannot load); "vllm" unless they are MLX-quantized (vLLM cannot
    load MLX's packed weights); "llamacpp" when the folder also holds one top-level GGUF file (a
    model staged from a GGUF keeps it beside the conversion).
    """
    mlx_quantized = quantization.startswith("mlx-")
    engines = []
    if not quantization or mlx_quantized:
        engines.append("mlx")
    if not mlx_quantized:
        engines.append("vllm")
    if len([p for p in paths if "/" not in p and p.endswith(".gguf")]) == 1:
        engines.append("llamacpp")
    return tuple(engines)


def with_conventions(card: ModelCard) -> ModelCard:
    """`card` with the facts its name and quantization imply, which placement reads instead of the
    name: whether its weights are MLX-quantized (an "mlx-" quantization from anyone, or any
    quantization from mlx-community, whose configs may not say MLX), and the node kinds it runs best
    on (mlx-community's conversions: Apple silicon, then CPUs)."""
    mlx_community = card.publisher == MLX_PUBLISHER or card.model_id.startswith(MLX_PUBLISHER + "/")
    quantization = card.quantization.lower()
    mlx_quantized = quantization.startswith("mlx-") or (mlx_community and quantization not in _UNQUANTIZED)
    return msgspec.structs.replace(
        card,
        quantization_format=MLX_FORMAT if mlx_quantized else "",
        preferred_node_kinds=MLX_PUBLISHER_KINDS if mlx_community else (),
    )


def stand_in_card(model_id: str, storage_bytes: int) -> ModelCard:
    """The card of a model still downloading, known only by its size (layer count unknown: one
    layer), so that placement can size it before its real card is built."""
    return with_conventions(
        ModelCard(
            model_id=model_id,
            architecture="",
            num_layers=1,
            hidden_size=0,
            num_kv_heads=0,
            head_dim=0,
            dtype="",
            storage_bytes=storage_bytes,
            publisher=publisher_of(model_id),
        )
    )


# --- files -------------------------------------------------------------------------------------


def _json_object(model_id: str, name: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CardError(f"{model_id}: {name} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise CardError(f"{model_id}: {name} is not a JSON object")
    return value


def _top_level(files: tuple[ManifestFile, ...], suffix: str) -> list[ManifestFile]:
    return [file for file in files if "/" not in file.path and file.path.endswith(suffix)]


def _storage_bytes(model_id: str, files: tuple[ManifestFile, ...], files_text: Mapping[str, str]) -> int:
    """Bytes of the weights an engine loads: the top-level weight files of one format.

    With the safetensors index's text, the shards its weight_map names (repos may also carry e.g. a
    consolidated.safetensors copy); without it, every *.safetensors file. Folders without
    safetensors count their *.gguf files, else their *.bin files (training_args.bin is no weight).
    """
    by_path = {file.path: file for file in files}
    index_text = files_text.get(SAFETENSORS_INDEX)
    if index_text is not None:
        weight_map = _json_object(model_id, SAFETENSORS_INDEX, index_text).get("weight_map")
        if not isinstance(weight_map, Mapping):
            raise CardError(f"{model_id}: {SAFETENSORS_INDEX} has no weight_map")
        shards = {str(path) for path in weight_map.values()}
        missing = sorted(shards - by_path.keys())
        if missing:
            raise CardError(f"{model_id}: {SAFETENSORS_INDEX} names files the model lacks: {missing}")
        return sum(by_path[path].size for path in shards)
    for suffix in (".safetensors", ".gguf", ".bin"):
        weights = [file for file in _top_level(files, suffix) if file.path != "training_args.bin"]
        if weights:
            return sum(file.size for file in weights)
    raise CardError(f"{model_id}: no weight files (*.safetensors, *.gguf or *.bin)")


def _has_chat_template(model_id: str, paths: set[str], files_text: Mapping[str, str]) -> bool:
    if "chat_template.jinja" in paths:
        return True
    text = files_text.get(TOKENIZER_CONFIG)
    if text is not None:
        return bool(_json_object(model_id, TOKENIZER_CONFIG, text).get("chat_template"))
    # Its text was not given: a tokenizer_config.json may carry a template, so assume it does.
    return TOKENIZER_CONFIG in paths


# --- the card ----------------------------------------------------------------------------------


_POOLED_MODULES = {"Transformer", "Pooling", "Normalize"}
_POOLING_MODES = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_lasttoken", "last"),
)


def embedding_facts(
    model_id: str, config: Mapping[str, Any], texts: Mapping[str, str]
) -> EmbeddingFacts | None:
    """An embedding model's pooling, from its sentence-transformers files (modules.json names a
    Pooling module whose folder's config.json says how; a Normalize module makes unit vectors);
    None when the folder is no sentence-transformers model. `texts` maps those files' paths to
    their text: ST_MODULES, ST_CONFIG and the Pooling module's config (`pooling_config_path`)."""
    if ST_MODULES not in texts:
        return None
    modules = json.loads(texts[ST_MODULES])
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: str(m.get("path", "")) for m in modules}
    if "Pooling" not in kinds:
        raise CardError(f"{model_id}: modules.json names no Pooling module")
    if others := sorted(set(kinds) - _POOLED_MODULES):  # a Dense layer after pooling, say
        raise CardError(
            f"{model_id}: Fleet embeds Transformer -> Pooling -> Normalize; modules.json adds {others}"
        )
    pooling_path = f"{kinds['Pooling']}/config.json"
    if pooling_path not in texts:
        raise CardError(f"{model_id}: the Pooling module has no {pooling_path}")
    pooling = json.loads(texts[pooling_path])
    modes = [name for key, name in _POOLING_MODES if pooling.get(key)]
    if len(modes) != 1:
        raise CardError(
            f"{model_id}: Fleet pools by one of cls, mean or last token; {pooling_path} asks otherwise"
        )
    hidden = config.get("hidden_size")
    dimensions = pooling.get("word_embedding_dimension") or hidden
    st_config = json.loads(texts.get(ST_CONFIG) or "{}")
    positions = config.get("max_position_embeddings")
    max_tokens = st_config.get("max_seq_length") or positions or 512
    if not isinstance(dimensions, int) or not isinstance(max_tokens, int):
        raise CardError(f"{model_id}: no embedding dimension or input length in its config")
    if isinstance(positions, int):
        max_tokens = min(max_tokens, positions)
    return EmbeddingFacts(
        dimensions=dimensions, pooling=modes[0], normalize="Normalize" in kinds, max_tokens=max_tokens
    )


def embeds(facts: EngineFacts, architecture: str) -> bool:
    """Whether an engine embeds models of this architecture (its facts say which it runs)."""
    return facts.embeds and (
        not facts.embedding_architectures or architecture in facts.embedding_architectures
    )


def pooling_config_path(modules_json: str) -> str:
    """The path of the Pooling module's config.json that modules.json names ("" for none)."""
    modules = json.loads(modules_json)
    paths = [str(m.get("path", "")) for m in modules if str(m.get("type", "")).endswith(".Pooling")]
    return f"{paths[0]}/config.json" if paths else ""


def embedding_facts_of_folder(folder: Path) -> EmbeddingFacts | None:
    """`embedding_facts` of a local model folder (an engine's: it has no manifest), from its
    config.json and those of the sentence-transformers files it has; the folder's name is its id."""
    texts = {
        name: (folder / name).read_text() for name in (ST_MODULES, ST_CONFIG) if (folder / name).is_file()
    }
    pooling = pooling_config_path(texts[ST_MODULES]) if ST_MODULES in texts else ""
    if pooling and (folder / pooling).is_file():
        texts[pooling] = (folder / pooling).read_text()
    config = json.loads((folder / "config.json").read_text())
    return embedding_facts(folder.name, config, texts)


def model_card(manifest: ModelManifest, files_text: Mapping[str, str] | None = None) -> ModelCard:
    """The card of a staged model, from its config.json, its file list and optionally files' text.

    files_text maps file paths (of `CARD_TEXT_FILES`) to their contents; without it the chat template
    is inferred from file presence and storage counts every top-level *.safetensors file.
    Raises CardError when config.json is missing or lacks the layer count or another dimension.
    """
    model_id = manifest.model_id
    texts: Mapping[str, str] = files_text or {}
    config = manifest.config
    if not config:
        raise CardError(f"{model_id}: the manifest has no config.json")
    layers = _layers(config)
    num_layers = _required_int(model_id, layers, _LAYER_KEYS, "layer count")
    hidden_size = _required_int(model_id, layers, _HIDDEN_KEYS, "hidden size")
    num_heads = _positive_int(model_id, layers, _HEAD_KEYS)
    num_kv_heads = _positive_int(model_id, layers, _KV_HEAD_KEYS) or num_heads
    head_dim = _positive_int(model_id, layers, ("head_dim",))
    if num_kv_heads is None:
        raise CardError(f"{model_id}: config.json has no attention head count ({', '.join(_HEAD_KEYS)})")
    if head_dim is None:
        if num_heads is None:  # only kv heads given: hidden_size // kv heads would be wrong
            raise CardError(f"{model_id}: config.json has neither head_dim nor num_attention_heads")
        head_dim = hidden_size // num_heads
    architecture = config.get("model_type") or (layers[0].get("model_type") if len(layers) > 1 else None)
    if not isinstance(architecture, str) or not architecture:
        raise CardError(f"{model_id}: config.json has no model_type")
    publisher = publisher_of(model_id)
    quantization = _quantization(config, publisher)
    paths = {file.path for file in manifest.files}
    embedding = embedding_facts(model_id, config, texts)
    engines = _supported_engines(quantization, paths)
    if embedding is not None:  # pooled by the engines that embed
        engines = tuple(name for name in engines if embeds(ENGINE_FACTS[name], architecture))
    card = ModelCard(
        model_id=model_id,
        architecture=architecture,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=_dtype(layers),
        storage_bytes=_storage_bytes(model_id, manifest.files, texts),
        quantization=quantization,
        publisher=publisher,
        base_model=_base_model(model_id, config),
        has_tokenizer="tokenizer.json" in paths,
        has_chat_template=_has_chat_template(model_id, paths, texts),
        supported_engines=engines,
        embedding=embedding,
    )
    return with_conventions(card)
