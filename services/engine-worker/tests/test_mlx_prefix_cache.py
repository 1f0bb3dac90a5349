"""MlxEngine's KV tiers on real MLX: reused prefixes give exactly the cold run's tokens, from memory
(tier 1) or from the local KV folder (where tier-2 blocks arrive); corrupt blocks are recomputed."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet_store.kv import KVFolder, folder_fingerprint, prompt_blocks
from fleet_worker.engines.kv_memory import BlockMemory
from fleet_worker.engines.mlx.engine import MlxEngine
from fleet_worker.engines.mlx.kv import MlxPrefixStore

from .test_mlx_engine import greedy, reference_greedy, request, run
from .tiny_model import make_tiny_llama

pytestmark = pytest.mark.unit

BLOCK = 32
SHARED = [(13 * i) % 500 + 3 for i in range(96)]  # three full blocks
PROMPT_A = [*SHARED, 7, 8, 9, 10]
PROMPT_B = [*SHARED[:64], *range(300, 340)]  # shares two blocks with A


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-prefix"), seed=2)


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    import mlx_lm

    return mlx_lm.load(str(model_dir))


def kv_engine(model_dir: Path, **options) -> MlxEngine:
    return MlxEngine(
        model_dir,
        prefill_step_size=16,
        kv_fingerprint=folder_fingerprint(model_dir),
        kv_block_size=BLOCK,
        **options,
    )


def test_memory_hits_reuse_the_prefix_and_decode_like_a_cold_run(model_dir: Path, reference) -> None:
    engine = kv_engine(model_dir, kv_memory_bytes=64 << 20)
    try:
        cold, final = run(engine, [request("a1", PROMPT_A, greedy(12))])
        assert cold["a1"] == reference_greedy(reference, PROMPT_A, 12)
        assert final["a1"].prefix_cached_tokens == 0
        changes = engine.take_kv_changes()
        assert len(changes.in_memory) == 3 and changes.evicted == () and changes.written == ()

        warm, final = run(engine, [request("a2", PROMPT_A, greedy(12))])
        assert final["a2"].prefix_cached_tokens == 96 and warm["a2"] == cold["a1"]
        partial, final = run(engine, [request("b", PROMPT_B, greedy(12))])
        assert final["b"].prefix_cached_tokens == 64
        assert partial["b"] == reference_greedy(reference, PROMPT_B, 12)
        # a hit and a cold prompt admitted together still decode like their single runs
        both, final = run(
            engine, [request("a3", PROMPT_A, greedy(12)), request("c", list(range(40, 120)), greedy(12))]
        )
        assert both["a3"] == cold["a1"] and both["c"] == reference_greedy(reference, list(range(40, 120)), 12)
    finally:
        engine.close()


def test_blocks_in_the_kv_folder_are_used_by_another_engine(
    model_dir: Path, tmp_path: Path, reference
) -> None:
    first = kv_engine(model_dir, kv_dir=str(tmp_path))
    try:
        cold, _ = run(first, [request("a", PROMPT_A, greedy(12))])
        assert len(first.take_kv_changes().written) == 3  # for the worker to upload
    finally:
        first.close()
    fingerprint = folder_fingerprint(model_dir)
    hashes = [h for h, *_ in prompt_blocks(fingerprint, PROMPT_A, BLOCK)]
    assert KVFolder(tmp_path).leading_hits(fingerprint, hashes) == 3

    second = kv_engine(model_dir, kv_dir=str(tmp_path), kv_memory_bytes=64 << 20)
    try:
        warm, final = run(second, [request("a", PROMPT_A, greedy(12))])
        assert final["a"].prefix_cached_tokens == 96 and warm["a"] == cold["a"]
        # a corrupt block is not used: the prefix stops there and the rest is recomputed
        path = KVFolder(tmp_path).path(fingerprint, prompt_blocks(fingerprint, PROMPT_B, BLOCK)[1][0])
        path.write_bytes(path.read_bytes()[:-8] + b"\0" * 8)
        third = kv_engine(model_dir, kv_dir=str(tmp_path))
        try:
            tokens, final = run(third, [request("b", PROMPT_B, greedy(12))])
        finally:
            third.close()
        assert final["b"].prefix_cached_tokens == 32
        assert tokens["b"] == reference_greedy(reference, PROMPT_B, 12)
    finally:
        second.close()


def test_a_limit_caps_the_reused_prefix_at_whole_blocks(reference) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = reference
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT_A[:-1]]), cache=cache)
    store = MlxPrefixStore(model, "tiny", BLOCK, 64 << 20, None)
    store.store(cache, PROMPT_A)
    assert store.reusable_tokens(PROMPT_A) == 96 and store.reusable_tokens(PROMPT_B) == 64
    assert [store.cache_for(PROMPT_A, mx.float32, limit)[1] for limit in (None, 95, 64, 31, 0)] == [
        96,
        64,
        64,
        0,
        0,
    ]


def test_block_memory_evicts_the_least_recently_used() -> None:
    memory: BlockMemory[str] = BlockMemory(budget_bytes=30)
    for name in "abc":
        memory.put(name, name.upper(), 10)
    assert memory.get("a") == "A"  # a is now the most recently used
    memory.put("d", "D", 10)
    assert "b" not in memory and {"a", "c", "d"} <= {h for h in "acd" if h in memory}
    memory.put("huge", "H", 31)  # larger than the budget: never kept
    assert "huge" not in memory
    assert memory.take_changes() == (["a", "b", "c", "d"], ["b"])
