"""Sliding-window and hybrid models on Fleet's vLLM engine (CPU build), with Fleet's KV connector.

A llama whose first layer slides over 16 tokens loads with the connector (vLLM then keeps one KV
cache group, the sliding spec promoted to a full one), generates as MLX does, and hands a prefill
over to an MLX decoder: the full layer's rows as they are computed, the sliding layer as the
RotatingKVCache state MLX reads (its last 16 rows). A hybrid Qwen3-Next (gated-delta-net layers)
loads without the connector, which vLLM cannot run with it, and refuses handoffs saying why.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from fleet_proto import SamplingParams
from fleet_store.handoff import assemble, decode_chunk, read_folder
from fleet_store.kv import KVFolder, decode_block, folder_fingerprint, prompt_blocks
from fleet_worker.engine_process import EngineProcess
from fleet_worker.engines.base import EngineOutput, EngineRequest, KVExport, KVImport

from .tiny_model import make_tiny_llama

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

BLOCK = 32
WINDOW = 16
MAX_TOKENS = 8
PROMPT = [(7 * i) % 500 + 3 for i in range(100)]  # 6 windows long: the ring buffer has wrapped


def prompt(seed: int) -> list[int]:
    """A 100-token prompt new to vLLM's prefix cache (each export test prefills its own)."""
    return [(seed * i + 5) % 500 + 3 for i in range(100)]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


class Engine:
    """An engine process and the outputs of each request."""

    def __init__(self, process: EngineProcess) -> None:
        self.process = process
        self.finished: dict[str, asyncio.Future[list[EngineOutput]]] = {}
        self._outputs: dict[str, list[EngineOutput]] = {}
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, engine: str, model_dir: Path, options: dict) -> Engine:
        return cls(await EngineProcess.start(engine, model_dir, options, load_timeout_s=300))

    async def _read(self) -> None:
        async for output in self.process.outputs():
            self._outputs.setdefault(output.request_id, []).append(output)
            if output.finish_reason:
                self.finished[output.request_id].set_result(self._outputs.pop(output.request_id))

    async def run(
        self, request_id: str, prompt: list[int], sampling: SamplingParams | None = None, **handoff
    ) -> list[EngineOutput]:
        self.finished[request_id] = asyncio.get_running_loop().create_future()
        request = EngineRequest(
            request_id=request_id, prompt_token_ids=tuple(prompt), sampling=sampling or greedy(), **handoff
        )
        self.process.submit(request)
        return await asyncio.wait_for(self.finished[request_id], 120)

    async def close(self) -> None:
        await self.process.stop()
        await self._reader


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("sliding"), seed=5, hidden=128, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
async def vllm(model_dir: Path, kv_dir: Path, one_thread: None) -> AsyncIterator[Engine]:
    # a 64-token scheduling budget: the prompt prefills in two steps, its window spans both
    options = {
        "kv_dir": str(kv_dir),
        "kv_block_size": BLOCK,
        "block_size": BLOCK,
        "max_num_batched_tokens": 64,
    }
    engine = await Engine.start("vllm", model_dir, options)
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
async def mlx(model_dir: Path, one_thread: None) -> AsyncIterator[Engine]:
    engine = await Engine.start("mlx", model_dir, {})
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
async def colocated(mlx: Engine) -> list[int]:
    return tokens(await mlx.run("colocated", PROMPT))


async def test_a_sliding_window_model_loads_with_the_connector_and_generates_as_mlx(
    vllm: Engine, colocated: list[int], kv_dir: Path, model_dir: Path
) -> None:
    assert tokens(await vllm.run("alone", PROMPT)) == colocated
    # one KV cache group, every row paged: the sliding layer's prompt blocks are whole too
    fingerprint = folder_fingerprint(model_dir)
    block_hash, _, _, block_tokens = prompt_blocks(fingerprint, PROMPT, BLOCK)[0]
    block = decode_block(KVFolder(kv_dir).read(fingerprint, block_hash), block_hash, block_tokens)
    assert [keys.shape for keys, _ in block.layers] == [(BLOCK, 2, 32)] * 2


