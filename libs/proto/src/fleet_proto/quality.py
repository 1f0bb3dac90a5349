"""Which engine and weight format may serve a model automatically: the quality budget (pure).

Every worker measures how close each engine, in each weight format it can serve, comes to a float32
reference of the same weights (fleet_worker.quality: EngineQuality on its calibration). A pair is
eligible when its top-1 agreement and mean KL are within the budget; among eligible pairs the
fastest wins (fleet_proto.speed). A pair never measured for quality (no reference on its node) is
eligible, and its reason says so. An engine or format the user names is always served; the budget
only decides what Fleet picks by itself.

Default budget, from SmolLM2-135M on a 2-core x86 with AMX (`fleet bench quality`, 2026-12-06):
llama.cpp F16 and F32 measured top-1 0.991, KL < 0.0001 and answered every chat prompt as the
reference; llama.cpp Q4_1 (top-1 0.946) and Q8_0 (0.973), and vLLM in bf16 (0.973), answer
"L'Etoile" for the capital of France; MLX in bf16 keeps top-1 0.982 but drifts (KL 0.048, one
prompt of four answered differently). Top-1 >= 0.98 with KL <= 0.02 admits only the first group.
"""

from __future__ import annotations

from collections.abc import Iterable

from fleet_proto.common import EngineCalibration, QualityBudget

DEFAULT_BUDGET = QualityBudget()
NO_BUDGET = QualityBudget(min_top1_agreement=0.0, max_mean_kl=1e9)  # "off": the fastest wins


class BudgetError(ValueError):
    pass


def parse_budget(text: str) -> QualityBudget:
    """FLEET_QUALITY_BUDGET: "" (the default), "off" (no gate: fastest wins), or
    "top1=0.98,kl=0.02" (either key may be left out)."""
    text = text.strip()
    if not text:
        return DEFAULT_BUDGET
    if text == "off":
        return NO_BUDGET
    fields = {"top1": "min_top1_agreement", "kl": "max_mean_kl"}
    values: dict[str, float] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in fields:
            raise BudgetError(f"quality budget {text!r}: expected off or top1=<share>,kl=<nats>")
        try:
            values[fields[key.strip()]] = float(value)
        except ValueError:
            raise BudgetError(f"quality budget {text!r}: {value!r} is not a number") from None
    return QualityBudget(**values)


def within_budget(measured: EngineCalibration, budget: QualityBudget) -> bool:
    quality = measured.quality
    if quality is None:
        return True
    return quality.top1_agreement >= budget.min_top1_agreement and quality.mean_kl <= budget.max_mean_kl


def label(measured: EngineCalibration) -> str:
    return f"{measured.engine}/{measured.weight_format}" if measured.weight_format else measured.engine


def describe_quality(measured: EngineCalibration, budget: QualityBudget) -> str:
    """What the budget says of one measured engine/format, for reasons and tables."""
    quality = measured.quality
    if quality is None:
        return f"{label(measured)} quality not measured"
    figures = (
        f"top-1 {quality.top1_agreement:.3f}, KL {quality.mean_kl:.4f}, "
        f"greedy {quality.greedy_agreement:.2f} vs the float32 reference"
    )
    if budget == NO_BUDGET:
        return f"{label(measured)} {figures} (no quality budget)"
    verdict = "within" if within_budget(measured, budget) else "outside"
    return (
        f"{label(measured)} {figures}: {verdict} the budget "
        f"(top-1 >= {budget.min_top1_agreement}, KL <= {budget.max_mean_kl})"
    )


def quality_rank(measured: EngineCalibration) -> tuple[float, float]:
    """Closer to the reference sorts first (unmeasured last)."""
    quality = measured.quality
    return (quality.mean_kl, -quality.top1_agreement) if quality else (float("inf"), 0.0)


def eligible(measurements: Iterable[EngineCalibration], budget: QualityBudget) -> list[EngineCalibration]:
    """The measurements within the budget; when none is, the closest to the reference alone (a
    model must be served by something; its reason says it is outside the budget)."""
    given = list(measurements)
    inside = [m for m in given if within_budget(m, budget)]
    return inside or sorted(given, key=quality_rank)[:1]
