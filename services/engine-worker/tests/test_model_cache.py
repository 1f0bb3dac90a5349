"""ModelCache against a real S3 server: LRU eviction, pins, shared fetches, shard fetches, repair."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from fleet_store import ModelManifest, ObjectNotFound, ObjectStore, file_key, stage_folder
from fleet_store.layers import files_for_layers
from fleet_store.manifest import local_file_matches, model_file_paths
from fleet_worker.model_cache import (
    COMPLETE_MARKER,
    LAST_USED_MARKER,
    PARTIAL_MARKER,
    ModelCache,
    ModelCacheFull,
    ModelInUse,
    ModelTooLarge,
)

REV = "main"


class CountingStore:
    """An ObjectStore that counts get_file calls per key and can hold them at a gate."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store
        self.gets: Counter[str] = Counter()
        self.started = threading.Event()
        self.gate: threading.Event | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def get_file(
        self, bucket: str, key: str, path: Any, progress: Any = None, expected_sha256: Any = None
    ) -> Any:
        self.gets[key] += 1
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        return self._store.get_file(bucket, key, path, progress=progress, expected_sha256=expected_sha256)


def _layer(n: int) -> dict[str, np.ndarray]:
    return {f"model.layers.{n}.mlp.weight": np.full((32, 32), n, dtype=np.float32)}


