"""Engine facts (fleet_proto.engines): one table that routing, placement and the worker read."""

from __future__ import annotations

import pytest

from fleet_proto import NodeKind
from fleet_proto.engines import ENGINE_FACTS, UNKNOWN_ENGINE, engine_facts, engines_where

pytestmark = pytest.mark.unit


def test_the_known_engines_and_their_disaggregation_facts():
    assert list(ENGINE_FACTS) == ["mlx", "vllm", "llamacpp", "echo"]
    kv_export = engines_where(lambda f: f.kv_export)
    assert kv_export == engines_where(lambda f: f.kv_import) == ("mlx", "vllm", "llamacpp")
    assert engines_where(lambda f: f.first_token_export) == ("vllm",)
    assert engines_where(lambda f: f.first_token_import) == ("llamacpp",)


def test_preferences_when_nothing_is_calibrated():
    assert engines_where(lambda f: f.decode_preferred) == ("mlx",)
    assert engines_where(lambda f: f.prefill_preferred) == ("vllm",)


def test_loading_and_kv_facts():
    assert engines_where(lambda f: f.pipeline) == ("mlx",)
    assert engines_where(lambda f: f.kv_local) == ("llamacpp",)
    assert engines_where(lambda f: f.kv_memory_tier) == ("mlx",)
    assert engines_where(lambda f: not f.loads_weights) == ("echo",)
    assert engine_facts("echo").memory_headroom == 0.0
    assert engines_where(lambda f: "mlx" in f.quantizations) == ("mlx",)
    assert NodeKind.CUDA not in engine_facts("mlx").quantized_devices  # no quantized matmul on CUDA
    assert engine_facts("llamacpp").weight_formats == ("as-is", "Q8_0", "F16")


def test_memory_facts():
    # vLLM keeps weights and KV in a CUDA GPU's memory and reserves its KV cache whole at start; the
    # other engines load into host memory (fleet_proto.memory).
    assert engines_where(lambda f: NodeKind.CUDA in f.gpu_memory_on) == ("vllm",)
    assert engines_where(lambda f: bool(f.gpu_memory_on)) == ("vllm",)
    assert engines_where(lambda f: f.reserves_kv_cache) == ("vllm",)


def test_an_unknown_engine_can_do_nothing_special():
    assert engine_facts("some-new-engine") == UNKNOWN_ENGINE
    assert not (UNKNOWN_ENGINE.kv_export or UNKNOWN_ENGINE.kv_import or UNKNOWN_ENGINE.pipeline)
