"""Shared by the cross-service tests: a tiny chat model folder and the request that goes with it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import msgspec

from fleet_bus import Bus
from fleet_proto import TokenChunk

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


def make_chat_model(folder: Path, hidden: int = tiny_model.HIDDEN) -> Path:
    """Tiny llama weights with the ChatML tokenizer (same special ids: 2 ends a turn); vLLM needs
    hidden >= 128 (head size 32)."""
    tiny_model.make_tiny_llama(folder, hidden=hidden)
    tiny_tokenizer.make_tiny_tokenizer_folder(folder)
    return folder


def prompt_ids(model_dir: Path, messages) -> list[int]:
    from fleet_gateway.tokenizer import ChatTokenizer

    return ChatTokenizer.from_folder(model_dir).encode_chat(messages)


class TokenTap:
    """Records every TokenChunk on fleet.tok.> so tests can see the token ids a request produced."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.chunks: dict[str, list[TokenChunk]] = {}

    async def __aenter__(self) -> TokenTap:
        self.bus = await Bus.connect(self.nats_url, "token-tap")

        async def record(msg) -> None:
            chunk = msgspec.json.decode(msg.data, type=TokenChunk)
            self.chunks.setdefault(chunk.request_id, []).append(chunk)

        self.sub = await self.bus.nc.subscribe("fleet.tok.>", cb=record)
        await self.bus.nc.flush()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.sub.unsubscribe()
        await self.bus.close()

    def token_ids(self, request_id: str) -> list[int]:
        return [t for c in sorted(self.chunks[request_id], key=lambda c: c.index) for t in c.token_ids]
