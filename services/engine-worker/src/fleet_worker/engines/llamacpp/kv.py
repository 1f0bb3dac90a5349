"""llama.cpp's per-sequence KV state (llama_state_seq_get_data / set_data) <-> Fleet KV rows (pure).

The layout this relies on is llama.cpp's `llama_kv_cache::state_write` as vendored by
llama-cpp-python 0.3.36 (the pinned version; the engine tests check a round trip through it), all
little-endian:

    u32 magic 0xaf143cd8, i32 seq_id               (llama_context::state_seq_get_data's header)
    u32 n_stream                                   (1 with a unified KV buffer)
    per stream: u32 cell_count, then when cell_count > 0:
        per cell:  i32 pos, u32 n_seq_id, i32 seq_id x n_seq_id      (no cell extension: models
                                                                     with M-RoPE or PLE add one)
        u32 v_trans, u32 n_layer
        per layer: i32 k_type, u64 k_row_bytes, cell_count rows of K (n_embd_k_gqa values each)
        v_trans 0: per layer: i32 v_type, u64 v_row_bytes, cell_count rows of V
        v_trans 1: per layer: i32 v_type, u32 v_elem_bytes, u32 n_embd_v_gqa,
                   then n_embd_v_gqa runs of cell_count values (V transposed)

Cells are in buffer order, not position order; rows are sorted by position here. A K row holds the
kv heads one after the other (head_dim values each), after RoPE. For llama-architecture GGUFs
(`PERMUTED_QK_ARCHITECTURES`) a head's dimensions are in llama.cpp's own order: the GGUF converter
permutes q/k weight rows so that llama.cpp's rotation of adjacent pairs (2i, 2i+1) computes what
Hugging Face's rotate-half computes on (i, i + head_dim/2). The wire carries the Hugging Face order
(what vLLM and MLX cache from the safetensors of the same model), so `keys_to_wire_order` /
`keys_from_wire_order` undo and redo that permutation and llama.cpp KV moves to and from the other
engines. Only unquantized cache types convert (F32, F16, BF16); a quantized cache keeps its KV local.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

# ggml type id -> (Fleet wire dtype, numpy dtype of its bytes; bf16 travels as uint16)
GGML_TYPES = {0: ("F32", np.float32), 1: ("F16", np.float16), 30: ("BF16", np.uint16)}
WIRE_TO_GGML = {wire: type_id for type_id, (wire, _) in GGML_TYPES.items()}
STATE_MAGIC = 0xAF143CD8
# general.architecture values whose GGUF converter permutes q/k rows (convert_hf_to_gguf's LlamaModel)
PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})


class SeqStateError(ValueError):
    """State bytes in a layout this module does not know, or rows that do not fit the cache."""


@dataclass(frozen=True)
class SeqKV:
    """One sequence's KV: positions (sorted) and per layer K and V as [cells, n_embd] arrays."""

    positions: np.ndarray
    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    k_type: int
    v_type: int
    v_trans: bool


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = memoryview(data), 0

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise SeqStateError("the state ends early")
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return values

    def array(self, count: int, dtype: np.dtype) -> np.ndarray:
        size = count * np.dtype(dtype).itemsize
        if self.at + size > len(self.data):
            raise SeqStateError("the state ends early")
        out = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.at)
        self.at += size
        return out


def _numpy_type(type_id: int) -> np.dtype:
    try:
        return np.dtype(GGML_TYPES[type_id][1])
    except KeyError:
        raise SeqStateError(f"cache type {type_id} is quantized or unknown: its KV cannot convert") from None


