"""Fixtures of the downloader's tests: an S3 client on the session's SeaweedFS, a tiny HF folder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from fleet_local.servers import ServerHandle
from fleet_store import ObjectStore, ensure_buckets

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "rope_theta": 10000.0,
}


def write_tiny_folder(folder: Path, seed: int = 0) -> Path:
    """A small Hugging Face folder: config, safetensors weights (~300 KB), tokenizer config."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((256, 64), dtype=np.float32)}
    for layer in range(2):
        tensors[f"model.layers.{layer}.mlp.up_proj.weight"] = rng.standard_normal((128, 64), dtype=np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    return write_tiny_folder(tmp_path / "tiny-model")


@pytest.fixture
def store(s3_server: ServerHandle) -> Iterator[ObjectStore]:
    store = ObjectStore(s3_server.url)
    ensure_buckets(store)
    yield store
    store.close()
