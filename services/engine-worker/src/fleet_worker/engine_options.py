"""The options an instance's engine is started with: the operator's (FLEET_ENGINE_OPTIONS), the
shared KV cache's (FLEET_KV_*), and a pipeline rank's place in its ring."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fleet_proto import Instance
from fleet_proto.engines import engine_facts
from fleet_store import ModelManifest
from fleet_store.kv import manifest_fingerprint


class EngineOptionsError(ValueError):
    """FLEET_ENGINE_OPTIONS is not a JSON object of objects."""


def parse_engine_options(raw: str) -> dict[str, dict[str, Any]]:
    """FLEET_ENGINE_OPTIONS: engine name -> keyword arguments of that engine's class."""
    if not raw.strip():
        return {}
    try:
        options = json.loads(raw)
    except ValueError as error:
        raise EngineOptionsError(f"FLEET_ENGINE_OPTIONS is not JSON: {error}") from None
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise EngineOptionsError('FLEET_ENGINE_OPTIONS must map engine names to objects: {"vllm": {...}}')
    return options


@dataclass(frozen=True)
class KVSettings:
    """What every engine here gets for the shared KV cache (FLEET_KV_* settings)."""

    folder: str  # the local KV folder: blocks fetched from object storage, blocks to upload
    block_size: int
    memory_bytes: int  # tier 1 budget of an MLX engine (vLLM manages its own pages)


def engine_options(
    configured: dict[str, dict[str, Any]],
    engine: str,
    manifest: ModelManifest,
    kv: KVSettings | None = None,
    shared_tier: bool = True,
) -> dict[str, Any]:
    """The options an instance's engine gets: the KV ones (the model's fingerprint from its
    manifest: no re-hashing of the weights on the node), then the configured ones, which win.
    Without the shared tier (a pipeline rank) an engine gets no KV folder, only its memory tier;
    an engine that keeps its KV local (EngineFacts.kv_local) gets none of the KV options."""
    facts = engine_facts(engine)
    options: dict[str, Any] = {}
    if kv is not None and not facts.kv_local:
        options = {"kv_block_size": kv.block_size}
        if shared_tier:
            options["kv_dir"] = kv.folder
        if facts.kv_memory_tier:
            options["kv_memory_bytes"] = kv.memory_bytes
    options |= configured.get(engine, {})
    if not shared_tier:
        options.pop("kv_dir", None)
    if (options.get("kv_dir") or options.get("kv_memory_bytes")) and not options.get("kv_fingerprint"):
        options["kv_fingerprint"] = manifest_fingerprint(manifest)
    return options


def shard_rank(instance: Instance, node_id: str) -> int | None:
    """This node's rank in a pipeline instance (its shard's position), None when it holds none."""
    return next((rank for rank, s in enumerate(instance.shards) if s.node_id == node_id), None)


def pipeline_options(instance: Instance, rank: int) -> dict[str, Any]:
    """The MLX engine's `pipeline` option of one rank: where every rank listens, and its layers."""
    shard = instance.shards[rank]
    return {
        "rank": rank,
        "addresses": [s.ring_address for s in instance.shards],
        "start_layer": shard.start_layer,
        "end_layer": shard.end_layer,
    }


def rank_label(instance: Instance, rank: int) -> str:
    shard = instance.shards[rank]
    return (
        f"rank {rank} of {len(instance.shards)} (layers {shard.start_layer}-{shard.end_layer} "
        f"on {shard.node_id})"
    )
