"""Prefill apart (CPU builds): llama.cpp multiplies a long prompt fastest with F16 weights and a batch
of decode rows fastest with Q8_0 ones (weights.prefill_weight_type), so the engine can hold a second,
prefill-only copy of the weights with its own context. A prompt with at least
`prefill_apart_min_tokens` tokens to prefill is fed there, all but its last token (the reused prefix
copied over first); its sequence state then moves into its slot of the decode context
(llama_state_seq_get_data / set_data, ~15 MB and ~14 ms for 670 tokens), and the last prompt token is
fed there with the decoding rows, in the same step. Every first token is sampled from the decode
weights, so a prompt asked again, a prompt whose KV was handed over and a cold run give the same
tokens.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

from fleet_worker.engines.llamacpp.context import LlamaCppError, context_params, kv_layout
from fleet_worker.engines.llamacpp.kv import SeqKV
from fleet_worker.engines.llamacpp.weights import (
    loaded_file_type,
    memory_bytes,
    prefill_weight_type,
    served_gguf,
)

log = logging.getLogger("fleet_worker.llamacpp")

PREFILL_APART_MIN_TOKENS = 16  # measured: F16 beats Q8_0 from 16 prompt tokens, not at 8
# A prefill step on the F16 copy takes up to PREFILL_BATCH tokens (llama-server's n_batch), run by
# llama.cpp in ubatches of PREFILL_UBATCH: a 542-token prompt in one call, and 256 rows measured a
# little faster than 512 (1.25 vs 1.34 s, medians of 6).
PREFILL_BATCH = 2048
PREFILL_UBATCH = 256


@dataclass(eq=False)
class PrefillContext:
    """The prefill-only weights and their context: seq ids are the decode slots' own."""

    model: ctypes.c_void_p
    ctx: ctypes.c_void_p
    memory: ctypes.c_void_p
    batch: llama_cpp.llama_batch
    n_ctx: int
    weight_type: str

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def open_prefill_context(
    decode_model: ctypes.c_void_p,
    original: Path,
    asked: str,
    model_params,
    *,
    threads: int,
    flash_attn: bool,
    window: int,
    prefill_batch: int,
    n_seq_max: int,
    decode_layout: SeqKV | None,
    probe_batch: llama_cpp.llama_batch,
) -> PrefillContext | None:
    """The prefill-only weights and context, or None when prompts prefill with the decode ones:
    none asked, or the copy's cache is not laid out as the decode one's (sequences could not move)."""
    f16_bytes = 2 * int(llama_cpp.llama_model_n_params(decode_model))
    gpu = bool(llama_cpp.llama_supports_gpu_offload())
    served_type = loaded_file_type(decode_model)  # the decode weights, already loaded
    target = prefill_weight_type(asked, served_type, gpu, f16_bytes, memory_bytes())
    if target is None:
        return None
    path = served_gguf(original, target, threads)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    if not model:
        raise LlamaCppError(f"llama.cpp could not load {path}")
    # a prompt prefills there up to the window, with the next prompt's first chunk beside it
    n_ctx = window + prefill_batch
    ubatch = min(PREFILL_UBATCH, prefill_batch)
    params = context_params(n_ctx, prefill_batch, n_seq_max, threads, flash_attn, ubatch)
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        llama_cpp.llama_model_free(model)
        raise LlamaCppError(f"llama.cpp could not make a prefill context of {n_ctx} cells for {path}")
    prefill = PrefillContext(
        model,
        ctx,
        llama_cpp.llama_get_memory(ctx),
        llama_cpp.llama_batch_init(prefill_batch, 0, 1),
        int(llama_cpp.llama_n_ctx(ctx)),
        target,
    )
    layout, problem = kv_layout(ctx, probe_batch)
    same = (
        layout is not None
        and decode_layout is not None
        and (
            (layout.k_type, layout.v_type, layout.v_trans)
            == (decode_layout.k_type, decode_layout.v_type, decode_layout.v_trans)
        )
    )
    if not same:
        log.warning(
            "llama.cpp: prefilling with the decode weights, the %s copy's cache differs %s",
            target,
            problem,
        )
        prefill.close()
        return None
    return prefill
