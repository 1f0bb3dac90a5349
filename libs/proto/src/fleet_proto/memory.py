"""Which memory an instance takes on its node, and how much: one pure rule that placement counts with
and the worker sizes vLLM's KV cache by, so that the two never disagree.

A node has one memory pool, its host memory (NodeInfo.memory_available_bytes as it joined), and a
second one when its GPU has memory of its own: an engine that allocates on the GPU there
(EngineFacts.gpu_memory_on: vLLM on CUDA) takes its weights and KV from the GPU's memory, every
other engine from host memory. A unified-memory node (Apple silicon, a DGX Spark's GB10:
NodeInfo.unified_memory) has the one pool only, which every engine shares.
"""

from __future__ import annotations

import math
from enum import StrEnum

from fleet_proto.common import ModelCard, NodeInfo
from fleet_proto.engines import EngineFacts


class MemoryPool(StrEnum):
    """A node's memory pools, by the words a placement's reason names them with."""

    HOST = "memory"
    GPU = "GPU memory"


# vLLM's own default share of a discrete GPU: the rest holds CUDA contexts and the buffers outside
# torch (cuBLAS workspaces, NCCL), which no instance's grant counts.
GPU_USABLE_FRACTION = 0.9
# One engine step's activations beyond weights and KV (vLLM profiles a max_num_batched_tokens step):
# about this many bytes per token per hidden unit (16-bit MLP intermediates at ~3.5x hidden for gate
# and up, QKV, residuals, with room), for a step of this many tokens (the engine's default).
ACTIVATION_BYTES_PER_TOKEN_AND_UNIT = 32
STEP_TOKENS = 2048
# The least KV cache an engine is given: one sequence of this many tokens, or these bytes where the
# card does not know its KV shape (a stand-in card), so that a model whose headroom is below the
# engine's fixed costs (a 135M one: 81 MB of headroom) still starts.
MIN_KV_TOKENS = 4096
MIN_KV_BYTES = 64 << 20
# An engine that reserves its KV cache whole at start on a GPU (vLLM) is granted, beyond its
# weights' headroom, this share of what its pool has free when it is placed: alone on a GPU it gets
# a cache near what vLLM's own 0.9 gives (an 8B on an H100: ~31 GB rather than ~4 GB), and the rest
# stays for instances placed later (an MLX model on the same unified-memory machine).
RESERVED_FREE_SHARE = 0.5


def memory_pool(node: NodeInfo, facts: EngineFacts) -> MemoryPool:
    """The pool an engine with `facts` loads into on `node`: its GPU's memory where it allocates on the
    GPU and that GPU has memory of its own (reported, not unified), else host memory."""
    if node.kind in facts.gpu_memory_on and node.gpus and not node.unified_memory:
        return MemoryPool.GPU
    return MemoryPool.HOST


def pool_bytes(node: NodeInfo, pool: MemoryPool) -> int:
    """What `pool` holds on `node` before any instance. Host: the memory available as it joined. GPU:
    the first GPU's memory times GPU_USABLE_FRACTION; the first GPU's only, since Fleet starts vLLM
    without tensor parallelism: an instance runs on one device however many the node has (eight
    H100s do not hold a model that one does not). Its total, not what was free at join: a node
    announces itself again while its instances run (a model cached, an engine measured), and what
    is free then already lacks them."""
    if pool is MemoryPool.GPU and node.gpus:
        return int(node.gpus[0].memory_bytes * GPU_USABLE_FRACTION)
    return node.memory_available_bytes


def share_bytes(card: ModelCard, layers: int, headroom: float) -> int:
    """The bytes `layers` of the card's layers need: their share of its storage times `headroom`."""
    return math.ceil(card.storage_bytes * layers * headroom / max(card.num_layers, 1))


def granted_bytes(card: ModelCard, facts: EngineFacts, layers: int | None = None) -> int:
    """What placement counts for an instance of `card` on an engine with `facts` (its `layers`, all
    when None): the weights times the engine's headroom."""
    return share_bytes(card, card.num_layers if layers is None else layers, facts.memory_headroom)


def grant(card: ModelCard, facts: EngineFacts, node: NodeInfo, free: int, layers: int | None = None) -> int:
    """What placement grants an instance on `node`, whose pool has `free` bytes before it: the
    weights times the engine's headroom, plus RESERVED_FREE_SHARE of the rest for an engine that
    reserves its KV cache on that node's GPU."""
    base = granted_bytes(card, facts, layers)
    if not facts.reserves_kv_cache or node.kind not in facts.gpu_memory_on:
        return base
    return base + int(max(free - base, 0) * RESERVED_FREE_SHARE)


def kv_cache_budget(
    card: ModelCard,
    facts: EngineFacts,
    layers: int | None = None,
    weight_bytes: int | None = None,
    granted: int = 0,
) -> int:
    """The KV cache bytes of an engine that reserves its cache whole at start (vLLM): what placement
    granted the instance (`granted`, else its weights times the headroom), less its weights
    (`weight_bytes`, else their share of the staged size) and one step's activations; so never more
    than the grant holds beside the weights, and at least MIN_KV_TOKENS tokens of KV (or
    MIN_KV_BYTES).

    The size is fixed once: vLLM's public API takes it at start (`kv_cache_memory_bytes`, or
    `gpu_memory_utilization`) and allocates every block then; it has no call that grows the cache
    later, so an instance that needs more must be placed again with a larger grant."""
    n = card.num_layers if layers is None else layers
    weights = card.storage_bytes * n // max(card.num_layers, 1) if weight_bytes is None else weight_bytes
    activations = STEP_TOKENS * card.hidden_size * ACTIVATION_BYTES_PER_TOKEN_AND_UNIT
    per_token = card.kv_bytes_per_token(4 if card.dtype == "float32" else 2) * n // max(card.num_layers, 1)
    least = max(per_token * MIN_KV_TOKENS, MIN_KV_BYTES)
    return max((granted or granted_bytes(card, facts, n)) - weights - activations, least)
