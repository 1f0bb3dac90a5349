"""Which engine is fastest for a model on a node: its measured calibrations, else a prior (pure).

Every worker times each engine it runs on each model once (fleet_worker.calibration) and reports
the results in its NodeInfo. Engines compare by the seconds a reference request would take on
them: REFERENCE_PROMPT_TOKENS at the measured prefill speed plus REFERENCE_OUTPUT_TOKENS at the
measured decode speed. Until every candidate engine of a node is measured for the model, the
node kind's PRIOR_ORDER ranks them: the order measured on such nodes so far (docs/ARCHITECTURE.md),
a starting point that the node's own measurements replace.
"""

from __future__ import annotations

from collections.abc import Iterable

from fleet_proto.common import EngineCalibration, NodeInfo, NodeKind

REFERENCE_PROMPT_TOKENS = 512
REFERENCE_OUTPUT_TOKENS = 128
PRIOR_ORDER: dict[NodeKind, tuple[str, ...]] = {
    NodeKind.APPLE: ("mlx", "llamacpp", "vllm"),  # MLX on Metal
    NodeKind.CUDA: ("vllm", "llamacpp", "mlx"),
    NodeKind.CPU: ("llamacpp", "mlx", "vllm"),  # x86 AVX2, SmolLM2: 6, 10 and 12 s per reference request
}
MEASURED = "measured"
PRIOR = "prior"


def engine_version(node: NodeInfo, engine: str) -> str:
    return next((e.version for e in node.engines if e.name == engine), "")


def calibration(node: NodeInfo, engine: str, model_id: str) -> EngineCalibration | None:
    """The newest measurement of `engine` (at the version the node runs now) on `model_id`."""
    version = engine_version(node, engine)
    matching = [
        c
        for c in node.calibrations
        if c.engine == engine and c.model_id == model_id and c.engine_version == version
    ]
    return max(matching, key=lambda c: c.at, default=None)


def reference_seconds(measured: EngineCalibration) -> float:
    """How long the reference request would take at the measured speeds."""
    prefill = REFERENCE_PROMPT_TOKENS / max(measured.prefill_tokens_per_s, 1e-9)
    return prefill + REFERENCE_OUTPUT_TOKENS / max(measured.decode_tokens_per_s, 1e-9)


def _prior_index(kind: NodeKind, engine: str) -> int:
    order = PRIOR_ORDER.get(kind, ())
    return order.index(engine) if engine in order else len(order)


def engine_order(node: NodeInfo, model_id: str, engines: Iterable[str]) -> tuple[list[str], str]:
    """`engines` fastest first on `node` for `model_id`, and how they were ranked (MEASURED when every
    one of them has a calibration there, else PRIOR); ties keep the given order."""
    candidates = list(dict.fromkeys(engines))
    measured = {e: calibration(node, e, model_id) for e in candidates}
    if candidates and all(measured.values()):
        return sorted(candidates, key=lambda e: reference_seconds(measured[e])), MEASURED  # type: ignore[arg-type]
    return sorted(candidates, key=lambda e: _prior_index(node.kind, e)), PRIOR


def describe(node: NodeInfo, model_id: str, engine: str, how: str) -> str:
    """The reason part that says why `engine` ranks where it does on `node`."""
    measured = calibration(node, engine, model_id)
    if how == MEASURED and measured is not None:
        return (
            f"{engine} measured {measured.prefill_tokens_per_s:.0f} prefill / "
            f"{measured.decode_tokens_per_s:.1f} decode tok/s here"
        )
    return f"{engine} by the {node.kind} prior (not every engine measured here yet)"
