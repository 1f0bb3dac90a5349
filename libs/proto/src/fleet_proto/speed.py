"""Which engine is fastest for a model on a node: its measured calibrations, else a prior (pure).

Every worker times each engine it runs on each model once (fleet_worker.calibration) and reports
the results in its NodeInfo. Engines compare by the seconds a reference request would take on
them: REFERENCE_PROMPT_TOKENS at the measured prefill speed plus REFERENCE_OUTPUT_TOKENS at the
measured decode speed. Until every candidate engine of a node is measured for the model, the
node kind's PRIOR_ORDER ranks them: the order measured on such nodes so far (docs/ARCHITECTURE.md),
a starting point that the node's own measurements replace.

An engine may be measured in several weight formats (llama.cpp: the GGUF as it is, Q8_0, F16): it
counts with the fastest of them within the quality budget (fleet_proto.quality), and an engine none
of whose formats is within it ranks after every engine that has one.
"""

from __future__ import annotations

from collections.abc import Iterable

from fleet_proto.common import EngineCalibration, NodeInfo, NodeKind, QualityBudget
from fleet_proto.quality import describe_quality, eligible, within_budget

REFERENCE_PROMPT_TOKENS = 512
REFERENCE_OUTPUT_TOKENS = 128
PRIOR_ORDER: dict[NodeKind, tuple[str, ...]] = {
    NodeKind.APPLE: ("mlx", "llamacpp", "vllm"),  # MLX on Metal
    NodeKind.CUDA: ("vllm", "llamacpp", "mlx"),
    NodeKind.CPU: ("llamacpp", "mlx", "vllm"),  # x86 AVX2, SmolLM2: 6, 10 and 12 s per reference request
}
# Embedding models are not calibrated: the order `fleet bench embed` measured (all-MiniLM-L6-v2 on
# the 2-core x86 VM, batch 32: vLLM 192, MLX 41 inputs/s; README "Embeddings")
EMBEDDING_PRIOR_ORDER: dict[NodeKind, tuple[str, ...]] = {
    NodeKind.APPLE: ("mlx", "vllm"),
    NodeKind.CUDA: ("vllm", "mlx"),
    NodeKind.CPU: ("vllm", "mlx"),
}
MEASURED = "measured"
PRIOR = "prior"


def engine_version(node: NodeInfo, engine: str) -> str:
    return next((e.version for e in node.engines if e.name == engine), "")


def calibrations(node: NodeInfo, engine: str, model_id: str) -> list[EngineCalibration]:
    """The newest measurement per weight format of `engine` (at the version the node runs now)."""
    version = engine_version(node, engine)
    newest: dict[str, EngineCalibration] = {}
    for c in node.calibrations:
        if c.engine == engine and c.model_id == model_id and c.engine_version == version:
            if c.weight_format not in newest or c.at > newest[c.weight_format].at:
                newest[c.weight_format] = c
    return list(newest.values())


def calibration(node: NodeInfo, engine: str, model_id: str) -> EngineCalibration | None:
    """The measurement `engine` counts with on `node`: its fastest format within the node's budget."""
    return fastest_within(calibrations(node, engine, model_id), node.quality_budget)


def fastest_within(
    measurements: Iterable[EngineCalibration], budget: QualityBudget
) -> EngineCalibration | None:
    """The fastest of `measurements` within `budget` (the closest to the reference when none is)."""
    # A local first: in `return min(...)` mypy would type the key's argument as the optional result.
    fastest = min(eligible(measurements, budget), key=reference_seconds, default=None)
    return fastest


def reference_seconds(measured: EngineCalibration) -> float:
    """How long the reference request would take at the measured speeds."""
    prefill = REFERENCE_PROMPT_TOKENS / max(measured.prefill_tokens_per_s, 1e-9)
    return prefill + REFERENCE_OUTPUT_TOKENS / max(measured.decode_tokens_per_s, 1e-9)


def _prior_index(kind: NodeKind, engine: str) -> int:
    order = PRIOR_ORDER.get(kind, ())
    return order.index(engine) if engine in order else len(order)


def engine_order(
    node: NodeInfo, model_id: str, engines: Iterable[str], embedding: bool = False
) -> tuple[list[str], str]:
    """`engines` fastest first on `node` for `model_id` (those within the quality budget before the
    others), and how they were ranked (MEASURED when every one of them has a calibration there, else
    PRIOR; an embedding model by EMBEDDING_PRIOR_ORDER); ties keep the given order."""
    candidates = list(dict.fromkeys(engines))
    if embedding:
        order = EMBEDDING_PRIOR_ORDER.get(node.kind, ())
        return sorted(candidates, key=lambda e: order.index(e) if e in order else len(order)), PRIOR
    measured = {e: calibration(node, e, model_id) for e in candidates}
    if candidates and all(measured.values()):

        def key(engine: str) -> tuple[bool, float]:
            chosen = measured[engine]
            assert chosen is not None
            return (not within_budget(chosen, node.quality_budget), reference_seconds(chosen))

        return sorted(candidates, key=key), MEASURED
    return sorted(candidates, key=lambda e: _prior_index(node.kind, e)), PRIOR


def describe(node: NodeInfo, model_id: str, engine: str, how: str) -> str:
    """The reason part that says why `engine` ranks where it does on `node`."""
    measured = calibration(node, engine, model_id)
    if how == MEASURED and measured is not None:
        fmt = f" as {measured.weight_format}" if measured.weight_format else ""
        quality = describe_quality(measured, node.quality_budget)
        return (
            f"{engine}{fmt} measured {measured.prefill_tokens_per_s:.0f} prefill / "
            f"{measured.decode_tokens_per_s:.1f} decode tok/s here; {quality}"
        )
    return f"{engine} by the {node.kind} prior (not every engine measured here yet)"
