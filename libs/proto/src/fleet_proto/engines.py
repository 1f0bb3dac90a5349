"""What each engine can do: one table of plain facts, read by an instance's engine name.

Routing, placement and the worker ask `engine_facts(instance.engine)` whether an engine can hand KV
over, split a model across nodes or load MLX's quantized weights, instead of comparing names (as
mlx-lm keeps a model's facts on its ModelArgs). What a model is (its quantization, the node kinds
it runs best on) is on its ModelCard. The worker's EngineSpec (fleet_worker.engines.base) points
at its engine's entry here; an engine this table does not know can do none of these things.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import msgspec

from fleet_proto.common import NodeKind

EVERY_KIND: tuple[NodeKind, ...] = tuple(NodeKind)


class EngineFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine can do. Defaults describe an engine that does nothing special."""

    # disaggregation: KV travels in one wire layout, so any exporter pairs with any importer
    kv_export: bool = False  # prefills for another instance: writes a prompt's KV as handoff chunks
    kv_import: bool = False  # decodes from KV another instance handed over
    first_token_export: bool = False  # its prefill samples the request's first token too
    first_token_import: bool = False  # as a decoder, it starts from a first token the prefill sampled
    # as a decoder, the seconds per prompt token it spends taking handed-over KV into its cache
    kv_import_s_per_token: float = 0.0
    # the preference when the candidates are not all calibrated (measurements decide otherwise)
    prefill_preferred: bool = False  # compute-strong: the prefill side of a split request
    decode_preferred: bool = False  # bandwidth-strong: the decoder (seed rule)
    # its KV cache
    kv_local: bool = False  # its KV stays its own: no Fleet KV blocks, no KV folder, nothing indexed
    kv_memory_tier: bool = False  # Fleet's blocks in its memory (tier 1), budgeted and indexed per node
    # loading and running a model
    loads_weights: bool = True  # False: runs any model without its weights, only when asked for by name
    memory_headroom: float = 1.3  # a model needs its weights times this (KV cache, activations)
    pipeline: bool = False  # splits a model's layers across nodes
    prefill_progress: bool = False  # reports a long prompt's prefill progress within a step
    weight_formats: tuple[str, ...] = ()  # the formats it serves a model in, each calibrated apart
    quantizations: tuple[str, ...] = ()  # packed quantized formats it loads (ModelCard.quantization_format)
    devices: tuple[NodeKind, ...] = EVERY_KIND  # node kinds it runs on
    quantized_devices: tuple[NodeKind, ...] = EVERY_KIND  # node kinds it runs quantized weights on
    # its memory (fleet_proto.memory): where its weights and KV live, and how its KV cache is sized
    gpu_memory_on: tuple[NodeKind, ...] = ()  # kinds where it allocates on the GPU (else host memory)
    reserves_kv_cache: bool = False  # takes its whole KV cache at start: sized from what placement granted
    embeds: bool = False  # serves embedding models (ModelCard.embedding), pooled as their card says
    embedding_architectures: tuple[str, ...] = ()  # the model types it embeds ((): any it loads)


UNKNOWN_ENGINE = EngineFacts()

ENGINE_FACTS: Mapping[str, EngineFacts] = MappingProxyType(
    {
        # MLX: a pipeline's ranks form an mx.distributed ring over TCP (issue 15); its prefix blocks
        # live in its memory too. MLX has no quantized matmul on CUDA.
        "mlx": EngineFacts(
            kv_export=True,
            kv_import=True,
            decode_preferred=True,
            kv_memory_tier=True,
            pipeline=True,
            prefill_progress=True,
            quantizations=("mlx",),
            quantized_devices=(NodeKind.APPLE, NodeKind.CPU),
            embeds=True,  # sentence-transformers BERT models (mlx/embedding.py)
            embedding_architectures=("bert",),
        ),
        # vLLM: a prefill-only request runs the whole prompt and samples the first token; its own
        # pages are not indexed. Its weight formats are the dtypes it computes in.
        "vllm": EngineFacts(
            kv_export=True,
            kv_import=True,
            first_token_export=True,
            prefill_preferred=True,
            weight_formats=("float32", "bfloat16"),
            # On CUDA its weights and KV sit in the GPU's memory (the host's, on a unified-memory node).
            gpu_memory_on=(NodeKind.CUDA,),
            reserves_kv_cache=True,
            embeds=True,  # sentence-transformers models on its pooling runner (vllm/embedding.py)
        ),
        # llama.cpp: a model's GGUF, when it was staged with one; its KV is per-sequence prefix reuse
        # (not the card's dtype), converted to the wire layout at its edge. Its weight formats: the
        # GGUF as it is and re-encoded.
        "llamacpp": EngineFacts(
            kv_export=True,
            kv_import=True,
            first_token_import=True,
            # measured: a 1,878-token split request spent 1.31 s importing its KV (trace, 2026-12-06)
            kv_import_s_per_token=0.0007,
            kv_local=True,
            weight_formats=("as-is", "Q8_0", "F16"),
        ),
        # Echo loads no weights, so it needs no memory and runs any model (FLEET_NODE_ENGINES offers
        # it; never probed as installed); it moves no KV.
        "echo": EngineFacts(loads_weights=False, memory_headroom=0.0),
    }
)


def engine_facts(engine: str, table: Mapping[str, EngineFacts] = ENGINE_FACTS) -> EngineFacts:
    """The facts of `engine`; an unknown engine can do nothing special (UNKNOWN_ENGINE)."""
    return table.get(engine, UNKNOWN_ENGINE)


def engines_where(
    fact: Callable[[EngineFacts], bool], table: Mapping[str, EngineFacts] = ENGINE_FACTS
) -> tuple[str, ...]:
    """The engines of `table` that have `fact`, in table order."""
    return tuple(name for name, facts in table.items() if fact(facts))
