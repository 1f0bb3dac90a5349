"""MLX prefill -> MLX decode through KV handoff chunks, on real MLX: the decoder's greedy tokens equal
a colocated run's, for a plain llama, a sliding-window llama (RotatingKVCache state) and a
Qwen3-Next-style hybrid (gated-delta-net conv + recurrent state); a corrupt chunk is recomputed."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet_store.handoff import decode_chunk, read_folder
from fleet_store.kv import folder_fingerprint
from fleet_worker.engines.base import EngineRequest, KVExport, KVImport
from fleet_worker.engines.mlx.engine import MlxEngine

from .test_mlx_engine import greedy, request, run
from .tiny_model import make_tiny_hybrid, make_tiny_llama

pytestmark = pytest.mark.unit

PROMPT = [(7 * i) % 480 + 5 for i in range(70)]
MAKERS = {
    "llama": lambda folder: make_tiny_llama(folder, seed=4),
    "sliding": lambda folder: make_tiny_llama(folder, seed=5, sliding_window=16),
    "hybrid": lambda folder: make_tiny_hybrid(folder, seed=6),
}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return MAKERS[request.param](tmp_path_factory.mktemp(f"handoff-{request.param}"))


def export(engine: MlxEngine, folder: Path, prompt: list[int], start_pos: int = 0, **spec):
    prefill = EngineRequest(
        request_id="p",
        prompt_token_ids=tuple(prompt),
        export=KVExport(folder=str(folder), handoff_id="h1", start_pos=start_pos, **spec),
    )
    tokens, final = run(engine, [prefill])
    assert final["p"].finish_reason == "length", final["p"].error
    assert tokens.get("p", []) == []
    return final["p"]


def decode(engine: MlxEngine, folder: Path, prompt: list[int], start_pos: int = 0):
    imported = EngineRequest(
        request_id="d",
        prompt_token_ids=tuple(prompt),
        sampling=greedy(12),
        kv_import=KVImport(folder=str(folder), handoff_id="h1", start_pos=start_pos),
    )
    tokens, final = run(engine, [imported])
    return tokens["d"], final["d"]


def test_decoding_from_a_handoff_matches_colocated_prefill(model_dir: Path, tmp_path: Path) -> None:
    prefiller, decoder = MlxEngine(model_dir, prefill_step_size=16), MlxEngine(model_dir)
    colocated, _ = run(decoder, [request("c", PROMPT, greedy(12))])
    export(prefiller, tmp_path, PROMPT)
    chunks = [decode_chunk(blob) for blob in read_folder(tmp_path)]
    kinds = [chunk.kind for chunk in chunks]
    assert kinds[-1] == "done" and kinds.count("kv") == 5  # 69 rows in chunks of 16
    stateful = model_dir.name.startswith(("handoff-sliding", "handoff-hybrid"))
    assert ("state" in kinds) == stateful
    tokens, final = decode(decoder, tmp_path, PROMPT)
    assert final.handoff is None, final.handoff
    assert tokens == colocated["c"]


def test_a_corrupt_chunk_is_recomputed_locally(model_dir: Path, tmp_path: Path) -> None:
    prefiller, decoder = MlxEngine(model_dir, prefill_step_size=16), MlxEngine(model_dir)
    colocated, _ = run(decoder, [request("c", PROMPT, greedy(12))])
    export(prefiller, tmp_path, PROMPT)
    chunk = tmp_path / "000001.safetensors"
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    tokens, final = decode(decoder, tmp_path, PROMPT)
    assert final.handoff is not None and "sha256" in final.handoff.fallback
    assert tokens == colocated["c"]


def test_only_the_uncached_suffix_is_handed_over(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "model", seed=4)
    fingerprint = folder_fingerprint(model_dir)
    prefix = dict(kv_fingerprint=fingerprint, kv_block_size=32, kv_memory_bytes=16 << 20)
    prefiller = MlxEngine(model_dir, prefill_step_size=16, **prefix)
    decoder = MlxEngine(model_dir, **prefix)
    colocated, _ = run(MlxEngine(model_dir), [request("c", PROMPT, greedy(12))])
    run(decoder, [request("warm", PROMPT[:65], greedy(1))])  # the decoder now holds 2 blocks
    export(prefiller, tmp_path / "h", PROMPT, start_pos=64, wire_dtype="F16")
    chunks = [decode_chunk(blob) for blob in read_folder(tmp_path / "h")]
    assert (chunks[0].token_start, chunks[-1].token_end) == (64, 69)
    assert chunks[0].kv[0][0].dtype == "F16"
    tokens, final = decode(decoder, tmp_path / "h", PROMPT, start_pos=64)
    assert final.handoff is None and final.prefix_cached_tokens == 64
    assert tokens == colocated["c"]
    # the prefill side keeps what it computed: a second handoff of the prompt reuses its blocks
    assert export(prefiller, tmp_path / "again", PROMPT).prefix_cached_tokens == 64


def test_without_a_prefix_cache_a_suffix_is_exported_but_not_imported(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "model", seed=4)
    engine = MlxEngine(model_dir)  # no prefix cache: it cannot hold a prefix to continue from
    # exporting a suffix needs none: the whole prompt is computed, the rows from start_pos sent
    export(engine, tmp_path / "h", PROMPT, start_pos=32)
    chunks = [decode_chunk(blob) for blob in read_folder(tmp_path / "h")]
    assert (chunks[0].token_start, chunks[-1].token_end) == (32, 69)
    # a decoder that cannot take a handoff prefills the prompt itself and says why
    colocated, _ = run(engine, [request("c", PROMPT, greedy(6))])
    unusable = KVImport(folder=str(tmp_path / "none"), handoff_id="h1", start_pos=32)
    imported = EngineRequest(
        request_id="d", prompt_token_ids=tuple(PROMPT), sampling=greedy(6), kv_import=unusable
    )
    tokens, final = run(engine, [imported])
    assert tokens["d"] == colocated["c"] and "prefix cache" in final["d"].handoff.fallback
