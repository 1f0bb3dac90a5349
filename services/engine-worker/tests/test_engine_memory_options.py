"""vLLM's KV cache is sized from the memory placement granted the instance (fleet_proto.memory), on
the machines recorded for the placement tests; FLEET_ENGINE_OPTIONS still wins."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

from fleet_proto import NodeKind
from fleet_proto.engines import ENGINE_FACTS
from fleet_proto.memory import MIN_KV_TOKENS, granted_bytes, kv_cache_budget
from fleet_worker.engine_options import AUTO_CONTEXT, memory_options

pytestmark = pytest.mark.unit

VLLM = ENGINE_FACTS["vllm"]


def _recorded() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "scheduler/tests/recorded_nodes.py"
    spec = importlib.util.spec_from_file_location("recorded_nodes", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recorded = _recorded()


def test_vllm_on_an_h100_gets_its_grant_less_weights_and_the_grants_share_of_the_gpu():
    card, node = recorded.LLAMA_8B, recorded.H100_BOX
    options = memory_options({}, "vllm", card, node)
    kv = kv_cache_budget(card, VLLM)
    assert options == {
        "kv_cache_bytes": kv,
        "gpu_memory_utilization": round((card.storage_bytes + kv) / node.gpus[0].memory_bytes, 4),
        "max_model_len": AUTO_CONTEXT,
    }
    assert options["gpu_memory_utilization"] == 0.2410  # not vLLM's 0.9: three more fit beside it
    assert card.storage_bytes + kv <= granted_bytes(card, VLLM)


def test_the_grant_placement_recorded_sizes_the_cache():
    card, node = recorded.LLAMA_8B, recorded.H100_BOX
    granted = 40 * 2**30
    options = memory_options({}, "vllm", card, node, granted=granted)
    assert options["kv_cache_bytes"] == kv_cache_budget(card, VLLM, granted=granted)
    assert card.storage_bytes + options["kv_cache_bytes"] <= granted
    assert options["gpu_memory_utilization"] == round(
        (card.storage_bytes + options["kv_cache_bytes"]) / node.gpus[0].memory_bytes, 4
    )


def test_vllm_on_the_spark_takes_its_share_of_the_one_pool():
    card, node = recorded.QWEN_32B, recorded.DGX_SPARK
    options = memory_options({}, "vllm", card, node)
    assert options["kv_cache_bytes"] == kv_cache_budget(card, VLLM)  # 19.3 GB: 73k tokens
    assert options["gpu_memory_utilization"] == 0.6602  # of the 128 GB the GB10 shares with the host


def test_engines_that_do_not_reserve_kv_on_a_gpu_get_nothing():
    assert memory_options({}, "vllm", recorded.LLAMA_8B, recorded.MAC_M3_MAX) == {}  # no CUDA there
    cpu = msgspec.structs.replace(recorded.H100_BOX, kind=NodeKind.CPU, gpus=())
    assert memory_options({}, "vllm", recorded.LLAMA_8B, cpu) == {}  # vLLM's CPU default stays
    assert memory_options({}, "mlx", recorded.QWEN_32B_MLX, recorded.MAC_M3_MAX) == {}
    assert memory_options({}, "llamacpp", recorded.QWEN_72B_GGUF, recorded.DGX_SPARK) == {}


def test_fleet_engine_options_win():
    card, node = recorded.LLAMA_8B, recorded.H100_BOX
    assert memory_options({"kv_cache_bytes": 8 << 30}, "vllm", card, node) == {}
    assert memory_options({"gpu_memory_utilization": 0.5}, "vllm", card, node) == {}
    assert "max_model_len" not in memory_options({"max_model_len": 8192}, "vllm", card, node)


def test_float32_weights_of_a_bfloat16_card_are_counted_at_their_size():
    card, node = recorded.LLAMA_8B, recorded.H100_BOX
    options = memory_options({}, "vllm", card, node, dtype="float32")
    # Twice the weights fill the grant: the least KV cache, one 4k sequence.
    assert options["kv_cache_bytes"] == MIN_KV_TOKENS * card.kv_bytes_per_token()
    assert options["gpu_memory_utilization"] == round(
        (2 * card.storage_bytes + options["kv_cache_bytes"]) / node.gpus[0].memory_bytes, 4
    )


def test_an_embedder_on_a_gpu_gets_the_kv_size_and_device_share_only():
    from fleet_worker.engine_options import embedder_options

    memory = memory_options({}, "vllm", recorded.LLAMA_8B, recorded.H100_BOX)
    options = embedder_options(memory)
    assert options == {
        "embedding": True,
        "kv_cache_bytes": memory["kv_cache_bytes"],
        "gpu_memory_utilization": memory["gpu_memory_utilization"],
    }
    assert options["gpu_memory_utilization"] < 0.9  # never vLLM's default share of the device
    assert embedder_options({}) == {"embedding": True}  # a CPU, or MLX