async def test_a_vllm_prefill_hands_the_window_over_as_mlx_ring_buffer_state(
    vllm: Engine, mlx: Engine, tmp_path: Path
) -> None:
    ids = prompt(11)
    export = KVExport(folder=str(tmp_path / "w1"), handoff_id="w1")
    outputs = await vllm.run("prefill-w1", ids, export=export)
    assert outputs[-1].finish_reason == "length"
    chunks = [decode_chunk(blob, "w1") for blob in read_folder(export.folder)]
    # the full layer's rows per step; the sliding layer once, as of the prompt's last-but-one token
    assert [(c.kind, c.token_start, c.token_end, sorted(c.kv), sorted(c.states)) for c in chunks] == [
        ("kv", 0, 64, [1], []), ("state", 99, 99, [], [0]), ("kv", 64, 99, [1], []), ("done", 0, 99, [], []),
    ]  # fmt: skip
    state = chunks[1].states[0]
    assert state.cache_class == "RotatingKVCache" and state.meta == ("99", "0", str(WINDOW), str(WINDOW))
    assert [a.shape for a in state.arrays if a is not None] == [(1, 2, WINDOW, 32)] * 2
    decoded = await mlx.run("decoded-w1", ids, kv_import=KVImport(folder=export.folder, handoff_id="w1"))
    assert decoded[-1].handoff is None  # used, no fallback
    assert tokens(decoded) == tokens(await mlx.run("colocated-w1", ids))


async def test_a_first_token_export_sends_the_window_after_the_token(
    vllm: Engine, mlx: Engine, tmp_path: Path
) -> None:
    ids = prompt(13)
    colocated = tokens(await mlx.run("colocated-w2", ids))
    export = KVExport(folder=str(tmp_path / "w2"), handoff_id="w2", sample_first=True, wire_dtype="BF16")
    await vllm.run("prefill-w2", ids, export=export)
    kv = assemble(read_folder(export.folder), "w2", 0)
    chunks = [decode_chunk(blob, "w2") for blob in read_folder(export.folder)]
    assert [c.kind for c in chunks] == ["kv", "first", "state", "kv", "done"]  # in layer order
    assert chunks[1].first_token == colocated[0] and kv.states[0].arrays[0].dtype == "BF16"
    decoded = await mlx.run("decoded-w2", ids, kv_import=KVImport(folder=export.folder, handoff_id="w2"))
    assert decoded[-1].handoff is None and len(tokens(decoded)) == MAX_TOKENS


async def test_vllm_takes_no_sliding_handoff_in_and_prefills_itself(
    vllm: Engine, mlx: Engine, colocated: list[int], tmp_path: Path
) -> None:
    export = KVExport(folder=str(tmp_path / "m1"), handoff_id="m1")
    assert (await mlx.run("prefill-m1", PROMPT, export=export))[-1].finish_reason == "length"
    decoded = await vllm.run("decoded-m1", PROMPT, kv_import=KVImport(folder=export.folder, handoff_id="m1"))
    assert "non-positional state" in decoded[-1].handoff.fallback
    assert tokens(decoded) == colocated


def make_vllm_hybrid(folder: Path) -> Path:
    """A tiny random Qwen3-Next in Hugging Face's layout, as vLLM's CPU build runs it: one MoE
    layer (vLLM's Qwen3-Next needs one), gated-delta-net heads of 128 (its CPU kernel's size), bf16
    (its CPU kernel's only dtype)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_key_heads=1,
        linear_num_value_heads=1, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, full_attention_interval=2, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, mlp_only_layers=[0],
        max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    return folder


async def test_a_hybrid_model_loads_without_the_connector_and_refuses_handoffs(
    tmp_path: Path, one_thread: None
) -> None:
    model = make_vllm_hybrid(tmp_path / "hybrid")
    options = {"kv_dir": str(tmp_path / "kv"), "block_size": BLOCK, "dtype": "bfloat16"}
    engine = await Engine.start("vllm", model, options)
    try:
        served = await engine.run("alone", PROMPT[:40])
        assert served[-1].finish_reason in ("stop", "length") and served[-1].completion_tokens > 0
        export = KVExport(folder=str(tmp_path / "h1"), handoff_id="h1")
        refused = await engine.run("prefill-h1", PROMPT[:40], export=export)
        assert refused[-1].finish_reason == "error" and "hybrid" in refused[-1].error
        imported = KVImport(folder=str(tmp_path / "h2"), handoff_id="h2")
        fallback = await engine.run("decoded-h2", PROMPT[:40], kv_import=imported)
        assert "hybrid" in fallback[-1].handoff.fallback and fallback[-1].completion_tokens > 0
    finally:
        await engine.close()
