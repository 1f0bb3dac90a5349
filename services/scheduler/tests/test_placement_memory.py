"""Placement counts each engine in the memory it uses (fleet_proto.memory), on recorded machines: a
discrete GPU's memory is its own pool, a unified-memory node has one pool that every engine shares;
and vLLM's KV cache is sized from what placement granted."""

from __future__ import annotations

import msgspec
import pytest

from fleet_proto import Instance, InstanceStatus, ModelCard, NodeInfo, State
from fleet_proto.engines import ENGINE_FACTS
from fleet_proto.memory import (
    GPU_USABLE_FRACTION,
    MIN_KV_TOKENS,
    MemoryPool,
    granted_bytes,
    kv_cache_budget,
    memory_pool,
    pool_bytes,
)
from fleet_scheduler.placement import PlacementError, free_bytes, place, placement_options
from fleet_store.cards import with_conventions

from .recorded_nodes import (
    DGX_SPARK,
    H100_BOX,
    LLAMA_8B,
    LLAMA_70B,
    MAC_M3_MAX,
    QWEN_32B,
    QWEN_32B_MLX,
    QWEN_72B_GGUF,
    SMOLLM2_135M,
)

pytestmark = pytest.mark.unit

GiB = 2**30
VLLM, LLAMACPP, MLX = ENGINE_FACTS["vllm"], ENGINE_FACTS["llamacpp"], ENGINE_FACTS["mlx"]


def cluster(node: NodeInfo, *cards: ModelCard, instances: tuple[Instance, ...] = ()) -> State:
    return State(
        nodes={node.node_id: node},
        models={c.model_id: with_conventions(c) for c in cards},
        instances={i.instance_id: msgspec.structs.replace(i, status=InstanceStatus.READY) for i in instances},
    )


def test_each_engine_loads_into_the_pool_it_uses_on_each_recorded_box():
    # The H100 box: vLLM in the first GPU's memory, the CPU engines in host memory.
    assert memory_pool(H100_BOX, VLLM) is MemoryPool.GPU
    assert memory_pool(H100_BOX, LLAMACPP) is memory_pool(H100_BOX, MLX) is MemoryPool.HOST
    assert pool_bytes(H100_BOX, MemoryPool.GPU) == int(85_520_809_984 * GPU_USABLE_FRACTION)  # 71.68 GiB
    assert pool_bytes(H100_BOX, MemoryPool.HOST) == H100_BOX.memory_available_bytes
    # Unified memory: one pool on the Spark (whatever NVML said of the GB10) and on the Mac.
    assert memory_pool(DGX_SPARK, VLLM) is memory_pool(DGX_SPARK, LLAMACPP) is MemoryPool.HOST
    assert memory_pool(MAC_M3_MAX, MLX) is memory_pool(MAC_M3_MAX, LLAMACPP) is MemoryPool.HOST
    # A CUDA node whose GPUs were not seen (FLEET_NODE_KIND=cuda without NVML): host memory is all it knows.
    assert memory_pool(msgspec.structs.replace(H100_BOX, gpus=()), VLLM) is MemoryPool.HOST


# --- the H100 box: discrete GPU memory ---------------------------------------------------------


def test_a_model_that_fits_host_memory_but_not_one_gpu_is_refused_for_vllm_naming_gpu_memory():
    state = cluster(H100_BOX, LLAMA_70B)  # 141 GB: 2 TB of RAM hold it, one 80 GB H100 does not
    with pytest.raises(PlacementError) as refused:
        place(state, LLAMA_70B.model_id, "i1", engine="vllm")
    assert "dgx-h100-1: needs 170.84 GiB of GPU memory, 71.68 GiB free" in str(refused.value)
    # Unasked, the engine that runs it from host memory takes it.
    placed = place(state, LLAMA_70B.model_id, "i1")
    assert (placed.engine, placed.node_id) == ("llamacpp", "dgx-h100-1")


def test_a_model_that_fits_one_gpu_is_placed_for_vllm_in_gpu_memory():
    state = cluster(H100_BOX, LLAMA_8B)
    placed = place(state, LLAMA_8B.model_id, "i1", engine="vllm")
    assert (placed.engine, placed.node_id) == ("vllm", "dgx-h100-1")
    [option] = [o for o in placement_options(state, LLAMA_8B.model_id, asked_engine="vllm") if o.feasible]
    assert option.memory_needed == {"dgx-h100-1": granted_bytes(LLAMA_8B, VLLM)}  # 19.44 GiB
    assert option.reason.startswith("fits with 52.24 GiB of GPU memory left")


def test_gpu_memory_and_host_memory_are_counted_apart():
    one = Instance(instance_id="v1", model_id=LLAMA_8B.model_id, node_id="dgx-h100-1", engine="vllm")
    state = cluster(H100_BOX, LLAMA_8B, LLAMA_70B, instances=(one,))
    gpu, host = free_bytes(state, facts=VLLM), free_bytes(state, facts=LLAMACPP)
    assert gpu["dgx-h100-1"] == pool_bytes(H100_BOX, MemoryPool.GPU) - granted_bytes(LLAMA_8B, VLLM)
    assert host["dgx-h100-1"] == H100_BOX.memory_available_bytes  # the vLLM instance took none of it
    # Three 8B instances fill the GPU (3 x 19.44 of 71.68 GiB); the fourth is refused there.
    two = msgspec.structs.replace(one, instance_id="v2")
    three = msgspec.structs.replace(one, instance_id="v3")
    full = cluster(H100_BOX, LLAMA_8B, LLAMA_70B, instances=(one, two, three))
    with pytest.raises(PlacementError, match=r"needs 19\.44 GiB of GPU memory, 13\.35 GiB free"):
        place(full, LLAMA_8B.model_id, "v4", engine="vllm")
    # ... while the host's 1.9 TiB still take the 70B on llama.cpp.
    assert place(full, LLAMA_70B.model_id, "l1", engine="llamacpp").node_id == "dgx-h100-1"