def make_model(folder: Path) -> None:
    """4 layers in 3 safetensors files (layers 0-1, 2-3, shared tensors) + index, config, tokenizer."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4}))
    (folder / "tokenizer.json").write_text(json.dumps({"id": uuid.uuid4().hex}))  # distinct, same size
    files = {
        "model-00001-of-00003.safetensors": {**_layer(0), **_layer(1)},
        "model-00002-of-00003.safetensors": {**_layer(2), **_layer(3)},
        "model-00003-of-00003.safetensors": {"model.embed_tokens.weight": np.ones((32, 32), np.float32)},
    }
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, str(folder / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.fixture
def models(store: ObjectStore, bucket: str, tmp_path: Path) -> dict[str, ModelManifest]:
    staged = {}
    for name in ("org/alpha", "org/beta", "gamma"):
        folder = tmp_path / "src" / name
        make_model(folder)
        staged[name] = stage_folder(store, bucket, name, REV, folder, source="test")
    sizes = {m.total_size for m in staged.values()}
    assert len(sizes) == 1  # same size, so "fits two" is exact
    return staged


def _cache(tmp_path: Path, bucket: str, limit: int, changes: list[int] | None = None) -> ModelCache:
    async def changed() -> None:
        if changes is not None:
            changes.append(1)

    return ModelCache(tmp_path / "models", limit, bucket=bucket, on_change=changed)


def _present(cache: ModelCache, manifest: ModelManifest) -> bool:
    return (cache.folder(manifest.model_id, manifest.revision) / COMPLETE_MARKER).is_file()


def _keys(manifest: ModelManifest, paths: list[str] | None = None) -> set[str]:
    paths = [f.path for f in manifest.files] if paths is None else paths
    return {file_key(manifest.model_id, manifest.revision, path) for path in paths}


async def test_ensure_evicts_the_least_recently_used_model(
    store: ObjectStore, bucket: str, models: dict[str, ModelManifest], tmp_path: Path
) -> None:
    alpha, beta, gamma = models.values()
    changes: list[int] = []
    cache = _cache(tmp_path, bucket, limit=int(alpha.total_size * 2.5), changes=changes)

    folder = await cache.ensure(alpha, store)
    assert folder == tmp_path / "models" / "org" / "alpha" / REV
    assert all(local_file_matches(folder / f.path, f) for f in alpha.files)
    await cache.ensure(beta, store)
    cache.touch(alpha.model_id, REV)  # alpha used again: beta is now the least recently used
    assert cache.usage_bytes() == 2 * alpha.total_size
    assert [m.model_id for m in cache.models()] == ["org/beta", "org/alpha"]

    await cache.ensure(gamma, store)

    assert _present(cache, alpha) and _present(cache, gamma)
    assert not cache.folder(beta.model_id, REV).exists()
    assert cache.usage_bytes() == 2 * alpha.total_size <= cache.limit_bytes
    assert cache.complete_models() == ("gamma", "org/alpha")
    assert len(changes) == 4  # alpha, beta, gamma complete; beta evicted

    # A restarted worker keeps the order (marker mtimes): alpha is now the one to go.
    restarted = _cache(tmp_path, bucket, limit=cache.limit_bytes)
    assert [m.model_id for m in restarted.models()] == ["org/alpha", "gamma"]
    await restarted.ensure(beta, store)
    assert not cache.folder(alpha.model_id, REV).exists()
    assert (tmp_path / "models" / "org").is_dir() and _present(restarted, beta)


async def test_pinned_models_are_never_evicted(
    store: ObjectStore, bucket: str, models: dict[str, ModelManifest], tmp_path: Path
) -> None:
    alpha, beta, gamma = models.values()
    cache = _cache(tmp_path, bucket, limit=int(alpha.total_size * 2.5))
    for manifest in (alpha, beta):
        cache.pin(manifest.model_id, REV)
        await cache.ensure(manifest, store)

    with pytest.raises(ModelCacheFull, match="in use: org/alpha@main, org/beta@main"):
        await cache.ensure(gamma, store)
    assert _present(cache, alpha) and _present(cache, beta)
    assert not cache.folder(gamma.model_id, REV).exists()  # no empty folder left behind
    with pytest.raises(ModelInUse):
        await cache.evict(alpha.model_id, REV)

    cache.pin(alpha.model_id, REV)  # counted: two instances use alpha
    cache.unpin(alpha.model_id, REV)
    assert cache.pinned(alpha.model_id, REV) == 1
    cache.unpin(beta.model_id, REV)
    await cache.ensure(gamma, store)
    assert _present(cache, alpha) and _present(cache, gamma) and not cache.folder(beta.model_id, REV).exists()


async def test_a_model_over_the_limit_is_a_clear_error(
    store: ObjectStore, bucket: str, models: dict[str, ModelManifest], tmp_path: Path
) -> None:
    alpha = models["org/alpha"]
    cache = _cache(tmp_path, bucket, limit=alpha.total_size - 1)
    with pytest.raises(ModelTooLarge, match="FLEET_MODEL_CACHE_BYTES"):
        await cache.ensure(alpha, store)
    assert cache.usage_bytes() == 0
    # A shard's files may fit where the whole model does not.
    shard = files_for_layers(alpha, 0, 2)
    await cache.ensure(alpha, store, paths=shard)
    assert cache.usage_bytes() < alpha.total_size


async def test_concurrent_ensures_share_one_download(
    store: ObjectStore, bucket: str, models: dict[str, ModelManifest], tmp_path: Path
) -> None:
    alpha = models["org/alpha"]
    counting = CountingStore(store)
    cache = _cache(tmp_path, bucket, limit=0)
    seen: list[list[tuple[int, int]]] = [[], []]

    first, second = await asyncio.gather(
        cache.ensure(alpha, counting, progress=lambda d, t: seen[0].append((d, t))),  # type: ignore[arg-type]
        cache.ensure(alpha, counting, progress=lambda d, t: seen[1].append((d, t))),  # type: ignore[arg-type]
    )

    assert first == second
    assert counting.gets == Counter(dict.fromkeys(_keys(alpha), 1))
    for reports in seen:
        assert reports and reports[-1] == (alpha.total_size, alpha.total_size)
    # A later ensure verifies and downloads nothing.
    await cache.ensure(alpha, counting)  # type: ignore[arg-type]
    assert sum(counting.gets.values()) == len(alpha.files)


async def test_a_cancelled_caller_leaves_the_shared_fetch_running(
    store: ObjectStore, bucket: str, models: dict[str, ModelManifest], tmp_path: Path
) -> None:
    alpha = models["org/alpha"]
    counting = CountingStore(store)
    counting.gate = threading.Event()
    cache = _cache(tmp_path, bucket, limit=0)

    leaving = asyncio.create_task(cache.ensure(alpha, counting))  # type: ignore[arg-type]
    staying = asyncio.create_task(cache.ensure(alpha, counting))  # type: ignore[arg-type]
    assert await asyncio.to_thread(counting.started.wait, 10)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    counting.gate.set()

    assert await staying == cache.folder(alpha.model_id, REV)
    assert _present(cache, alpha)
    assert counting.gets == Counter(dict.fromkeys(_keys(alpha), 1))


async def test_a_fetch_nobody_waits_for_stops_and_resumes_later(
    store: ObjectStore, bucket: str, models: dict[str, ModelManifest], tmp_path: Path
) -> None:
    alpha = models["org/alpha"]
    counting = CountingStore(store)
    counting.gate = threading.Event()
    cache = _cache(tmp_path, bucket, limit=0)

    only = asyncio.create_task(cache.ensure(alpha, counting))  # type: ignore[arg-type]
    assert await asyncio.to_thread(counting.started.wait, 10)
    only.cancel()
    with pytest.raises(asyncio.CancelledError):
        await only
    counting.gate.set()
    await cache.close()  # waits for the stopped fetch
    assert sum(counting.gets.values()) == 1  # stopped in its first file
    assert not _present(cache, alpha)

    await cache.ensure(alpha, counting)  # type: ignore[arg-type]
    assert _present(cache, alpha)
    assert not list(cache.folder(alpha.model_id, REV).rglob("*.part"))


async def test_shard_fetch_downloads_only_the_shards_files(
    store: ObjectStore, bucket: str, models: dict[str, ModelManifest], tmp_path: Path
) -> None:
    alpha = models["org/alpha"]
    counting = CountingStore(store)
    changes: list[int] = []
    cache = _cache(tmp_path, bucket, limit=0, changes=changes)
    shard = files_for_layers(alpha, 2, 4)
    assert "model-00001-of-00003.safetensors" not in shard

    folder = await cache.ensure(alpha, counting, paths=shard)  # type: ignore[arg-type]

    assert set(counting.gets) == _keys(alpha, shard)
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == sorted(shard)
    assert (folder / PARTIAL_MARKER).is_file() and (folder / LAST_USED_MARKER).is_file()
    assert not (folder / COMPLETE_MARKER).exists()
    assert cache.complete_models() == () and changes == []

    # The whole model later: only the missing file moves, and now it is complete.
    counting.gets.clear()
    await cache.ensure(alpha, counting)  # type: ignore[arg-type]
    assert set(counting.gets) == _keys(alpha, ["model-00001-of-00003.safetensors"])
    assert (folder / COMPLETE_MARKER).is_file() and not (folder / PARTIAL_MARKER).exists()
    assert cache.complete_models() == ("org/alpha",) and changes == [1]

    # A shard of a complete model keeps it complete.
    await cache.ensure(alpha, counting, paths=files_for_layers(alpha, 0, 2))  # type: ignore[arg-type]
    assert (folder / COMPLETE_MARKER).is_file() and not (folder / PARTIAL_MARKER).exists()
    with pytest.raises(ValueError, match="no files"):
        await cache.ensure(alpha, counting, paths=["nope.bin"])  # type: ignore[arg-type]


async def test_a_corrupted_file_is_fetched_again(
    store: ObjectStore, bucket: str, models: dict[str, ModelManifest], tmp_path: Path
) -> None:
    alpha = models["org/alpha"]
    counting = CountingStore(store)
    cache = _cache(tmp_path, bucket, limit=0)
    folder = await cache.ensure(alpha, counting)  # type: ignore[arg-type]
    weight = folder / "model-00002-of-00003.safetensors"
    data = bytearray(weight.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes
    weight.write_bytes(bytes(data))
    (folder / "stale.safetensors").write_bytes(b"no longer in the manifest")
    counting.gets.clear()

    await cache.ensure(alpha, counting)  # type: ignore[arg-type]

    assert set(counting.gets) == _keys(alpha, ["model-00002-of-00003.safetensors"])
    assert all(local_file_matches(folder / f.path, f) for f in alpha.files)
    assert not (folder / "stale.safetensors").exists()


async def test_a_failed_repair_unmarks_the_model(
    store: ObjectStore, bucket: str, models: dict[str, ModelManifest], tmp_path: Path
) -> None:
    alpha = models["org/alpha"]
    changes: list[int] = []
    cache = _cache(tmp_path, bucket, limit=0, changes=changes)
    folder = await cache.ensure(alpha, store)
    (folder / "config.json").write_text("{}")
    store.delete(bucket, file_key(alpha.model_id, REV, "config.json"))

    with pytest.raises(ObjectNotFound):
        await cache.ensure(alpha, store)

    assert not (folder / COMPLETE_MARKER).exists() and (folder / PARTIAL_MARKER).is_file()
    assert cache.complete_models() == () and changes == [1, 1]


async def test_remove_drops_every_revision_not_in_use(
    store: ObjectStore, bucket: str, models: dict[str, ModelManifest], tmp_path: Path
) -> None:
    alpha, beta, _ = models.values()
    cache = _cache(tmp_path, bucket, limit=0)
    await cache.ensure(alpha, store)
    await cache.ensure(beta, store)
    beta_src = tmp_path / "src" / "org" / "beta"
    other_revision = stage_folder(store, bucket, beta.model_id, "v2", beta_src, source="test")
    await cache.ensure(other_revision, store)
    cache.pin(beta.model_id, "v2")

    assert await cache.remove(beta.model_id) == ["main"]
    assert not cache.folder(beta.model_id, REV).exists() and _present(cache, other_revision)
    assert await cache.remove("org/nothing") == []
    cache.unpin(beta.model_id, "v2")
    assert await cache.remove(beta.model_id) == ["v2"]
    assert await cache.evict(alpha.model_id, REV) is True
    assert await cache.evict(alpha.model_id, REV) is False
    assert cache.usage_bytes() == 0 and not (tmp_path / "models" / "org").exists()


async def test_a_fetched_model_keeps_its_manifest_for_when_object_storage_is_down(
    store: ObjectStore, bucket: str, models: dict[str, ModelManifest], tmp_path: Path
) -> None:
    alpha, beta, _ = models.values()
    cache = _cache(tmp_path, bucket, limit=0)
    assert cache.cached_manifest(alpha.model_id, REV) is None
    folder = await cache.ensure(alpha, store)
    assert cache.cached_manifest(alpha.model_id, REV) == alpha
    assert [m.model_id for m in cache.models()] == ["org/alpha"]  # the copy is no model file
    assert _keys(alpha) == {file_key(alpha.model_id, REV, p) for p in model_file_paths(folder)}
    assert cache.cached_manifest(beta.model_id, REV) is None
