"""Models the gateway can serve: tokenizers fetched from each model's manifest in object storage.

Only the small text files a tokenizer needs are fetched (never the weights), once per model, into
the gateway's cache dir.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from fleet_gateway.tokenizer import ChatTokenizer
from fleet_store import DEFAULT_REVISION, MODELS_BUCKET, ObjectNotFound, ObjectStore, load_manifest
from fleet_store.kv import manifest_fingerprint
from fleet_store.manifest import file_key

# What the gateway needs of a model: its tokenizer, chat template (a separate file in newer
# transformers' folders), EOS ids and context length.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "config.json",
)
DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    tokenizer: ChatTokenizer
    max_model_len: int
    kv_fingerprint: str  # seeds the prompt's KV block hashes (fleet_store.kv)


def max_model_len(config: dict) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return DEFAULT_MAX_MODEL_LEN


class ModelCatalog:
    def __init__(self, store: ObjectStore, cache_dir: Path) -> None:
        self._store = store
        self._cache_dir = cache_dir
        self._models: dict[str, ModelInfo] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, model_id: str) -> ModelInfo:
        """The model's tokenizer and limits; ObjectNotFound when the model is not staged."""
        if model_id in self._models:
            return self._models[model_id]
        async with self._locks.setdefault(model_id, asyncio.Lock()):
            if model_id not in self._models:
                self._models[model_id] = await asyncio.to_thread(self._load, model_id)
        return self._models[model_id]

    def _load(self, model_id: str) -> ModelInfo:
        manifest = load_manifest(self._store, MODELS_BUCKET, model_id, DEFAULT_REVISION)
        folder = self._cache_dir / model_id / DEFAULT_REVISION
        present = {f.path for f in manifest.files}
        for name in TOKENIZER_FILES:
            if name in present:
                self._store.get_file(MODELS_BUCKET, file_key(model_id, DEFAULT_REVISION, name), folder / name)
        if "tokenizer.json" not in present:
            raise ObjectNotFound(MODELS_BUCKET, file_key(model_id, DEFAULT_REVISION, "tokenizer.json"))
        config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
        tokenizer = ChatTokenizer.from_folder(folder)
        return ModelInfo(model_id, tokenizer, max_model_len(config), manifest_fingerprint(manifest))
