"""Shared by the cross-service tests: a tiny chat model folder and the request that goes with it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny/llama-chat"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_model = load_module(REPO / "services/engine-worker/tests/tiny_model.py")
tiny_tokenizer = load_module(REPO / "services/gateway/tests/tiny_tokenizer.py")


def make_chat_model(folder: Path) -> Path:
    """Tiny llama weights with the ChatML tokenizer (same special ids: 2 ends a turn)."""
    tiny_model.make_tiny_llama(folder)
    tiny_tokenizer.make_tiny_tokenizer_folder(folder)
    return folder