def parse_seq_state(data: bytes) -> SeqKV:
    reader = _Reader(data)
    magic, _ = reader.take("<Ii")
    if magic != STATE_MAGIC:
        raise SeqStateError(f"not a llama.cpp sequence state (magic {magic:#x})")
    (n_stream,) = reader.take("<I")
    if n_stream != 1:
        raise SeqStateError(f"{n_stream} KV streams; only a unified KV buffer converts")
    (cells,) = reader.take("<I")
    if cells == 0:
        empty = np.zeros(0, dtype=np.int32)
        return SeqKV(empty, (), (), 1, 1, False)
    positions = np.empty(cells, dtype=np.int32)
    for i in range(cells):
        pos, n_seq = reader.take("<iI")
        reader.take(f"<{n_seq}i")
        positions[i] = pos
    v_trans, n_layer = reader.take("<II")
    keys, k_types = [], set()
    for _ in range(n_layer):
        k_type, row_bytes = reader.take("<iQ")
        dtype = _numpy_type(k_type)
        keys.append(reader.array(cells * row_bytes // dtype.itemsize, dtype).reshape(cells, -1))
        k_types.add(k_type)
    values, v_types = [], set()
    for _ in range(n_layer):
        if not v_trans:
            v_type, row_bytes = reader.take("<iQ")
            dtype = _numpy_type(v_type)
            values.append(reader.array(cells * row_bytes // dtype.itemsize, dtype).reshape(cells, -1))
        else:
            v_type, _, n_embd = reader.take("<iII")
            dtype = _numpy_type(v_type)
            values.append(reader.array(cells * n_embd, dtype).reshape(n_embd, cells).T)
        v_types.add(v_type)
    if reader.at != len(data) or len(k_types) > 1 or len(v_types) > 1:
        raise SeqStateError("the state holds more than this layout describes (a cell extension?)")
    order = np.argsort(positions, kind="stable")
    return SeqKV(
        positions[order],
        tuple(np.ascontiguousarray(k[order]) for k in keys),
        tuple(np.ascontiguousarray(v[order]) for v in values),
        k_types.pop(),
        v_types.pop(),
        bool(v_trans),
    )


def seq_state(kv: SeqKV, seq_id: int) -> bytes:
    """The bytes llama_state_seq_set_data reads back for `kv` (as one stream, in its layout)."""
    cells = len(kv.positions)
    parts = [struct.pack("<IiII", STATE_MAGIC, seq_id, 1, cells)]
    if cells == 0:
        return b"".join(parts)
    parts += [struct.pack("<iIi", int(pos), 1, seq_id) for pos in kv.positions]
    parts.append(struct.pack("<II", int(kv.v_trans), len(kv.keys)))
    for k in kv.keys:
        k = np.ascontiguousarray(k, dtype=_numpy_type(kv.k_type))
        parts += [struct.pack("<iQ", kv.k_type, k.shape[1] * k.itemsize), k.tobytes()]
    for v in kv.values:
        v = np.ascontiguousarray(v, dtype=_numpy_type(kv.v_type))
        if kv.v_trans:
            parts += [
                struct.pack("<iII", kv.v_type, v.itemsize, v.shape[1]),
                np.ascontiguousarray(v.T).tobytes(),
            ]
        else:
            parts += [struct.pack("<iQ", kv.v_type, v.shape[1] * v.itemsize), v.tobytes()]
    return b"".join(parts)


def to_float32(array: np.ndarray, wire: str) -> np.ndarray:
    if wire == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def from_float32(array: np.ndarray, wire: str) -> np.ndarray:
    """f32 values in a wire dtype's numpy form (bf16 rounded to nearest even)."""
    if wire == "BF16":
        bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return array.astype(GGML_TYPES[WIRE_TO_GGML[wire]][1])


def converted(array: np.ndarray, source: str, target: str) -> np.ndarray:
    """Rows from one wire dtype to another (unchanged when they are the same)."""
    if source == target:
        return array
    return from_float32(to_float32(array, source), target)


def keys_to_wire_order(keys: np.ndarray, heads: int) -> np.ndarray:
    """K rows [cells, heads * head_dim] from llama.cpp's pair order to Hugging Face's half order: a
    head's dims (0, 1, 2, 3, ...) = (x0, y0, x1, y1, ...) become (x0, x1, ..., y0, y1, ...)."""
    cells = keys.shape[0]
    per_head = keys.reshape(cells, heads, -1)
    halves = np.concatenate([per_head[..., 0::2], per_head[..., 1::2]], axis=-1)
    return halves.reshape(cells, -1)


def keys_from_wire_order(keys: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of keys_to_wire_order."""
    cells = keys.shape[0]
    per_head = keys.reshape(cells, heads, -1)
    half = per_head.shape[-1] // 2
    pairs = np.empty_like(per_head)
    pairs[..., 0::2], pairs[..., 1::2] = per_head[..., :half], per_head[..., half:]
    return pairs.reshape(cells, -1)
