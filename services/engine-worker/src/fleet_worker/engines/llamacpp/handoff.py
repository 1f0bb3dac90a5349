"""KV handoffs of the llama.cpp engine, with llama.cpp, vLLM and MLX instances of the same model
(K rows in Hugging Face's order on the wire, kv.py).

A prefill-only request (`export`) fills its slot with all prompt tokens but the last, then its rows
[start_pos, end) leave as handoff chunks (read with llama_state_seq_get_data, converted by kv.py); a
request with `kv_import` gets the handed-over rows written into a free slot
(llama_state_seq_set_data) and feeds only its last prompt token. A handoff it cannot use (corrupt,
another layout, not from position 0) is logged and the prompt prefilled here, with the reason in the
last output's handoff.fallback. The shared KV tier is not served: the KV stays in the slots.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from fleet_store.handoff import HandoffError, HandoffWriter, assemble, read_folder
from fleet_store.kv import KVBlobError, WireTensor
from fleet_worker.engines.base import KVExport, KVImport
from fleet_worker.engines.llamacpp.context import read_seq_state, write_seq_state
from fleet_worker.engines.llamacpp.kv import (
    GGML_TYPES,
    WIRE_TO_GGML,
    SeqKV,
    SeqStateError,
    converted,
    keys_from_wire_order,
    keys_to_wire_order,
    parse_seq_state,
    seq_state,
)

EXPORT_CHUNK_ROWS = 256  # rows per handoff chunk: the decoder verifies and reads them as they come


@dataclass(frozen=True)
class SlotHandoff:
    """Moves whole slots of one decode context to and from handoff chunks. `layout` is the context's
    cache layout (context.kv_layout), None when it cannot be handed over (`problem` says why)."""

    ctx: ctypes.c_void_p
    layout: SeqKV | None
    problem: str
    kv_heads: int
    keys_permuted: bool  # K rows in llama.cpp's order of a head's dims (kv.PERMUTED_QK_ARCHITECTURES)

    def export(self, writer: HandoffWriter, spec: KVExport, seq_id: int, end: int) -> str:
        """Write the slot's rows [start_pos, end) as handoff chunks and end the handoff; "" or what
        went wrong (the handoff then ends with that error)."""
        try:
            kv = parse_seq_state(read_seq_state(self.ctx, seq_id))
            if not np.array_equal(kv.positions, np.arange(end)):
                raise SeqStateError(f"the slot holds positions {kv.positions[:3]}..., not 0..{end - 1}")
            source = GGML_TYPES[kv.k_type][0]
            wire = spec.wire_dtype or source
            for start in range(spec.start_pos, end, EXPORT_CHUNK_ROWS):
                stop = min(start + EXPORT_CHUNK_ROWS, end)
                writer.kv(
                    start,
                    stop,
                    {i: self._wire_rows(kv, i, start, stop, source, wire) for i in range(len(kv.keys))},
                )
            writer.done(spec.start_pos, end)
        except (SeqStateError, HandoffError, KVBlobError, KeyError) as error:
            writer.error(str(error))
            return str(error)
        return ""

    def _wire_rows(
        self, kv: SeqKV, layer: int, start: int, stop: int, source: str, wire: str
    ) -> tuple[WireTensor, WireTensor]:
        def tensor(rows: np.ndarray) -> WireTensor:
            data = np.ascontiguousarray(converted(rows, source, wire))
            return WireTensor(
                wire, (stop - start, self.kv_heads, rows.shape[1] // self.kv_heads), data.tobytes()
            )

        keys = kv.keys[layer][start:stop]
        if self.keys_permuted:
            keys = keys_to_wire_order(keys, self.kv_heads)
        return tensor(keys), tensor(kv.values[layer][start:stop])

    def load(self, spec: KVImport, seq_id: int, prompt: tuple[int, ...]) -> tuple[int, str]:
        """Write a received handoff into the slot: the prompt tokens it covers, or 0 and why it could
        not (the slot's cells may then hold part of it: the caller drops them)."""
        try:
            if self.layout is None:
                raise HandoffError(self.problem)
            if not spec.folder:
                raise HandoffError("the handoff broke after its first token")
            if spec.start_pos:
                raise HandoffError("llama.cpp takes whole-prompt handoffs (start_pos 0)")
            kv = assemble(read_folder(spec.folder), spec.handoff_id, spec.start_pos)
            if kv.end != len(prompt) - 1:
                raise HandoffError(f"handoff ends at token {kv.end}, the prompt needs {len(prompt) - 1}")
            if kv.states or sorted(kv.rows) != list(range(len(self.layout.keys))):
                raise HandoffError(f"handoff layers {sorted(kv.rows)} are not this model's")
            layout = self.layout
            target = GGML_TYPES[layout.k_type][0]

            def joined(pieces: list[WireTensor]) -> np.ndarray:
                arrays = [
                    np.frombuffer(t.data, dtype=GGML_TYPES[_ggml(t.dtype)][1]).reshape(t.shape[0], -1)
                    for t in pieces
                ]
                return converted(np.concatenate(arrays), pieces[0].dtype, target)

            def joined_keys(pieces: list[WireTensor]) -> np.ndarray:
                keys = joined(pieces)
                return keys_from_wire_order(keys, self.kv_heads) if self.keys_permuted else keys

            rows = [kv.rows[i] for i in range(len(layout.keys))]
            state = SeqKV(
                np.arange(kv.end, dtype=np.int32),
                tuple(joined_keys([k for k, _ in pairs]) for pairs in rows),
                tuple(joined([v for _, v in pairs]) for pairs in rows),
                layout.k_type,
                layout.v_type,
                layout.v_trans,
            )
            if any(k.shape[1] != want.shape[1] for k, want in zip(state.keys, layout.keys, strict=True)):
                raise HandoffError("the handoff's rows are not this model's width")
            if not write_seq_state(self.ctx, seq_state(state, seq_id), seq_id):
                raise HandoffError("llama.cpp refused the handed-over state")
        except (HandoffError, KVBlobError, SeqStateError, ValueError) as error:
            return 0, str(error)
        return kv.end, ""


def _ggml(wire: str) -> int:
    try:
        return WIRE_TO_GGML[wire]
    except KeyError:
        raise HandoffError(f"wire dtype {wire} cannot go into a llama.cpp cache") from None
