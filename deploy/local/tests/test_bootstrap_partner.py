"""Which prefill partner `fleet up` adds beside the model's decoder, from the node's calibrations (pure)."""

import msgspec
import pytest

from fleet_local.bootstrap import prefill_partner
from fleet_proto import EngineCalibration, EngineInfo, EngineQuality, NodeInfo

pytestmark = pytest.mark.unit

LLAMACPP = {"engine": "llamacpp", "model_id": "m", "node_id": "n"}
MLX = {"engine": "mlx", "model_id": "m", "node_id": "n"}
CLOSE = EngineQuality(top1_agreement=1, mean_kl=0.0, perplexity=9, reference_perplexity=9, greedy_agreement=1)


def measured(engine: str, prefill: float, fmt: str = "", peak_gib: float = 2.5) -> EngineCalibration:
    return EngineCalibration(
        engine=engine,
        engine_version="1",
        model_id="m",
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=50,
        prompt_tokens=128,
        completion_tokens=32,
        at=1,
        weight_format=fmt,
        quality=CLOSE,
        peak_memory_bytes=int(peak_gib * 2**30),
    )


def node(*calibrations: EngineCalibration, free_gib: float = 20) -> dict:
    info = NodeInfo(
        node_id="n",
        hostname="h",
        system="Linux",
        machine="x86_64",
        cpu_count=2,
        memory_total_bytes=24 << 30,
        memory_available_bytes=int(free_gib * 2**30),
        disk_total_bytes=1,
        disk_free_bytes=1,
        engines=(EngineInfo(name="llamacpp", version="1"), EngineInfo(name="vllm", version="1")),
        calibrations=calibrations,
    )
    return msgspec.to_builtins(info)


def test_auto_pairs_vllm_with_llama_cpp_only_where_the_node_measured_that_it_pays() -> None:
    # 512 tokens: 2.0 s on llama.cpp alone, 0.5 + 0.36 s with vLLM prefilling: it pays
    slow_prefill = node(measured("llamacpp", 256, "F16"), measured("vllm", 1024))
    engine, why = prefill_partner(LLAMACPP, "auto", True, slow_prefill)
    assert engine == "vllm" and "the pair pays" in why and "2.5 GiB more memory" in why
    # as measured on this project's 2-core x86: llama.cpp F16 ~500 tok/s, vLLM f32 ~600: it does not
    close = node(measured("llamacpp", 500, "F16"), measured("vllm", 600))
    engine, why = prefill_partner(LLAMACPP, "auto", True, close)
    assert engine == "" and "does not pay" in why and "TTFT(512) 1.02 s on llamacpp alone" in why
    assert prefill_partner(LLAMACPP, "auto", True, node(measured("llamacpp", 256, "F16")))[1].startswith(
        "one engine: vllm is not measured"
    )
    no_room = node(measured("llamacpp", 256, "F16"), measured("vllm", 1024, peak_gib=8), free_gib=10)
    assert prefill_partner(LLAMACPP, "auto", True, no_room)[0] == ""


def test_auto_pairs_nothing_without_vllm_or_beside_another_decoder() -> None:
    pays = node(measured("llamacpp", 256, "F16"), measured("vllm", 1024))
    assert prefill_partner(LLAMACPP, "auto", False, pays)[0] == ""
    assert prefill_partner(MLX, "auto", True, pays)[0] == ""  # e.g. Apple Silicon's MLX


def test_none_adds_nothing_and_a_named_engine_is_taken_as_asked() -> None:
    assert prefill_partner(LLAMACPP, "none", True, None)[0] == ""
    assert prefill_partner(MLX, "vllm", False, None) == ("vllm", "--prefill-engine vllm")
