"""The quality budget (fleet_proto.quality) and engine ranking with several weight formats
(fleet_proto.speed): pure, over recorded measurements."""

from __future__ import annotations

import msgspec
import pytest

from fleet_proto import EngineCalibration, EngineInfo, EngineQuality, NodeInfo, QualityBudget
from fleet_proto.quality import (
    DEFAULT_BUDGET,
    NO_BUDGET,
    BudgetError,
    describe_quality,
    eligible,
    parse_budget,
    within_budget,
)
from fleet_proto.speed import MEASURED, calibration, describe, engine_order

pytestmark = pytest.mark.unit


def quality(top1: float, kl: float, greedy: float = 1.0) -> EngineQuality:
    return EngineQuality(
        top1_agreement=top1, mean_kl=kl, perplexity=9.0, reference_perplexity=9.0, greedy_agreement=greedy
    )


def measured(
    engine: str, fmt: str, prefill: float, decode: float, q: EngineQuality | None
) -> EngineCalibration:
    return EngineCalibration(
        engine=engine,
        engine_version="1",
        model_id="org/m",
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=decode,
        prompt_tokens=128,
        completion_tokens=32,
        at=1.0,
        weight_format=fmt,
        quality=q,
    )


# The shape of SmolLM2-135M's measurements on a 2-core x86 (README's quality table): llama.cpp's
# quantized paths are fastest and outside the default budget; F16 and vLLM's f32 are within it.
LLAMA_AS_IS = measured("llamacpp", "as-is", 260, 75, quality(0.93, 0.06, 0.5))
LLAMA_Q8 = measured("llamacpp", "Q8_0", 420, 95, quality(0.95, 0.03, 0.5))
LLAMA_F16 = measured("llamacpp", "F16", 520, 65, quality(1.0, 0.0005))
VLLM = measured("vllm", "", 600, 18, quality(1.0, 0.00001))


def node(*calibrations: EngineCalibration, budget: QualityBudget = DEFAULT_BUDGET) -> NodeInfo:
    return NodeInfo(
        node_id="n",
        hostname="h",
        system="Linux",
        machine="x86_64",
        cpu_count=2,
        memory_total_bytes=8 << 30,
        memory_available_bytes=8 << 30,
        disk_total_bytes=1 << 40,
        disk_free_bytes=1 << 40,
        engines=(EngineInfo(name="llamacpp", version="1"), EngineInfo(name="vllm", version="1")),
        calibrations=calibrations,
        quality_budget=budget,
    )


def test_the_budget_is_read_from_its_setting() -> None:
    assert parse_budget("") == DEFAULT_BUDGET
    assert parse_budget("off") == NO_BUDGET
    assert parse_budget("top1=0.9") == QualityBudget(min_top1_agreement=0.9)
    assert parse_budget("kl=0.1, top1=0.5") == QualityBudget(min_top1_agreement=0.5, max_mean_kl=0.1)
    with pytest.raises(BudgetError, match="expected off or top1"):
        parse_budget("ppl=3")
    with pytest.raises(BudgetError, match="not a number"):
        parse_budget("kl=low")


def test_within_the_budget_takes_both_top1_and_kl_and_unmeasured_quality_passes() -> None:
    assert within_budget(LLAMA_F16, DEFAULT_BUDGET) and within_budget(VLLM, DEFAULT_BUDGET)
    assert not within_budget(LLAMA_Q8, DEFAULT_BUDGET) and not within_budget(LLAMA_AS_IS, DEFAULT_BUDGET)
    high_kl = measured("llamacpp", "Q4_0", 1, 1, quality(0.99, 0.5))
    assert not within_budget(high_kl, DEFAULT_BUDGET)
    assert within_budget(LLAMA_Q8, NO_BUDGET)
    unmeasured = measured("mlx", "", 1, 1, None)
    assert within_budget(unmeasured, DEFAULT_BUDGET)
    assert "quality not measured" in describe_quality(unmeasured, DEFAULT_BUDGET)


def test_when_nothing_is_within_the_budget_the_closest_to_the_reference_remains() -> None:
    assert eligible([LLAMA_AS_IS, LLAMA_Q8], DEFAULT_BUDGET) == [LLAMA_Q8]
    assert eligible([LLAMA_AS_IS, LLAMA_Q8, LLAMA_F16], DEFAULT_BUDGET) == [LLAMA_F16]


def test_an_engine_counts_with_its_fastest_format_within_the_budget() -> None:
    here = node(LLAMA_AS_IS, LLAMA_Q8, LLAMA_F16, VLLM)
    assert calibration(here, "llamacpp", "org/m") == LLAMA_F16
    assert (
        calibration(node(LLAMA_AS_IS, LLAMA_Q8, LLAMA_F16, budget=NO_BUDGET), "llamacpp", "org/m") == LLAMA_Q8
    )
    reason = describe(here, "org/m", "llamacpp", MEASURED)
    assert "llamacpp as F16 measured 520 prefill / 65.0 decode tok/s" in reason
    assert "top-1 1.000, KL 0.0005" in reason and "within the budget" in reason


def test_engines_outside_the_budget_rank_after_those_within_it() -> None:
    quick_but_wrong = measured("vllm", "", 5000, 500, quality(0.5, 1.0))
    assert engine_order(node(LLAMA_F16, quick_but_wrong), "org/m", ("vllm", "llamacpp")) == (
        ["llamacpp", "vllm"],
        MEASURED,
    )
    unbudgeted = msgspec.structs.replace(node(LLAMA_F16, quick_but_wrong), quality_budget=NO_BUDGET)
    assert engine_order(unbudgeted, "org/m", ("vllm", "llamacpp"))[0] == ["vllm", "llamacpp"]
    assert "outside the budget" in describe(node(quick_but_wrong, LLAMA_F16), "org/m", "vllm", MEASURED)