# --- the DGX Spark: one unified pool ------------------------------------------------------------


def test_on_the_spark_vllm_and_llamacpp_share_the_one_pool():
    state = cluster(DGX_SPARK, QWEN_32B, QWEN_72B_GGUF)
    assert free_bytes(state, facts=VLLM) == free_bytes(state, facts=LLAMACPP)
    # Alone, the 72B GGUF fits (57.41 of 113.58 GiB) ...
    assert place(state, QWEN_72B_GGUF.model_id, "g1").engine == "llamacpp"
    # ... but once vLLM took its 79.34 GiB for the 32B and half the rest for its KV cache, what is
    # left of the same pool does not hold it.
    vllm = place(state, QWEN_32B.model_id, "v1", engine="vllm")
    assert (vllm.engine, vllm.node_id) == ("vllm", "spark-1")
    base = granted_bytes(QWEN_32B, VLLM)
    assert vllm.granted_bytes == base + (free_bytes(state, facts=VLLM)["spark-1"] - base) // 2
    after = cluster(DGX_SPARK, QWEN_32B, QWEN_72B_GGUF, instances=(vllm,))
    assert (
        free_bytes(after, facts=LLAMACPP)["spark-1"] == DGX_SPARK.memory_available_bytes - vllm.granted_bytes
    )
    with pytest.raises(PlacementError, match=r"needs 57\.41 GiB of unified memory, 17\.1\d GiB free"):
        place(after, QWEN_72B_GGUF.model_id, "g1")


def test_vllm_alone_on_a_gpu_gets_a_kv_cache_near_its_own_default_and_leaves_half_the_rest():
    state = cluster(H100_BOX, LLAMA_8B)
    first = place(state, LLAMA_8B.model_id, "v1", engine="vllm")
    kv = kv_cache_budget(LLAMA_8B, VLLM, granted=first.granted_bytes)
    assert kv > 6 * kv_cache_budget(LLAMA_8B, VLLM)  # the weights' headroom alone: ~4 GB
    assert 28 * GiB < kv < 33 * GiB  # vLLM's own 0.9 of 80 GB less 16 GB of weights: ~56 GB
    second = place(cluster(H100_BOX, LLAMA_8B, instances=(first,)), LLAMA_8B.model_id, "v2", engine="vllm")
    assert granted_bytes(LLAMA_8B, VLLM) < second.granted_bytes < first.granted_bytes


# --- the Mac: MLX in unified memory ------------------------------------------------------------


def test_on_the_mac_mlx_takes_the_unified_pool():
    state = cluster(MAC_M3_MAX, QWEN_32B_MLX)
    first = place(state, QWEN_32B_MLX.model_id, "m1")
    assert (first.engine, first.node_id) == ("mlx", "mac-m3-max")
    [option] = [o for o in placement_options(state, QWEN_32B_MLX.model_id) if o.feasible]
    assert option.reason.startswith("fits with 23.67 GiB of unified memory left")
    # Two 22.33 GiB instances fit the 46.00 GiB it had free; a third does not.
    second = msgspec.structs.replace(first, instance_id="m2")
    after = cluster(MAC_M3_MAX, QWEN_32B_MLX, instances=(first, second))
    with pytest.raises(PlacementError, match=r"needs 22\.33 GiB of unified memory, 1\.33 GiB free"):
        place(after, QWEN_32B_MLX.model_id, "m3")


# --- vLLM's KV cache from its grant -------------------------------------------------------------


def tokens(card: ModelCard, budget: int) -> int:
    return budget // card.kv_bytes_per_token()


def test_the_kv_budget_is_the_grant_less_weights_and_one_steps_activations():
    # An 8B on an H100 and a 32B on the Spark: tens of thousands of tokens, within the grant.
    for card, least, most in ((LLAMA_8B, 30_000, 40_000), (QWEN_32B, 65_000, 80_000)):
        budget = kv_cache_budget(card, VLLM)
        assert least < tokens(card, budget) < most
        assert budget < granted_bytes(card, VLLM) - card.storage_bytes  # activations come off too
    assert tokens(LLAMA_8B, kv_cache_budget(LLAMA_8B, VLLM)) == 34_711
    # A model too small for the headroom to hold the engine's fixed costs still gets one 4k sequence.
    assert tokens(SMOLLM2_135M, kv_cache_budget(SMOLLM2_135M, VLLM)) == MIN_KV_TOKENS
    # float32 weights of a bfloat16 card leave nothing of the grant: the least again.
    doubled = kv_cache_budget(LLAMA_8B, VLLM, weight_bytes=2 * LLAMA_8B.storage_bytes)
    assert tokens(LLAMA_8B, doubled) == MIN_KV_TOKENS


def test_old_node_announcements_decode_with_no_unified_memory():
    old = msgspec.json.encode(H100_BOX).replace(b',"unified_memory":false', b"")
    assert b"unified_memory" not in old
    decoded = msgspec.json.decode(old, type=NodeInfo)
    assert not decoded.unified_memory and not decoded.gpus[0].unified_memory
    assert decoded == H100_BOX
