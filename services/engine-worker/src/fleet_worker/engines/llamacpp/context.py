"""llama.cpp contexts through llama-cpp-python's C API (ctypes): the helpers the engine's parts share
to make a context, fill a llama_batch, read a logits row and move a sequence's KV between contexts.

A context holds `n_seq_max` sequences (seq ids) over one unified KV buffer of `n_ctx` cells, so short
and long sequences share it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import numpy as np

from fleet_worker.engines.llamacpp.kv import SeqKV, SeqStateError, parse_seq_state

# KV cells when n_ctx is not asked for: the model's trained context, within these bounds. Memory
# grows with the cells twice (the KV cache and the attention's compute buffer): SmolLM2-135M F16
# measured 1062 MiB resident at 32768 cells (KV 720 MiB, compute 646 MiB) and 521 MiB at 8192.
MIN_N_CTX, MAX_N_CTX = 4096, 32768


class LlamaCppError(RuntimeError):
    pass


def gguf_file(model_dir: Path) -> Path:
    """The model folder's one GGUF file."""
    found = sorted(Path(model_dir).glob("*.gguf"))
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise FileNotFoundError(f"llama.cpp serves one *.gguf file; {model_dir} holds {names}")
    return found[0]


def kv_cells(context_length: int) -> int:
    """The KV cells of a context when none are asked for: one sequence of the model's whole context
    fits, the slots share them (a full cache makes new sequences wait)."""
    return max(MIN_N_CTX, min(context_length, MAX_N_CTX))


def context_params(
    n_ctx: int, n_batch: int, n_seq_max: int, threads: int, flash_attn: bool, n_ubatch: int = 0
):
    params = llama_cpp.llama_context_default_params()
    params.flash_attn_type = (
        llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_ubatch or n_batch
    params.n_seq_max = n_seq_max
    params.kv_unified = True
    params.n_threads = params.n_threads_batch = threads
    return params


def architecture(model: ctypes.c_void_p) -> str:
    value = ctypes.create_string_buffer(64)
    found = llama_cpp.llama_model_meta_val_str(model, b"general.architecture", value, len(value))
    return value.value.decode() if found > 0 else ""


def put(batch: llama_cpp.llama_batch, n: int, seq_id: int, pos: int, token: int, logits: bool) -> None:
    batch.token[n] = token
    batch.pos[n] = pos
    batch.n_seq_id[n] = 1
    batch.seq_id[n][0] = seq_id
    batch.logits[n] = logits


def logits_row(ctx: ctypes.c_void_p, index: int, vocab_size: int) -> np.ndarray:
    """The logits of batch row `index` of the last llama_decode (a view into llama.cpp's buffer)."""
    pointer = llama_cpp.llama_get_logits_ith(ctx, index)
    return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), (vocab_size,))


def _state_buffer(ctx: ctypes.c_void_p, seq_id: int) -> tuple[ctypes.Array, int]:
    size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
    buffer = (ctypes.c_uint8 * size)()
    return buffer, llama_cpp.llama_state_seq_get_data(ctx, buffer, size, seq_id)


def read_seq_state(ctx: ctypes.c_void_p, seq_id: int) -> bytes:
    buffer, written = _state_buffer(ctx, seq_id)
    return ctypes.string_at(buffer, written)


def write_seq_state(ctx: ctypes.c_void_p, data: bytes, seq_id: int) -> bool:
    buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    return bool(llama_cpp.llama_state_seq_set_data(ctx, buffer, len(data), seq_id))


def move_seq(source: ctypes.c_void_p, target: ctypes.c_void_p, seq_id: int) -> bool:
    """Copy a sequence's KV from one context to another (same layout); the target's cells of that
    sequence are replaced."""
    buffer, written = _state_buffer(source, seq_id)
    return bool(written) and llama_cpp.llama_state_seq_set_data(target, buffer, written, seq_id) == written


def kv_layout(ctx: ctypes.c_void_p, batch: llama_cpp.llama_batch) -> tuple[SeqKV | None, str]:
    """A context's cache layout (types, V transposed or not), read off a one-token sequence run with
    `batch`, or why its KV cannot be handed over."""
    batch.n_tokens = 1
    put(batch, 0, 0, 0, 0, False)
    try:
        if llama_cpp.llama_decode(ctx, batch) != 0:
            return None, "llama.cpp could not run a probe token"
        return parse_seq_state(read_seq_state(ctx, 0)), ""
    except SeqStateError as error:
        return None, f"this llama.cpp cache cannot be handed over: {error}"
    finally:
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, -1, -1)
