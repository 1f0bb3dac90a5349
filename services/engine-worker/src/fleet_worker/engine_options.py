"""The options an instance's engine is started with: the operator's (FLEET_ENGINE_OPTIONS), the
shared KV cache's (FLEET_KV_*), the KV cache size its memory grant allows, and a pipeline rank's place
in its ring."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleet_proto import Instance, ModelCard, NodeInfo
from fleet_proto.engines import engine_facts
from fleet_proto.memory import GPU_USABLE_FRACTION, kv_cache_budget
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


# The memory options of an engine that reserves its KV cache at start (EngineFacts.reserves_kv_cache:
# vLLM's constructor arguments). Either one set in FLEET_ENGINE_OPTIONS leaves the engine's memory to it.
KV_CACHE_OPTION = "kv_cache_bytes"
DEVICE_SHARE_OPTION = "gpu_memory_utilization"
CONTEXT_OPTION = "max_model_len"
AUTO_CONTEXT = -1  # vLLM: the longest context the KV cache holds (up to the model's own)
BYTES_PER_VALUE = {"float32": 4, "float16": 2, "bfloat16": 2}


def memory_options(
    configured: Mapping[str, Any],
    engine: str,
    card: ModelCard,
    node: NodeInfo,
    layers: int | None = None,
    dtype: str = "",
    granted: int = 0,
) -> dict[str, Any]:
    """The KV cache an engine that reserves it whole at start gets from the memory placement granted
    the instance (fleet_proto.memory, the rule placement counted it by), where the engine allocates on
    the node's GPU: `kv_cache_bytes`; the `gpu_memory_utilization` vLLM checks is free on the device
    before it starts (with a KV size given it sizes nothing by it: the grant's share of the device,
    never vLLM's default 0.9 of it, which a second instance, or a unified-memory node's other
    engines, would never leave free); and `max_model_len` -1 (what that cache holds) unless
    configured. {} elsewhere (vLLM on a CPU keeps its own small cache), and when the operator set
    `kv_cache_bytes` or `gpu_memory_utilization` (FLEET_ENGINE_OPTIONS wins). `dtype`: the weight
    format served, when it is not the card's (float32 weights of a bfloat16 card take twice its
    bytes). `granted`: what placement granted the instance (Instance.granted_bytes; 0: the weights'
    headroom)."""
    facts = engine_facts(engine)
    if not facts.reserves_kv_cache or node.kind not in facts.gpu_memory_on:
        return {}
    if KV_CACHE_OPTION in configured or DEVICE_SHARE_OPTION in configured:
        return {}
    n = card.num_layers if layers is None else layers
    weights = card.storage_bytes * n // max(card.num_layers, 1)
    staged, served = BYTES_PER_VALUE.get(card.dtype), BYTES_PER_VALUE.get(dtype)
    if staged and served:
        weights = weights * served // staged
    kv = kv_cache_budget(card, facts, n, weights, granted)
    # The device's memory as vLLM sees it: the first GPU's (on a GB10 the probe reports the host's there).
    device = node.gpus[0].memory_bytes if node.gpus else node.memory_total_bytes
    share = min(max((weights + kv) / max(device, 1), 0.01), GPU_USABLE_FRACTION)
    options: dict[str, Any] = {KV_CACHE_OPTION: kv, DEVICE_SHARE_OPTION: round(share, 4)}
    if CONTEXT_OPTION not in configured:
        options[CONTEXT_OPTION] = AUTO_CONTEXT
    return options


def embedder_options(memory: dict[str, Any]) -> dict[str, Any]:
    """An embedding model's engine options: its embedder, and of `memory_options` only the KV size
    and device share (a vLLM embedder on a GPU must not ask vLLM for its default 0.9 of it)."""
    return {"embedding": True} | {
        k: v for k, v in memory.items() if k in (KV_CACHE_OPTION, DEVICE_SHARE_OPTION)
    }


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
